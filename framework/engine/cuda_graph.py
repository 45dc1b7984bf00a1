"""CUDA graphs for decode, as SGLang v0.4's CudaGraphRunner (`srt/model_executor/cuda_graph_runner.py`) runs them.

At start, one graph per batch-size bucket is captured on static input buffers (input ids, positions, KV slots to
write, req_to_token rows, sequence lengths) sized for the largest bucket, all graphs sharing one memory pool. A step
that may run a graph copies its batch into the buffers, pads the rest, replays its bucket's graph and keeps the
first rows of the logits. SGLang v0.4's rules, and where servelab differs (docs/fidelity.md, "CUDA graphs"):

- buckets (`capture_bs`): [1, 2, 4] + multiples of 8 up to 160, kept when <= `cuda_graph_max_bs` (default 160;
  v0.4.0's `server_args.py`: min(., 96) under DP attention, gone in v0.4.1: `engine.cuda_graph_dp_attention_max_bs`)
  and <= the req_to_token rows (`max_running_requests`), plus that row count and one less when the list outgrows it.
  `engine.cuda_graph_bs` replaces the list; servelab continues the multiples of 8 past 160 when
  `engine.cuda_graph_max_bs` is raised above it (SGLang's list stops at 160 whatever the max says).
- which steps replay (`ModelRunner.forward`: `forward_mode.is_cuda_graph()` and `CudaGraphRunner.can_run`): DECODE
  and IDLE batches of at most the largest bucket. Under DP attention the size is the largest of every rank's token
  count (`max(global_num_tokens)`), so every rank pads to the SAME bucket and the FFN's collectives match, and the
  step replays only when every rank is in decode or idle (`can_run_dp_cuda_graph`: every DP group's bid, exchanged
  by the instance step, framework/engine/step.py); an IDLE rank replays a batch of padding only. A graph is captured
  as if every rank held the bucket's rows (`global_num_tokens = [bs] * size`).
- padding (`replay`): seq_lens of padded rows = 1 (the triton backend's `get_cuda_graph_seq_len_fill_value`),
  out_cache_loc = 0 (the KV pool's padding sink). servelab also points padded rows at the req_to_token padding row
  and token 0 (SGLang leaves the previous batch's values there) and zeroes their hidden state (`row_mask`): with no
  biases they stay exactly zero, read and write only slot 0, and the MoE layers do not count them as routed tokens.
- context: SGLang's attention kernels read each row's own length inside a graph. servelab's decode attention is a
  gather of `kv_width` slots per row, fixed at capture (`engine.cuda_graph_max_context`); a step whose longest
  context exceeds it runs eagerly, on the padded batch (so a DP peer's replayed collectives still match).
- off: `engine.cuda_graph=false` (SGLang's `--disable-cuda-graph`); no CUDA (one log line); a decode forward that
  makes host syncs (checked with torch's sync debug mode before capture: moe=reference, the torch twin of the fused
  kernel, ep's all-to-all) cannot be captured: one warning, eager.

Every forward step is decided and counted once, by the instance step (`GraphPolicy.decide` and `count`; the
simulator decides with a GraphPolicy alone): replayed, or eager for the first reason that held, in this order: `mode`
(EXTEND), `disagree` (DP attention: another rank's batch is not decode or idle), `size` (more rows than the largest
bucket), `off` (graphs off, for any of the reasons above), `context`. The capture is a small injectable piece
(`CudaGraphCapture` on CUDA; tests on a CPU pass `EagerCapture`), so the whole runner runs on a CPU.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable, NamedTuple

import torch

from framework.dist.group import Group
from framework.contracts.batch import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)

SGLANG_MAX_BS = 160            # server_args.cuda_graph_max_bs on a GPU with >= 25 GB
SGLANG_DP_ATTENTION_MAX_BS = 160   # v0.4.1 (PR #2484 removed v0.4.0's min(., 96) under DP attention)
SGLANG_V040_DP_ATTENTION_MAX_BS = 96   # v0.4.0's: engine.cuda_graph_dp_attention_max_bs=96
SEQ_LEN_FILL = 1               # a padded row attends to one slot, the padding sink (its own zero latent)
REASONS = ("mode", "disagree", "size", "off", "context")
EAGER_COUNTERS = {r: f"graph_eager_{r}_steps" for r in REASONS}
GRAPH_COUNTERS = ("graph_replayed_steps", "graph_eager_steps", *EAGER_COUNTERS.values())

Replay = Callable[[], torch.Tensor]


def capture_sizes(max_bs: int, buckets: list[int], max_running: int) -> list[int]:
    """The batch sizes to capture: `buckets` (default SGLang's [1, 2, 4, 8, 16, ...]) up to max_bs and the
    req_to_token rows. SGLang v0.4.1 (`cuda_graph_runner.py`): when the default list outgrows the request pool, the
    pool's size and that less one are captured too."""
    sizes = buckets or [1, 2, 4, *range(8, max_bs + 1, 8)]
    if not buckets and max(sizes) > max_running:
        sizes = [*sizes, max_running - 1, max_running]
    return sorted({b for b in sizes if 1 <= b <= min(max_bs, max_running)})


class NotCapturable(RuntimeError):
    """The decode forward cannot live in a CUDA graph (it makes the host wait for the GPU)."""


class CudaGraphCapture:
    """Capture on CUDA: two warm-up runs on a side stream (the second counts host syncs: any one refuses the
    capture), then `torch.cuda.graph` into the pool shared by every graph of the runner."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        self.checked = False

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Replay:
        from framework.contracts.moe import count_host_syncs
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()                                   # compiles kernels, initialises libraries
            if not self.checked and (syncs := count_host_syncs(fn)):
                raise NotCapturable(f"the decode forward makes {syncs} host syncs")
            self.checked = True
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class EagerCapture:
    """The CPU stand-in: a 'replay' runs the captured function again on the static buffers and writes into the one
    output tensor, as a graph's replay overwrites its output."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Replay:
        out = fn()

        def replay() -> torch.Tensor:
            return out.copy_(fn())
        return replay


class Decision(NamedTuple):     # a tuple: made for every DP group at every step, the simulator's too
    bucket: int | None      # the captured batch size this step pads to (None: too big, or an EXTEND step)
    reason: str | None      # why the step runs eagerly (one of REASONS); None: it replays


class GraphPolicy:
    """Which steps may replay a decode graph, and the count of what each step did: the rule of GraphRunner below,
    without the model (the simulator decides with it alone). `captured`: graphs exist to replay (the runner: it
    captured some; the simulator: the priced hardware has them and engine.cuda_graph is on)."""

    def __init__(self, cfg, dp_attention: bool, max_running: int, context_width: int, captured: bool = False):
        max_bs = cfg.cuda_graph_max_bs or (cfg.cuda_graph_dp_attention_max_bs if dp_attention else SGLANG_MAX_BS)
        self.sizes = capture_sizes(max_bs, list(cfg.cuda_graph_bs), max_running)
        self.width = min(cfg.cuda_graph_max_context, context_width)
        self.stats = dict.fromkeys(GRAPH_COUNTERS, 0)
        self._captured = captured

    @property
    def captured(self) -> bool:
        return self._captured

    def decide(self, batch: ForwardBatch) -> Decision:
        if not (batch.mode.is_decode() or batch.mode.is_idle()):
            return Decision(None, "mode")
        if not batch.can_run_graph:
            return Decision(None, "disagree")
        rows = max(batch.global_num_tokens) if batch.global_num_tokens else len(batch.reqs)
        if rows > self.sizes[-1]:
            return Decision(None, "size")
        bucket = self.sizes[bisect.bisect_left(self.sizes, rows)]
        if not self.captured:
            return Decision(bucket, "off")
        if batch.seq_lens_cpu and max(batch.seq_lens_cpu) > self.width:
            return Decision(bucket, "context")
        return Decision(bucket, None)

    def count(self, decision: Decision, steps: int = 1) -> None:
        """`steps` forward steps ran as `decision` says: replayed, or eager for its reason."""
        if decision.reason is None:
            self.stats["graph_replayed_steps"] += steps
        else:
            self.stats["graph_eager_steps"] += steps
            self.stats[EAGER_COUNTERS[decision.reason]] += steps


class GraphRunner(GraphPolicy):
    """One rank's decode graphs: pads, replays (or runs eagerly) as the step's decision says."""

    def __init__(self, cfg, model, pool, par, table: torch.Tensor, max_running: int, device: torch.device):
        super().__init__(cfg, type(par).dp_size(par.cfg) > 1, max_running, table.shape[1])
        self.model, self.pool, self.par, self.table = model, pool, par, table
        self.graphs: dict[int, Replay] = {}
        n, long = max(self.sizes), dict(dtype=torch.long, device=device)
        self.input_ids, self.positions = torch.zeros(n, **long), torch.zeros(n, **long)
        self.out_cache_loc, self.req_pool_indices = torch.zeros(n, **long), torch.zeros(n, **long)
        self.seq_lens = torch.full((n,), SEQ_LEN_FILL, **long)
        self.row_mask = torch.zeros(n, dtype=model.embed.dtype, device=device)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self, capture: Callable[[Callable[[], torch.Tensor]], Replay]) -> None:
        """One graph per bucket, largest first (the smaller ones then fit in the pool's memory). Nothing is counted
        and no request's KV is touched: every row is padding."""
        groups = [g for g in vars(self.par).values() if isinstance(g, Group) and g is not self.par.control]
        timeouts = [g.timeout_s for g in groups]
        try:
            for g in groups:    # a timed wait polls the GPU from the host, which a capturing stream forbids
                g.timeout_s = None
            for bs in reversed(self.sizes):
                self.graphs[bs] = capture(lambda bs=bs: self._padded_forward(bs, self.width))
        except NotCapturable as exc:
            self.graphs.clear()
            moe = {type(layer.backend).__name__ for layer in self.model.moe_layers()}
            log.warning("CUDA graphs off: %s (MoE backend %s); decode runs eagerly. moe=triton_fused with the "
                        "compiled kernel makes none", exc, ", ".join(sorted(moe)) or "-")
        finally:
            for g, timeout_s in zip(groups, timeouts):
                g.timeout_s = timeout_s

    def forward(self, batch: ForwardBatch, decision: Decision | None = None) -> torch.Tensor:
        """The logits of `batch` (on the device), through its bucket's graph when `decision` (the step's; default:
        decided here) replays one."""
        decision = decision if decision is not None else self.decide(batch)
        if decision.reason in (None, "context"):
            self._fill(batch)
            if decision.reason is None:
                out = self.graphs[decision.bucket]()
            else:
                out = self._padded_forward(decision.bucket, max(batch.seq_lens_cpu))
            return out[:len(batch.reqs)]
        return self.model(batch, self.pool, self.par)

    def _fill(self, batch: ForwardBatch) -> None:
        """The batch's rows into the static buffers; every row after them is padding."""
        n = len(batch.reqs)
        for buf, rows, pad in ((self.input_ids, batch.input_ids, 0), (self.positions, batch.positions, 0),
                               (self.out_cache_loc, batch.out_cache_loc, 0),
                               (self.req_pool_indices, batch.req_pool_indices, 0),
                               (self.seq_lens, batch.seq_lens, SEQ_LEN_FILL)):
            if n:
                buf[:n].copy_(rows)
            buf[n:].fill_(pad)
        self.row_mask[:n].fill_(1)
        self.row_mask[n:].zero_()

    def _padded_forward(self, bs: int, width: int) -> torch.Tensor:
        """The model on the first `bs` rows of the static buffers, each attending over `width` slots, laid out as
        if every rank held `bs` rows."""
        batch = ForwardBatch(ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                             out_cache_loc=self.out_cache_loc[:bs], req_to_token=self.table, kv_width=width,
                             req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                             row_mask=self.row_mask[:bs], global_num_tokens=[bs] * self.par.size,
                             can_run_graph=True)
        return self.model(batch, self.pool, self.par)
