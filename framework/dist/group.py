"""`Group`: the one object through which every collective of an engine instance goes.

A `Group` wraps a torch.distributed process group (gloo on CPU, NCCL on GPU). Every collective is launched with
`async_op=True` and waited on with a timeout, so a rank that skipped a collective turns into a `CollectiveTimeout`
naming the rank, the collective and the engine step instead of a silent hang.

A size-1 group (`Group()`) needs no torch.distributed at all: every method is the identity, so single-process code
paths call the same API as multi-rank ones.

After a `CollectiveTimeout` or `CollectiveError` the process group is unusable (the peer's half of the collective may
still be pending); the rank should exit. `framework.dist.launch` does exactly that.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
DEFAULT_TIMEOUT_S = 30.0
_HINT = "a rank did not join: did every rank run this step? see parallel.idle_batches"

# torch 2.13 renamed the fixed-size collectives; keep the old names as a fallback for older torch.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed (e.g. a peer's connection closed because that rank died)."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the group's timeout: some rank did not join it."""


class Group:
    """One engine instance's ranks.

    rank, size: this rank and the number of ranks. backend: "gloo", "nccl" or "local" (size 1, no torch.distributed).
    device: where tensors for collectives must live ("cpu" for gloo, "cuda:N" for NCCL).
    timeout_s: every collective raises `CollectiveTimeout` after this many seconds. `None` disables the per-call
    timeout (on NCCL a timed wait blocks the CPU thread until the GPU finishes, which costs CPU/GPU overlap).
    step: a counter the caller sets each engine step; it is named in timeout messages.
    collectives: how many collectives this rank has waited on.
    """

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        backend: str = "local",
        device: str | torch.device = "cpu",
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        pg: Any = None,
    ):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"Group needs 0 <= rank < size, got rank={rank} size={size}")
        if size > 1 and pg is None:
            raise ValueError(f"a Group of size {size} needs a process group (pg=); use framework.dist.launch")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        self.rank, self.size, self.backend = rank, size, backend
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.pg = pg
        self.step = 0
        self.collectives = 0  # collectives waited on (a step's count prices its waits: experiments/calibrate)

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, size={self.size}, backend={self.backend!r}, device={str(self.device)!r})"

    # ---------------------------------------------------------------- tensor collectives

    def all_gather_counts(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order (the per-step token-count exchange of DP attention)."""
        if self.size == 1:
            return [int(n)]
        mine = torch.tensor([int(n)], dtype=torch.int64, device=self.device)
        out = torch.empty(self.size, dtype=torch.int64, device=self.device)
        self._wait(all_gather_single(out, mine, group=self.pg, async_op=True), "all_gather_counts")
        return out.tolist()

    def all_gather_uneven(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's rows in rank order; rank i holds counts[i] rows (zero allowed)."""
        self._check_counts(counts, "counts", "all_gather_uneven")
        self._check_rows(x, counts[self.rank], "all_gather_uneven")
        if self.size == 1:
            return x
        width = max(counts)
        if width == 0:  # every rank knows the counts, so every rank skips together
            return x.new_empty((0, *x.shape[1:]))
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((self.size * width, *x.shape[1:]))
        self._wait(all_gather_single(out, padded, group=self.pg, async_op=True), "all_gather_uneven")
        out = out.view(self.size, width, *x.shape[1:])
        return torch.cat([out[i, :c] for i, c in enumerate(counts)])

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `x` across ranks in place ("sum", "min" or "max") and return it."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        if self.size > 1:
            self._wait(dist.all_reduce(x, op=REDUCE_OPS[op], group=self.pg, async_op=True), "all_reduce")
        return x

    def reduce_scatter_uneven(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Sum `x` (all ranks' rows, rank i's block has counts[i] rows) across ranks; return this rank's block."""
        self._check_counts(counts, "counts", "reduce_scatter_uneven")
        self._check_rows(x, sum(counts), "reduce_scatter_uneven")
        if self.size == 1:
            return x
        start = sum(counts[: self.rank])
        if self.backend != "nccl":  # gloo: all_reduce + slice is as fast as a padded reduce_scatter on CPU
            total = x.clone(memory_format=torch.contiguous_format)
            self._wait(dist.all_reduce(total, group=self.pg, async_op=True), "reduce_scatter_uneven")
            return total[start : start + counts[self.rank]]
        width = max(counts)
        if width == 0:
            return x.new_empty((0, *x.shape[1:]))
        padded = x.new_zeros((self.size, width, *x.shape[1:]))
        offset = 0
        for i, c in enumerate(counts):
            padded[i, :c] = x[offset : offset + c]
            offset += c
        out = x.new_empty((width, *x.shape[1:]))
        work = reduce_scatter_single(out, padded.view(-1, *x.shape[1:]), group=self.pg, async_op=True)
        self._wait(work, "reduce_scatter_uneven")
        return out[: counts[self.rank]]

    def all_to_all_uneven(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Send rows send_counts[j] (consecutive blocks of `x`) to rank j; return (received rows, recv_counts).

        The counts are exchanged first unless the caller already knows `recv_counts` (e.g. the return trip of an
        expert-parallel dispatch, whose counts are the forward trip's send_counts).
        """
        self._check_counts(send_counts, "send_counts", "all_to_all_uneven")
        self._check_rows(x, sum(send_counts), "all_to_all_uneven")
        if self.size == 1:
            return x, [int(send_counts[0])]
        if recv_counts is None:
            sent = torch.tensor(list(send_counts), dtype=torch.int64, device=self.device)
            got = torch.empty_like(sent)
            self._wait(dist.all_to_all_single(got, sent, group=self.pg, async_op=True), "all_to_all_uneven(counts)")
            recv_counts = got.tolist()
        self._check_counts(recv_counts, "recv_counts", "all_to_all_uneven")
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts),
            group=self.pg, async_op=True,
        )
        self._wait(work, "all_to_all_uneven")
        return out, [int(c) for c in recv_counts]

    # ---------------------------------------------------------------- object collectives and barrier

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj`, on every rank."""
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast_object src must be in [0, {self.size}), got {src}")
        if self.size == 1:
            return obj
        src_global = dist.get_global_rank(self.pg, src)
        payload = _to_bytes(obj, self.device) if self.rank == src else None
        length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=self.device)
        self._wait(dist.broadcast(length, src=src_global, group=self.pg, async_op=True), "broadcast_object")
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._wait(dist.broadcast(payload, src=src_global, group=self.pg, async_op=True), "broadcast_object")
        return obj if self.rank == src else _from_bytes(payload)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        if self.size == 1:
            return [obj]
        payload = _to_bytes(obj, self.device)
        counts = self.all_gather_counts(payload.numel())
        gathered = self.all_gather_uneven(payload, counts)
        return [_from_bytes(chunk) for chunk in torch.split(gathered, counts)]

    def barrier(self) -> None:
        """Return once every rank has reached this barrier (an all_reduce, so it carries the timeout on NCCL too)."""
        if self.size > 1:
            token = torch.zeros(1, device=self.device)
            self._wait(dist.all_reduce(token, group=self.pg, async_op=True), "barrier")

    # ---------------------------------------------------------------- internals

    def _wait(self, work: Any, collective: str) -> None:
        self.collectives += 1
        start = time.monotonic()
        try:
            if self.timeout_s is None:
                work.wait()
                return
            completed = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            elapsed = time.monotonic() - start
            # Backends word timeouts differently; a failure at (or past) the deadline is a timeout whatever it says.
            if "timed out" in str(exc).lower() or (self.timeout_s is not None and elapsed >= 0.95 * self.timeout_s):
                raise CollectiveTimeout(self._timeout_message(collective)) from exc
            raise CollectiveError(
                f"rank {self.rank}: {collective} failed at step {self.step} after {elapsed:.1f} s "
                f"(did another rank die?): {exc}"
            ) from exc
        if completed is False:
            raise CollectiveTimeout(self._timeout_message(collective))

    def _timeout_message(self, collective: str) -> str:
        return f"rank {self.rank}: {collective} timed out after {self.timeout_s} s at step {self.step} ({_HINT})"

    def _check_counts(self, counts: Sequence[int], what: str, collective: str) -> None:
        if len(counts) != self.size or any(int(c) < 0 for c in counts):
            raise ValueError(
                f"rank {self.rank}: {collective} needs {what} with one non-negative int per rank "
                f"(size {self.size}), got {list(counts)}"
            )

    def _check_rows(self, x: torch.Tensor, expected: int, collective: str) -> None:
        if x.dim() == 0 or x.shape[0] != expected:
            raise ValueError(
                f"rank {self.rank}: {collective} expected a tensor with {expected} rows on this rank, "
                f"got shape {tuple(x.shape)}"
            )
        if self.size > 1 and x.device != self.device:
            raise ValueError(f"rank {self.rank}: {collective} needs tensors on {self.device}, got {x.device}")


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())
