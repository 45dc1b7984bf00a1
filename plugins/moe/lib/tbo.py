"""Two-batch overlap (SGLang, 2025-05): a step's batch in two micro-batches whose communication overlaps the other's
compute, with the cut and the stage offsets of sglang's two_batch_overlap.py.

- The cut (`split_seq_index`): extend splits the sequences where the two halves' token counts differ least; decode
  halves the requests; an IDLE batch cuts at 0. The real MoE backend cuts its rows at `split_rows` (a MoE layer
  treats every token alone, so a token-level cut is exact and balances any batch).
- The stage offsets (`delta_stages`): micro-batch B starts `delta` stages after A; decode lags two stages, prefill
  none. `schedule` gives the order the stages run in, A's stage before B's at each tick. Both are
  framework/contracts/tbo.py's, the order the cost model prices too.
- `run_overlapped` runs two lists of stages in that order. A stage returns after launching its collective
  (async_op=True) and the micro-batch's next stage waits on it, so the collective is in flight while the other
  micro-batch's stage computes. Every rank must run the same order: collectives pair up in issue order.

`TBOPlan` is the seam for a cost model: the micro-batches' sizes, the stages and the offset; a cost model prices a
step as the schedule's ticks with each tick's compute overlapping the collectives launched just before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from framework.contracts.tbo import DECODE_DELTA, PREFILL_DELTA, delta_stages, schedule

__all__ = ["DECODE_DELTA", "PREFILL_DELTA", "MOE_STAGES", "TBOPlan", "delta_stages", "moe_plan", "run_overlapped",
           "schedule", "split_rows", "split_seq_index"]    # the shared order re-exported: ep.py reads it from here

MOE_STAGES = ("dispatch", "experts", "combine")   # what each micro-batch runs in an all-to-all MoE layer


def split_seq_index(decode: bool, extend_lens: Sequence[int]) -> int:
    """Sequences in micro-batch A (SGLang's compute_split_seq_index): decode halves the requests; extend cuts where
    |left tokens - right tokens| is smallest (the last such cut on ties)."""
    if decode or not extend_lens:
        return len(extend_lens) // 2
    total, left, best, best_diff = sum(extend_lens), 0, 0, float("inf")
    for i in range(1, len(extend_lens)):
        left += extend_lens[i - 1]
        diff = abs(left - (total - left))
        if diff > best_diff:
            break
        best, best_diff = i, diff
    return best


def split_rows(n: int) -> int:
    """Rows of micro-batch A when a layer may cut anywhere (the MoE layer): the larger half."""
    return (n + 1) // 2


def run_overlapped(stages: Sequence[Callable[[Any], Any]], inputs: tuple[Any, Any], delta: int) -> list[Any]:
    """Run `stages` on both micro-batches in `schedule` order: stage i takes the micro-batch's state from stage i-1
    (first: its input) and returns the next. Returns the two final states."""
    state = list(inputs)
    for micro, stage in schedule(len(stages), delta):
        state[micro] = stages[stage](state[micro])
    return state


@dataclass(frozen=True)
class TBOPlan:
    """One overlapped layer as a cost model reads it: tokens of each micro-batch, the stage names, B's offset."""
    micro_tokens: tuple[int, int]
    stages: tuple[str, ...]
    delta: int

    def order(self) -> list[tuple[int, str]]:
        return [(m, self.stages[s]) for m, s in schedule(len(self.stages), self.delta)]


def moe_plan(tokens: int, delta: int) -> TBOPlan:
    a = split_rows(tokens)
    return TBOPlan((a, tokens - a), MOE_STAGES, delta)
