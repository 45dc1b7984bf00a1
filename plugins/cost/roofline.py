"""sim/cost=roofline: a step's time from the FLOPs and bytes of every kernel of a DeepSeek-style MLA + MoE model,
on a GPU given as data (conf/hardware/), with efficiency terms fitted on measured profiles (framework/sim/cost/).

Per layer, as SGLang v0.4 runs it: fused add + RMSNorm, MLA projections (q_a/q_b or q, kv_a, o; q_a and kv_a
replicated across attention-TP ranks), RoPE; attention in the normal form for a prefill batch without any cached
prefix (kv_b expands the latent, causal attention over the new tokens) and in the weight-absorbed form otherwise
(decode reads each request's (kv_lora_rank + qk_rope_head_dim)-wide latent once for all heads); then a dense FFN
(the first `first_k_dense_replace` layers) or a MoE: gate, routed experts (weights read for the experts the tokens
touch: E * (1 - (1 - k/E)^T) in expectation, split per rank as the backend splits them), shared experts. Once per
step: embedding, final norm, lm_head on each request's last token. Collectives: `Step.collectives` when given, else
what the parallelism and MoE plugins declare for the step's tokens (plugins/cost/_layout.py), as is the split of
heads, vocabulary and experts over the ranks. Ranks wait for each other at every layer: a
step costs the slowest rank's attention, the FFN, and the communication, with no overlap.

Without a CUDA graph a step costs at least its kernel count x hardware.launch_overhead_us (the host launches
kernels one by one; the GPU runs them as they come).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from framework.core.registry import COST, MOE
from framework.contracts.cost import BatchShape, CostConfig, CostModel, InstanceShape, Step, itemsize
from framework.gpu.roofline import Roofline
from framework.model.config import WeightDtype
from plugins.cost._host import combine, eager_floor_s, overlapped, scheduler_s
from plugins.cost._layout import declared_collectives, layout_for, plugin_configs
from plugins.cost.lib import deepep, deepgemm, fa3, fused_moe_triton
from plugins.cost.lib.eplb_moves import EPLBMoves
from plugins.cost.lib.expert_load import SOURCES, expected_touched, layer_loads, rank_imbalance, rebalance
from plugins.cost.lib.load_fluctuation import LoadFluctuation
from plugins.cost.lib.tbo import decode_layer, overlapped_s, prefill_layer


@dataclass
class RooflineConfig(CostConfig):
    name: str = "roofline"       # the linear weights' format is the model's: model.weight_dtype (fp8: the fp8 peak)
    # SGLang v0.4's MLA decode kernel (triton_ops/decode_attention.py, _decode_grouped_att_m_fwd) runs one program
    # per request per block of BLOCK_H = 16 heads, and each program reads the request's whole latent: a rank with
    # h heads reads it ceil(h / 16) times (TP x8 of DeepSeek-V2: once; DP attention: 8 times). 0: once for all heads
    # (a FlashMLA-style kernel)
    decode_head_block: int = 16
    # -- SGLang v0.4's kernels (issue 19, item 5; docs/fidelity.md "Cost model terms") -----------------------------
    # the Triton MLA decode runs in two stages (decode_attention.py, num_kv_splits=8): stage 1 writes each split's
    # fp32 partial output and log-sum-exp (B x H x splits x (kv_lora_rank + 1) x 4 bytes), stage 2 reads them and
    # reduces. 0: one stage (no partials)
    mla_decode_kv_splits: int = 8
    # which Triton MLA decode kernel (issue 19, round 2): "split_kv", the one above (SGLang PR #2394, merged
    # 2024-12-08, in v0.4.1), or "logits", the kernel before it (issue #2271, 2024-11-30: "missing a flash decoding
    # like optimization"; what PR #1970's November 2024 figures ran): stage 1 writes every head's score per cached
    # token to attn_logits [heads, sum(seq_lens)] in the backend's reduce dtype, stage 2 reads them back and reads
    # the latent's first kv_lora_rank values again; each stage reads the latent once per block of BLOCK_H heads
    # (LOGITS_KERNEL below: 64, so twice at 128 heads a rank) whatever decode_head_block says
    mla_decode_kernel: str = "split_kv"
    attn_logits_bytes: int = 2        # that reduce dtype: fp16 (4: --triton-attention-reduce-in-fp32)
    # that kernel's occupancy terms (wave factor, spilled registers; _logits_decode): false prices its bytes only
    mla_decode_occupancy: bool = True
    # the fraction of the attention compute rate the absorbed-MLA extend kernel (extend_attention.py over the
    # 576/512-wide latent) reaches; no public measurement of the 2024 kernel: 1.0 (the dense-GEMM fit)
    absorbed_extend_eff: float = 1.0
    # fp8 checkpoints: every fp8 GEMM's input is quantized per token first (vLLM's scaled_fp8_quant, which v0.4
    # calls): one kernel reading the bf16 activations and writing fp8 + one scale per row
    fp8_act_quant: bool = True
    # the fraction of the fitted GEMM rates the fp8 Triton fused MoE (fused_moe_triton, default configs) reaches;
    # no public measurement of the 2024 kernel: 1.0 (the dense-GEMM fit)
    fused_moe_fp8_eff: float = 1.0
    # the routed experts of an fp8 model on a backend that runs them as one fused MoE call (MoEBackend.fused_moe_call:
    # moe=triton_fused) at most at the published rate of that kernel at vLLM's 2024 default config on an H100 SXM, by
    # rows per touched expert (plugins/cost/lib/fused_moe_triton.py: vLLM PR #24700's "Main" listing; issue 19, round
    # 3); false: the fitted GEMM rates (over fused_moe_fp8_eff)
    fused_moe_rates: bool = False
    # past the published rows (256 a touched expert): the last measured rate (nearest: round 3's prediction) or the
    # last segment's log2 slope carried on (extend: the sensitivity of a cell that runs past them)
    fused_moe_rates_past: str = "nearest"
    # -- the host (issue 19, item 4; plugins/cost/_host.py) ----------------------------------------------------------
    overlap_schedule: str = "auto"    # auto: v0.4's choice (off under DP attention or on Triton attention) | on | off
    attention_backend: str = "auto"   # auto: triton (v0.4 runs every MLA model on it) | triton | flashinfer
    # servelab's scheduler on this repository's CPU (experiments/calibrate/host.py, results.json "fit")
    host_step_us: float = 57.5
    host_running_us: float = 0.84
    host_new_req_us: float = 12.8
    host_output_token_us: float = 0.0     # per token a DECODE batch's requests have generated so far
    host_new_token_us: float = 0.0        # per new token of an EXTEND batch (building its ids and KV slots)
    # the 2024 H100 host's single-thread time / this machine's (Geekbench 5 single thread: Xeon Platinum 8468,
    # Sapphire Rapids as in a DGX H100, 1,257 vs EPYC 7763 at this machine's 2.45 GHz, 1,249)
    host_speed_factor: float = 0.994
    eager_floor: bool = True          # an eager forward costs at least the host's launches per layer (below)
    # SGLang PR #1401 (bench_latency, batch 1, Triton, eager): Llama-3-8B 9.28 ms / 32 layers; DeepSeek-Coder-V2-Lite
    # "4x" its graph's 6.22 ms = 24.9 ms, less one dense layer, over its 26 MLA + MoE layers
    eager_dense_layer_us: float = 290.0
    eager_moe_layer_us: float = 946.0
    # -- the front end (issue 19, item 3; framework/sim/frontend.py): one TokenizerManager per server process ------
    frontend: bool = True
    tokenize_us_per_token: float = 0.0    # 0 by default; round 4 on: sglang 0.3.5's (experiments/sglang035_host)
    tokenize_us_per_request: float = 0.0  # a request's own front-end work apart from its tokens (HTTP in and out)
    stream_us_per_chunk: float = 8.0      # experiments/calibrate/host.py: detokenize + one SSE event per request
    stream_us_per_output_token: float = 0.0   # per token of the chunk's request's output so far (sent whole)
    stream_interval: int = 1              # SGLang's --stream-interval: a chunk every this many tokens
    # -- wide EP (issue 21; SGLang 2025; docs/fidelity.md "Simulator"): moe.dispatch=deepep_* is priced from DeepEP's
    # tables (plugins/cost/lib/deepep.py), moe.tbo as two overlapped micro-batches (plugins/cost/lib/tbo.py), moe.eplb
    # (rebalance_every > 0) as EPLB's placement for the loads below (plugins/cost/lib/expert_load.py) --------------
    expert_loads: str = "uniform"     # uniform | zipf | a JSON of recorded loads (moe_stats' `expert_load`)
    zipf_exponent: float = 1.0        # zipf: popularity ~ 1 / rank^s; no published DeepSeek-V3 figure: a free knob
    expert_load_seed: int = 0         # zipf: the experts' random order per layer; the fluctuation's draws
    # per-batch fluctuation of the loads around them (plugins/cost/lib/load_fluctuation.py): each batch's expert
    # shares a Dirichlet draw whose variance is ~this many times independent picks'; 0: off, every batch at the
    # loads' average (rounds 1-4). experiments/wide_ep/fit_load_fluctuation.py fits it to the lmsys blog's
    # measured per-step balancedness
    expert_load_fluctuation: float = 0.0
    dense_dp: bool = False            # SGLang 2025's --moe-dense-tp-size 1: dense FFNs on each rank's own tokens
    deepep_dispatch_fp8: bool = True  # DeepEP's measured setting: FP8 dispatch (+1 fp32 scale / 128), BF16 combine
    deepep_normal_sms: int = 24       # SMs DeepEP's normal kernels hold (README: Buffer.set_num_sms(24)); under
                                      # TBO the prefill GEMMs run on the rest (SGLang's deep_gemm_num_sms)
    # EPLB's weight moves in mode=sim (plugins/cost/lib/eplb_moves.py): SGLang's --eplb-rebalance-layers-per-chunk,
    # MoE layers moved per forward pass; 0: its default None, every layer in one stall
    eplb_layers_per_chunk: int = 0
    # -- published kernel rates of SGLang 2025's kernels (issue 21, round 4; docs/fidelity.md "Cost model terms");
    # false: the fitted dense-GEMM rates, as rounds 1-3 priced them --------------------------------------------------
    # FP8 GEMMs at most at DeepGEMM's published rate for their (N, K) and M (plugins/cost/lib/deepgemm.py: README
    # table, 2025-04-09): normal GEMMs, and the routed experts under DeepEP (contiguous layout after normal dispatch,
    # masked after low-latency dispatch)
    deepgemm_rates: bool = False
    # prefill attention in the normal form (MHA, causal) at most at FlashAttention-3's published causal forward rate
    # for its sequence length and head dims (plugins/cost/lib/fa3.py), not at the large-GEMM compute rate
    fa3_prefill_rates: bool = False
    # decode's split-KV partials: as many splits as FA3's dynamic scheduler picks for the batch (one split: no
    # partials written; plugins/cost/lib/fa3.py) instead of mla_decode_kv_splits
    fa3_decode_splits: bool = False


DECODE_KERNELS = ("split_kv", "logits")

# The "logits" kernel as sglang 0.3.5 and 0.3.6 ship it (PyPI wheels, the same on CUDA; python/sglang/srt/layers/
# attention/triton_ops/decode_attention.py): stage name -> (BLOCK_N tokens a step, num_warps).
# _decode_grouped_att_m_fwd: BLOCK = 64, num_warps = 4, grid (batch, head blocks, cdiv(max_len, 64)), its loop runs
# once; _decode_grouped_softmax_reducev_fwd: BLOCK = 128, num_warps = 8, grid (batch, head blocks), a loop over the
# whole sequence. Both: BLOCK_H = max(16, min(64, next_power_of_2(heads))), num_stages = 1.
LOGITS_KERNEL = {"scores": (64, 4), "reducev": (128, 8)}
LOGITS_BLOCK_H = (16, 64)
# One SM of compute capability 8.0 to 10.0 (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"; H100 whitepaper): 65,536 32-bit registers, at most 255 a thread, 2,048 resident threads and 32
# resident blocks; 228 KB of shared memory on 9.0 (A100: 164 KB; the stages below need <= 144 KB, so 228 serves all)
SM_REGS, THREAD_REGS, SM_THREADS, SM_BLOCKS, SM_SMEM = 65536, 255, 2048, 32, 228 * 1024


@dataclass(frozen=True)
class KernelStage:
    """One stage of the logits kernel on one SM: what a program holds and how many fit at once."""
    block_h: int                # heads a program covers
    head_blocks: int            # programs per request (per 64 tokens in stage 1)
    block_n: int
    threads: int
    regs: float                 # live 32-bit registers a thread needs (the tiles below), before any spill
    spill_bytes: float          # per loop step: what does not fit in 255 a thread, stored and loaded again
    smem: int                   # bytes of the tl.dot operand tiles, which pass through shared memory
    per_sm: int                 # programs resident on one SM at once


def logits_stage(stage: str, heads: int, width: int, rank: int, reduce_bytes: int, act_bytes: int,
                 block_n: int | None = None, warps: int | None = None, block_h: int | None = None) -> KernelStage:
    """The kernel's geometry from its constants (overridable, for tests): stage 1 holds q [BLOCK_H, width] in the
    reduce dtype and its scores [BLOCK_H, BLOCK_N] fp32, and its first dot's operands q and k [rank, BLOCK_N] pass
    through shared memory; stage 2 carries acc [BLOCK_H, rank], e_max and e_sum [BLOCK_H] fp32 across its loop beside
    the step's p [BLOCK_H, BLOCK_N] fp32, and its dot's p and v [BLOCK_N, rank] pass through shared memory."""
    n, w = LOGITS_KERNEL[stage]
    n, w = block_n or n, warps or w
    lo, hi = LOGITS_BLOCK_H
    bh = block_h or max(lo, min(hi, 1 << max(heads - 1, 0).bit_length()))
    threads = 32 * w
    if stage == "scores":
        held = bh * width * reduce_bytes + bh * n * 4
        smem = (bh * rank + rank * n) * reduce_bytes
    else:
        held = (bh * rank + 2 * bh + bh * n) * 4
        smem = (bh * n + n * rank) * act_bytes
    regs = held / 4 / threads
    spill = max(0.0, regs - THREAD_REGS) * 4 * threads
    used = min(regs, THREAD_REGS)
    per_sm = max(1, min(int(SM_REGS // (threads * used)), SM_THREADS // threads, SM_BLOCKS, SM_SMEM // smem))
    return KernelStage(bh, -(-heads // min(bh, heads)), n, threads, regs, spill, smem, per_sm)


def wave_factor(programs: int, slots: int) -> float:
    """A stage's time over its bandwidth-bound time when its `programs` equal programs run `slots` at a time, each at
    the share of the bandwidth a full wave gives it: ceil(programs / slots) whole waves. Fewer programs than slots: one
    wave, each program walking its sequence at that share (an upper bound: one SM can draw more than its share, by how
    much no hardware field says)."""
    return -(-programs // slots) * slots / programs if programs > 0 else 1.0


def _total(*times: float) -> tuple[float, int]:
    """(seconds, kernels) of kernels run one after another (a zero-time kernel is not launched)."""
    return sum(times), sum(1 for t in times if t > 0)


@COST.register("roofline")
class RooflineCost(CostModel):
    Config = RooflineConfig

    def __init__(self, cfg: RooflineConfig, instance: InstanceShape) -> None:
        super().__init__(cfg, instance)
        self.reads_outputs = cfg.host_output_token_us > 0      # the scheduler's streaming of the output so far
        if cfg.decode_head_block < 0:
            raise ValueError(f"sim.cost.decode_head_block must be >= 0 (0: the latent read once), got "
                             f"{cfg.decode_head_block}")
        bad = [f"sim.cost.{k}={getattr(cfg, k)} must be > 0 and <= 1" for k in ("absorbed_extend_eff",
                                                                              "fused_moe_fp8_eff")
               if not 0 < getattr(cfg, k) <= 1]
        bad += [f"sim.cost.{k}={getattr(cfg, k)} must be >= 0" for k in
                ("mla_decode_kv_splits", "host_step_us", "host_running_us", "host_new_req_us", "host_output_token_us",
                 "host_new_token_us", "host_speed_factor", "eager_dense_layer_us", "eager_moe_layer_us",
                 "tokenize_us_per_token", "tokenize_us_per_request", "stream_us_per_chunk",
                 "stream_us_per_output_token")
                if getattr(cfg, k) < 0]
        if cfg.mla_decode_kernel not in DECODE_KERNELS:
            bad.append(f"sim.cost.mla_decode_kernel={cfg.mla_decode_kernel!r} is not one of "
                       f"{', '.join(DECODE_KERNELS)}")
        if cfg.attn_logits_bytes not in (2, 4):
            bad.append(f"sim.cost.attn_logits_bytes={cfg.attn_logits_bytes} must be 2 (fp16) or 4 (fp32)")
        if cfg.stream_interval < 1:
            bad.append(f"sim.cost.stream_interval={cfg.stream_interval} must be >= 1")
        if cfg.fused_moe_rates_past not in fused_moe_triton.PAST:
            bad.append(f"sim.cost.fused_moe_rates_past={cfg.fused_moe_rates_past!r} is not one of "
                       f"{', '.join(fused_moe_triton.PAST)}")
        if cfg.fused_moe_rates and instance.hardware.name != fused_moe_triton.HARDWARE:
            bad.append(f"sim.cost.fused_moe_rates=true: the fused MoE's rates were published for hardware="
                       f"{fused_moe_triton.HARDWARE} only, got hardware={instance.hardware.name}")
        if bad:
            raise ValueError("; ".join(bad))
        m = instance.model
        self.m, self.lay, self.rf = m, layout_for(instance), Roofline(instance.hardware)
        if m.num_heads % self.lay.attn_tp:
            raise ValueError(f"model.num_heads={m.num_heads} is not divisible by the attention-TP degree "
                             f"{self.lay.attn_tp}")
        self.heads = m.num_heads // self.lay.attn_tp
        self.act = itemsize(m.dtype)
        self.wdtype, self.wbytes = ("fp8", 1) if m.weight_dtype == WeightDtype.fp8 else (m.dtype, self.act)
        self.moe_layers = m.num_layers - m.first_k_dense_replace
        h, a, width = self.heads, self.act, m.kv_cache_width
        self._normal_flops = h * (m.qk_head_dim + m.v_head_dim)       # x n(n+1) per request: causal, half of n x n
        self._normal_bytes = h * (2 * m.qk_head_dim + 2 * m.v_head_dim) * a   # per token: q, k, v in, out
        self._absorbed_flops = 2 * h * (width + m.kv_lora_rank)          # per (query, key) pair: scores, values
        self._absorbed_bytes = h * (width + m.kv_lora_rank) * a          # per token: q in latent space, out
        self._latent_bytes = width * a                                  # per cached token
        self.overlap = overlapped(cfg, self.lay.groups)
        self.eager_floor = eager_floor_s(cfg, m.first_k_dense_replace, self.moe_layers)
        # two-stage decode: per request and head, each split's fp32 partial output and log-sum-exp, written by
        # stage 1 and read by stage 2
        self._logits_kernel = cfg.mla_decode_kernel == "logits"
        self._partials_bytes = 0 if self._logits_kernel else h * cfg.mla_decode_kv_splits * (m.kv_lora_rank + 1) * 4
        self._logits_bytes = h * cfg.attn_logits_bytes                 # per cached token: written, then read
        self._stages = {k: logits_stage(k, h, m.kv_cache_width, m.kv_lora_rank, cfg.attn_logits_bytes, self.act)
                        for k in LOGITS_KERNEL}
        self._fp8_quant = cfg.fp8_act_quant and self.wdtype == "fp8"
        self._fused_moe_rates = (cfg.fused_moe_rates and self.wdtype == "fp8"
                                 and MOE.get(instance.moe).fused_moe_call)
        block = 0 if self._logits_kernel else cfg.decode_head_block
        self._decode_latent_reads = -(-h // block) if block > 0 else 1   # per cached token per decode step
        # all but attention over the KV depends on token counts only, and a simulator asks for the same few counts
        # again and again: cache those parts per instance
        self._wide_ep(instance)
        for part in ("_projections", "_head", "_ffn", "_declared_comm", "_moe_parts", "_tbo_layers"):
            setattr(self, part, lru_cache(maxsize=16384)(getattr(self, part)))

    # -- the step ------------------------------------------------------------------------------------------------
    def step_time(self, step: Step) -> float:
        return self.step_breakdown(step)["total_s"]

    def step_breakdown(self, step: Step) -> dict[str, float]:
        """Seconds per part of the step (attention, ffn, head, comm, launch), its kernel count, and the total."""
        lay, m = self.lay, self.m
        if len(step.batches) != lay.groups:
            raise ValueError(f"a step of parallel={self.instance.parallel} on {lay.size} GPUs has {lay.groups} "
                             f"batches (one per scheduler), got {len(step.batches)}")
        attn = head = 0.0
        kernels = t_max = total = 0
        for b in step.batches:
            t = sum(b.new_tokens)
            total += t
            t_max = t if t > t_max else t_max
            if b.mode == "idle" or not t:
                continue                                  # an IDLE batch skips attention but joins every FFN
            a, ka = self._attention(b, t)
            h, kh = self._head(t, len(b.new_tokens))
            # ranks wait for each other at every layer: the slowest batch sets each part's pace
            attn, head = (a if a > attn else attn), (h if h > head else head)
            kernels = max(kernels, ka * m.num_layers + kh)
        decode = all(b.mode != "extend" for b in step.batches)
        mode = deepep.mode_for(self.dispatch, decode) if self.deepep else ""
        dense_ffn, moe_ffn, kf = self._ffn(t_max, total, mode)
        imbalance = self._imbalance(total)                # the busiest rank's picks over the mean's, this step
        ffn = dense_ffn + moe_ffn
        plan = self.moe_cls.overlap_plan(self.moe_cfg, t_max, decode) if step.collectives is None else None
        if step.collectives is None:
            comm, kc = self._declared_comm(tuple(sum(b.new_tokens) for b in step.batches),
                                           tuple(len(b.new_tokens) for b in step.batches), plan is None)
        else:
            comm = sum(c.count * self.rf.collective(c.kind, c.nbytes, c.ranks) for c in step.collectives)
            kc = sum(c.count for c in step.collectives)
        tbo_s = 0.0
        if plan is not None and t_max > 1:                # two micro-batches through the MoE layers, comm inside
            tbo_s, kt = self._tbo(step, mode, decode, plan["delta"], total)
            gpu = m.first_k_dense_replace * attn + dense_ffn + head + comm + tbo_s
            kernels += kt
        else:
            if mode:                                      # DeepEP's kernels instead of the declared all-to-all
                comm += self.moe_layers * sum(self._deepep_s(mode, t_max, total))
                kc += 2 * self.moe_layers
            gpu = m.num_layers * attn + ffn + head + comm
        kernels += kf + kc
        graph = step.graph and (not mode or deepep.graph_capturable(mode))   # normal DeepEP: never in a graph
        launch = 0.0 if graph else kernels * self.instance.hardware.launch_overhead_us * 1e-6
        sched = scheduler_s(self.cfg, step)
        forward, total = combine(self.cfg, gpu, launch, graph, sched, self.overlap, self.eager_floor)
        return {"attention_s": m.num_layers * attn, "ffn_s": ffn, "head_s": head, "comm_s": comm,
                "launch_s": launch, "kernels": kernels, "gpu_s": gpu, "forward_s": forward, "scheduler_s": sched,
                "tbo_moe_layers_s": tbo_s, "graph": float(graph), "moe_rank_imbalance": imbalance,
                "total_s": total}

    # -- wide EP (issue 21) ----------------------------------------------------------------------------------------
    def _wide_ep(self, instance: InstanceShape) -> None:
        """What the MoE backend's config asks of the step: DeepEP's kernels, the placement's imbalance."""
        cfg, m, lay = self.cfg, self.m, self.lay
        _, _, self.moe_cls, self.moe_cfg = plugin_configs(instance)
        self.dispatch = str(getattr(self.moe_cfg, "dispatch", ""))
        self.deepep = self.dispatch in deepep.MODES and lay.moe_tokens == "local" and lay.size > 1
        if self.deepep and self.dispatch == "deepep_auto" and lay.groups > 1:
            raise ValueError("moe.dispatch=deepep_auto cannot run under DP attention: its DP groups would run normal "
                             "(prefill) and low-latency (decode) kernels in one step (SGLang 2025; lmsys blog "
                             "2025-05-05). Use deepep_normal or deepep_low_latency per phase, as PD disaggregation "
                             "does")
        if cfg.expert_loads not in SOURCES and not cfg.expert_loads.endswith(".json"):
            raise ValueError(f"sim.cost.expert_loads={cfg.expert_loads!r} is not one of {', '.join(SOURCES)} or a "
                             f"path to a .json of recorded loads")
        if not 0 < cfg.deepep_normal_sms < instance.hardware.sm_count:
            raise ValueError(f"sim.cost.deepep_normal_sms={cfg.deepep_normal_sms} must be in 1.."
                             f"{instance.hardware.sm_count - 1} (hardware.sm_count)")
        self.imbalance, self.slots_per_expert, self.fluctuation = 1.0, 1.0, None
        if cfg.expert_load_fluctuation < 0:
            raise ValueError(f"sim.cost.expert_load_fluctuation={cfg.expert_load_fluctuation} must be >= 0 (0: off)")
        slots = self.moe_cls.expert_slots(self.moe_cfg, m.n_routed_experts, lay.size) if m.n_routed_experts else None
        self.eplb_moves: EPLBMoves | None = None
        every = getattr(getattr(self.moe_cfg, "eplb", None), "rebalance_every", 0)
        if slots and lay.size == 1:                       # one rank holds every expert: rebalances move nothing
            self._eplb_moves(every, slots, [slots] * self.moe_layers)
        if not slots or lay.size == 1:
            return
        self.slots_per_expert = len(slots) / m.n_routed_experts
        loads = layer_loads(cfg.expert_loads, m.n_routed_experts, m.num_experts_per_tok, self.moe_layers,
                            cfg.zipf_exponent, cfg.expert_load_seed) or [[1.0] * m.n_routed_experts]
        placed = [rebalance(row, len(slots), lay.size) if every > 0 else slots for row in loads]
        per_layer = [rank_imbalance(row, p, lay.size) for row, p in zip(loads, placed)]
        self.imbalance = sum(per_layer) / len(per_layer)   # the slowest rank paces each layer: their mean
        if cfg.expert_load_fluctuation > 0:
            self.fluctuation = LoadFluctuation(loads, placed, lay.size, cfg.expert_load_fluctuation,
                                               cfg.expert_load_seed)
        # MoE layer i is placed for the loads' row i (one row: every layer alike)
        self._eplb_moves(every, slots, [placed[i * len(placed) // self.moe_layers] for i in range(self.moe_layers)])

    def _eplb_moves(self, every: int, initial, placed: list) -> None:
        """EPLB's weight moves (plugins/cost/lib/eplb_moves.py), over the point-to-point links of `kv_link`."""
        m = self.m
        self.eplb_moves = EPLBMoves(every, self.cfg.eplb_layers_per_chunk, initial, placed, self.lay.size,
                                    self.instance.hardware.gpus_per_node,
                                    3 * m.hidden_size * m.moe_intermediate_size * m.linear_itemsize,
                                    {True: self.kv_link(True), False: self.kv_link(False)},
                                    lambda nbytes: self.rf.memop("add", nbytes))

    def placement_moves(self, forward_pass: int) -> dict[str, float]:
        return self.eplb_moves.at(forward_pass) if self.eplb_moves is not None else {}

    def _imbalance(self, t_routed: int) -> float:
        """The busiest rank's picks over the mean's when the EP group's experts serve `t_routed` tokens."""
        if self.fluctuation is None:
            return self.imbalance
        return self.fluctuation.imbalance(t_routed * self.m.num_experts_per_tok)

    def _deepep_s(self, mode: str, tokens: int, t_routed: int) -> tuple[float, float]:
        """(dispatch, combine) seconds of one layer on the busiest rank (its receive scales with the imbalance of
        the `t_routed` tokens the EP group routes)."""
        hw, m, fp8 = self.instance.hardware, self.m, self.cfg.deepep_dispatch_fp8
        if mode == "deepep_normal":
            d, c = deepep.normal_s(tokens, self.lay.size, hw.gpus_per_node, m, fp8, self.act)
        else:
            d, c = deepep.low_latency_s(tokens, self.lay.size, m, fp8, self.act)
        imbalance = self._imbalance(t_routed)
        return d * imbalance, c * imbalance

    def _tbo(self, step: Step, mode: str, decode: bool, delta: int, total: int) -> tuple[float, int]:
        """The MoE layers as two micro-batches of the largest batch (the slowest group paces every layer); every
        group splits alike, so a micro-batch's experts serve its share of the step's `total` tokens."""
        b = max(step.batches, key=lambda b: sum(b.new_tokens))
        return self._tbo_layers(_split(b, decode), mode, decode, delta, sum(b.new_tokens), total)

    def _tbo_layers(self, halves: tuple, mode: str, decode: bool, delta: int, t_max: int,
                    total: int) -> tuple[float, int]:
        layers, kernels = [], 0
        slow = 1.0
        if mode == "deepep_normal":                       # the GEMMs share the SMs with DeepEP's normal kernels
            sms = self.instance.hardware.sm_count
            slow = sms / (sms - self.cfg.deepep_normal_sms)
        for half in halves:
            t = sum(half.new_tokens)
            normal = half.mode == "extend" and not any(half.prefix)
            proj, kp = self._projections(t, normal)
            attn, ka = self._attention(half, t)
            lay = self.lay
            if lay.moe_tokens == "all":                   # as _ffn lays the tokens out, for this micro-batch
                t_in = t_routed = lay.groups * t
            else:
                t_in = t if lay.groups > 1 else -(-t // lay.size)
                t_routed = round(total * t / t_max)
            gate, routed, add, shared = self._moe_parts(t_in, t_routed, mode)
            if mode:
                dispatch, comb = self._deepep_s(mode, t, t_routed)
            else:                                         # the backend's own collectives, split at the dispatch
                cs = self.moe_cls.layer_comm(self.moe_cfg, self.m, [t] * self.lay.size)
                times = [self.rf.collective(c.kind, c.bytes, len(c.ranks)) for c in cs]
                dispatch, comb = sum(times[:-1]), sum(times[-1:])
            build = decode_layer if decode else prefill_layer
            layers.append(build(proj * slow, (attn - proj) * slow, gate[0] * slow, shared[0] * slow,
                                (routed[0] + add[0]) * slow, dispatch, comb))
            kernels += self.moe_layers * (ka + gate[1] + routed[1] + add[1] + shared[1])
        return overlapped_s((layers[0], layers[1]), self.moe_layers, delta), kernels

    def _ffn(self, t_max: int, total: int, mode: str = "") -> tuple[float, float, int]:
        """(dense FFN seconds, MoE seconds, kernels) of a step whose largest batch has `t_max` tokens, `total` in
        all; `mode`: the DeepEP kernels the step runs, if any."""
        lay, m = self.lay, self.m
        gathered = lay.groups * t_max                     # padded to the largest batch (SGLang v0.4's all-gather)
        if self.cfg.dense_dp and lay.groups > 1:          # each rank its own tokens, the whole dense FFN
            dense, kd = self._mlp(t_max, m.intermediate_size / lay.attn_tp)
        else:
            dense, kd = self._dense(gathered)
        if lay.moe_tokens == "all":
            moe, km = self._moe(gathered, gathered)
        else:                                             # each rank passes its own tokens; its experts get theirs
            moe, km = self._moe(t_max if lay.groups > 1 else -(-t_max // lay.size), total, mode)
        n_dense = m.first_k_dense_replace
        return n_dense * dense, self.moe_layers * moe, n_dense * kd + self.moe_layers * km

    def _declared_comm(self, tokens: tuple[int, ...], reqs: tuple[int, ...], moe: bool = True) -> tuple[float, int]:
        """The plugins' declared collectives; without the MoE backend's own when DeepEP's kernels or two-batch
        overlap price them (`moe` False), without the dense layers' under dense_dp."""
        collectives = declared_collectives(self.instance, self.lay, tokens, reqs, moe_comm=moe and not self.deepep,
                                           dense_comm=not (self.cfg.dense_dp and self.lay.groups > 1))
        return (sum(c.count * self.rf.collective(c.kind, c.nbytes, c.ranks) for c in collectives),
                sum(c.count for c in collectives))

    # -- attention: one layer, one scheduler's batch ----------------------------------------------------------------
    def _attention(self, b: BatchShape, t: int) -> tuple[float, int]:
        """SGLang v0.4 runs the normal form for a prefill batch without any cached prefix, else the absorbed one."""
        normal = b.mode == "extend" and not any(b.prefix)
        proj, kernels = self._projections(t, normal)
        if normal:                                        # kv_b expands the latent; causal attention per request
            flops = self._normal_flops * sum(n * (n + 1) for n in b.new_tokens)
            nbytes = t * self._normal_bytes
            if self.cfg.fa3_prefill_rates:                # each request's FLOPs at FA3's rate for its length
                peak = self.rf.gemm_flops("bfloat16")
                flops = sum(self._normal_flops * n * (n + 1)
                            * max(1.0, peak / (fa3.prefill_tflops(n, self.m.qk_head_dim, self.m.v_head_dim) * 1e12))
                            for n in b.new_tokens)
        else:                                             # over the latent (decode: read once per head block)
            seen = sum(b.prefix) + t
            if b.mode == "decode" and self._logits_kernel:         # the kernel before PR #2394
                return proj + self._logits_decode(seen, t), kernels + 2
            scored = seen if b.mode == "decode" else sum(n * p + n * (n + 1) / 2
                                                         for n, p in zip(b.new_tokens, b.prefix))
            flops = self._absorbed_flops * scored
            reads = self._decode_latent_reads if b.mode == "decode" else 1
            nbytes = seen * self._latent_bytes * reads + t * self._absorbed_bytes
            per_request = self._partials_bytes
            if b.mode == "decode" and self.cfg.fa3_decode_splits and not self._logits_kernel:
                splits = fa3.decode_splits(len(b.new_tokens), self.heads, seen / len(b.new_tokens),
                                           self.instance.hardware.sm_count, self.m.qk_rope_head_dim,
                                           self.m.kv_lora_rank)
                per_request = 0 if splits == 1 else self.heads * splits * (self.m.kv_lora_rank + 1) * 4
            if b.mode == "decode" and per_request:      # stage 1 writes the partials, stage 2 reads them
                partials = t * per_request
                return (proj + self.rf.attention(flops, nbytes + partials)
                        + self.rf.attention(partials / 2, partials), kernels + 2)   # 2 FLOPs per fp32 read
            if b.mode == "extend":
                flops /= self.cfg.absorbed_extend_eff
        return proj + self.rf.attention(flops, nbytes), kernels + 1

    def _logits_decode(self, seen: int, t: int) -> float:
        """The decode kernel before SGLang PR #2394 over `seen` cached tokens of `t` requests. Stage 1 reads q and, per
        block of BLOCK_H heads, the 576-wide latent, scores it (2 x heads x width FLOPs per pair) and writes the logits;
        stage 2 reads them and, per head block, the kv_lora_rank-wide values (2 x heads x kv_lora_rank FLOPs per pair)
        and writes the output. Each stage: the roofline of its bytes (spilled registers included: their stores and
        loads priced at the HBM's rate, an upper bound, since local memory may stay in L2) times its wave factor
        (register and shared-memory occupancy from the CUDA limits above, hardware.sm_count SMs)."""
        m, h, a = self.m, self.heads, self.act
        s1, s2 = self._stages["scores"], self._stages["reducev"]
        # a decode batch comes priced by its sum (framework/contracts/cost.py decode_shape): every request at the mean
        # length, as in PR #1970's decode (input 1, all admitted at once: they decode in lockstep)
        blocks = t * -(-seen // (t * s1.block_n))                 # stage 1's programs per head block
        steps = t * -(-seen // (t * s2.block_n))                  # stage 2's loop steps, all its programs
        logits = seen * self._logits_bytes
        rows1, rows2 = s1.block_h * s1.head_blocks, s2.block_h * s2.head_blocks   # heads computed, padding included
        stage1 = self._stage_s(s1, 2 * rows1 * m.kv_cache_width * seen,
                               seen * self._latent_bytes * s1.head_blocks + t * h * m.kv_cache_width * a + logits,
                               s1.head_blocks * blocks)
        stage2 = self._stage_s(s2, 2 * rows2 * m.kv_lora_rank * seen,
                               logits + seen * m.kv_lora_rank * a * s2.head_blocks + t * h * m.kv_lora_rank * a,
                               s2.head_blocks * t, s2.head_blocks * steps)
        return stage1 + stage2

    def _stage_s(self, st: KernelStage, flops: float, nbytes: float, programs: int, loop_steps: int = 0) -> float:
        """One stage: the roofline time (latency apart) of its bytes and its spill (stored and loaded each loop step of
        each program; stage 1's loop runs once), times its wave factor."""
        if not self.cfg.mla_decode_occupancy:
            return self.rf.attention(flops, nbytes)
        roof = self.rf.attention(flops, nbytes + 2 * st.spill_bytes * (loop_steps or programs))
        if roof <= 0:
            return 0.0
        lat = self.rf._gemm_lat
        return lat + (roof - lat) * wave_factor(programs, self.instance.hardware.sm_count * st.per_sm)

    def _projections(self, t: int, normal: bool) -> tuple[float, int]:
        """Everything of an attention layer but the attention kernel: it depends on the token count only."""
        m, rf, h, a = self.m, self.rf, self.heads, self.act
        gemm = self._gemm
        if m.q_lora_rank:
            q = (gemm(t, m.q_lora_rank, m.hidden_size), rf.memop("rmsnorm", 2 * t * m.q_lora_rank * a),
                 gemm(t, h * m.qk_head_dim, m.q_lora_rank))
        else:
            q = (gemm(t, h * m.qk_head_dim, m.hidden_size),)
        if normal:                                        # kv_b: the latent -> per-head keys and values
            latent = (gemm(t, h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),)
        else:                                             # W_UK folds q_nope into latent space, W_UV lifts the out
            latent = (gemm(t, m.kv_lora_rank, m.qk_nope_head_dim, batch=h),
                      gemm(t, m.v_head_dim, m.kv_lora_rank, batch=h))
        return _total(*[rf.memop("rmsnorm", 4 * t * m.hidden_size * a)] * 2,   # fused add + norm, before attn and ffn
                      *q, gemm(t, m.kv_cache_width, m.hidden_size),
                      rf.memop("rmsnorm", 2 * t * m.kv_lora_rank * a),
                      rf.memop("rope", 2 * t * (h + 1) * m.qk_rope_head_dim * a),
                      *latent, gemm(t, m.hidden_size, h * m.v_head_dim))

    # -- FFN layers ------------------------------------------------------------------------------------------------
    def _mlp(self, t: float, inter: float, batch: float = 1.0, assigned: float | None = None,
             tokens_in: float | None = None, layout: str | None = "normal") -> tuple[float, int]:
        """SiLU-gated MLP: gate_up, act, down. `batch` experts sharing `assigned` (token, expert) rows, gathered from
        `tokens_in` tokens (the fused MoE quantizes those once for its first GEMM, the assigned rows for its second).
        `layout`: DeepGEMM's kernel for its GEMMs (None: not DeepGEMM's)."""
        rows = t if assigned is None else assigned
        eff = self.cfg.fused_moe_fp8_eff if assigned is not None and self.wdtype == "fp8" else 1.0
        return _total(self._gemm(t, 2 * inter, self.m.hidden_size, batch=batch, eff=eff, quant_rows=tokens_in,
                                 layout=layout),
                      self.rf.memop("act", rows * 3 * inter * self.act),
                      self._gemm(t, self.m.hidden_size, inter, batch=batch, eff=eff, layout=layout))

    def _dense(self, t: int) -> tuple[float, int]:
        return self._mlp(t, self.m.intermediate_size / self.lay.size)

    def _moe(self, t_in: int, t_routed: int, mode: str = "") -> tuple[float, int]:
        """One MoE layer on a rank whose backend takes `t_in` tokens and whose experts serve `t_routed` tokens' picks
        (the same unless an all-to-all backend brings each rank the tokens routed to its experts)."""
        parts = self._moe_parts(t_in, t_routed, mode)
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def _moe_parts(self, t_in: int, t_routed: int, mode: str = "") -> tuple:
        """(gate, routed experts, weighted sum, shared experts) as (seconds, kernels) each. The busiest rank's
        experts run `imbalance` times the mean's pairs, over its slots (replicas included). Under DeepEP's kernels
        (`mode`) with FP8 dispatch the rows arrive in FP8 and the first expert GEMM quantizes nothing: the normal
        kernels' sender quantizes its own `t_in` tokens before the dispatch (SGLang's dispatch_a), the low-latency
        kernel casts inside the dispatch and reduces the weighted sum inside the combine (in DeepEP's measured
        times, so not priced again here). The normal kernels' received rows are permuted into DeepGEMM's contiguous
        layout first (SGLang's ep_scatter; priced as reading and writing the assigned rows as they travel). Under
        `fused_moe_rates` a fused MoE call (the routed experts and the weighted sum) takes at least its FLOPs at the
        published rate for its rows per touched expert (plugins/cost/lib/fused_moe_triton.py)."""
        m, lay, rf = self.m, self.lay, self.rf
        e, k = m.n_routed_experts, m.num_experts_per_tok
        fp8_wire = bool(mode) and self.cfg.deepep_dispatch_fp8 and self._fp8_quant
        gate = _total(self._gemm(t_in, e, m.hidden_size, quantized=False),
                      rf.memop("act", t_in * e * 4),                        # logits, then the fp32 top-k
                      rf.memop("act", t_in * m.hidden_size * (self.act + 1))
                      if fp8_wire and mode == "deepep_normal" else 0.0)    # the sender's quantization
        assigned = t_routed * k / lay.expert_split * self._imbalance(t_routed)
        touched = expected_touched(e, k, t_routed) / lay.expert_split * self.slots_per_expert
        inter = m.moe_intermediate_size / lay.inter_split
        layout = {"deepep_normal": "contiguous", "deepep_low_latency": "masked"}.get(mode)   # else fused_moe
        routed = (self._mlp(assigned / touched, inter, batch=touched, assigned=assigned,
                            tokens_in=0 if fp8_wire else t_routed, layout=layout)
                  if touched else (0.0, 0))
        if mode == "deepep_normal" and touched:          # ep_scatter: the received rows into DeepGEMM's contiguous
            wire = deepep.row_bytes(m.hidden_size, self.cfg.deepep_dispatch_fp8, self.act)    # layout (read, write)
            routed = (routed[0] + rf.memop("act", 2 * assigned * wire), routed[1] + 1)
        combine = (0.0, 0) if mode == "deepep_low_latency" else \
            _total(rf.memop("add", (assigned + t_in) * m.hidden_size * self.act))          # weighted sum
        if self._fused_moe_rates and touched:   # a published call: alignment, GEMMs, activation, weighted sum
            floor = fused_moe_triton.call_flops(assigned, m.hidden_size, inter) \
                / (fused_moe_triton.tflops(assigned / touched, self.cfg.fused_moe_rates_past) * 1e12)
            routed = (max(routed[0], floor - combine[0]), routed[1])
        shared = (0.0, 0)
        if m.n_shared_experts:
            sliced = lay.size if lay.moe_partial else 1
            shared = self._mlp(t_in, m.n_shared_experts * m.moe_intermediate_size / sliced)
        return gate, routed, combine, shared

    def _head(self, t: int, reqs: int) -> tuple[float, int]:
        """Embedding, final norm, lm_head on each request's last token (vocabulary split across attention TP)."""
        m, rf, a = self.m, self.rf, self.act
        return _total(rf.memop("emb", 2 * t * m.hidden_size * a), rf.memop("rmsnorm", 2 * t * m.hidden_size * a),
                      self._gemm(reqs, m.vocab_size / self.lay.attn_tp, m.hidden_size, quantized=False))

    def kv_link(self, intra_node: bool) -> tuple[float, float]:
        """A KV transfer's link (prefill/decode disaggregation): the spec-sheet bandwidth at the fitted point-to-point
        efficiency and latency (the fit's send_recv between 2 ranks, nccl-tests on the profiled machine: NVLink
        inside a node, the NICs between nodes); the contract's default where the fit has no such term."""
        table = (self.rf.fit.intra_node if intra_node else self.rf.fit.inter_node).get("send_recv", {})
        bandwidth, latency = super().kv_link(intra_node)
        term = table.get(2) or (table[min(table)] if table else None)
        return (bandwidth * term.bus_eff, term.latency_us * 1e-6) if term else (bandwidth, latency)

    def _gemm(self, t: float, n: float, k: float, batch: float = 1.0, quantized: bool = True,
              eff: float = 1.0, quant_rows: float | None = None, layout: str | None = "normal") -> float:
        """A linear layer; fp8 checkpoints keep the router gate and lm_head in the model's dtype (quantized=False).
        `eff`: the kernel's fraction of the fitted GEMM rates. An fp8 GEMM's input is quantized first
        (`fp8_act_quant`: one elementwise kernel reading `quant_rows` (default t x batch) x k bf16 and writing them
        in fp8). Under `deepgemm_rates` an fp8 GEMM of a shape DeepGEMM published takes at least its FLOPs at the
        published rate (`layout`: normal, contiguous or masked; t: rows per group)."""
        dtype, wbytes = (self.wdtype, self.wbytes) if quantized else (self.m.dtype, self.act)
        time = self.rf.gemm(t, n, k, batch=batch, dtype=dtype, weight_bytes=wbytes, act_bytes=self.act) / eff
        if self.cfg.deepgemm_rates and layout and quantized and dtype == "fp8" and t > 0:
            rate = deepgemm.tflops(layout, t, n, k)
            if rate:
                time = max(time, 2.0 * batch * t * n * k / (rate * 1e12))
        if quantized and self._fp8_quant and t > 0:
            rows = t * batch if quant_rows is None else quant_rows
            time += self.rf.memop("act", rows * k * (self.act + 1))
        return time


def _split(b: BatchShape, decode: bool) -> tuple[BatchShape, BatchShape]:
    """A batch as SGLang's two-batch overlap cuts it: decode halves the requests; extend cuts the sequences where the
    halves' tokens differ least, and when one sequence holds most of them, that sequence's tokens in two."""
    n = len(b.new_tokens)
    if n >= 2 and decode:                   # the context split in proportion (a decode batch is priced by its sum)
        cut, context = n // 2, sum(b.prefix)
        first = context * cut // n
        return (BatchShape("decode", (1,) * cut, (first,) + (0,) * (cut - 1)),
                BatchShape("decode", (1,) * (n - cut), (context - first,) + (0,) * (n - cut - 1)))
    if n >= 2:
        if decode:
            cut = n // 2
        else:
            total, left, cut, best = sum(b.new_tokens), 0, 1, float("inf")
            for i in range(1, n):
                left += b.new_tokens[i - 1]
                if abs(2 * left - total) < best:
                    cut, best = i, abs(2 * left - total)
        return (BatchShape(b.mode, b.new_tokens[:cut], b.prefix[:cut]),
                BatchShape(b.mode, b.new_tokens[cut:], b.prefix[cut:]))
    a = (b.new_tokens[0] + 1) // 2
    return (BatchShape(b.mode, (a,), b.prefix), BatchShape(b.mode, (b.new_tokens[0] - a,), (b.prefix[0] + a,)))
