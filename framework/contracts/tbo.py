"""Two-batch overlap's order (SGLang, 2025-05): the stage offsets, the order two micro-batches' stages run in, and
SGLang's stage lists of one DeepSeek layer. Shared by the MoE backend that runs two micro-batches
(plugins/moe/lib/tbo.py) and the cost model that prices them (plugins/cost/lib/tbo.py): plugins may not import each
other, so the one order lives here (L2, pure Python).

- `delta_stages`: micro-batch B starts `delta` stages after A; decode lags two stages, prefill none (sglang
  two_batch_overlap.py, tbo_delta_stages).
- `schedule`: (micro-batch, stage) in execution order: at tick t, A's stage t then B's stage t - delta.
- `DECODE_STAGES` / `PREFILL_STAGES`: sglang operations_strategy.py's `_compute_moe_deepseek_blog_decode` /
  `_prefill`, one tuple of operation names per stage (a stage ends at a yield point). Names: `proj` (attention's
  input projections), `core` (attention itself), `gate`, `shared` (shared experts), `experts` (routed experts),
  `dispatch>` / `combine>` (the collective launched), `<dispatch` / `<combine` (the micro-batch waits for it).
"""
from __future__ import annotations

DECODE_DELTA, PREFILL_DELTA = 2, 0

DECODE_STAGES: tuple[tuple[str, ...], ...] = (
    ("proj",), ("core", "gate"), ("dispatch>", "shared"), ("<dispatch", "experts", "combine>"), ("<combine",))
PREFILL_STAGES: tuple[tuple[str, ...], ...] = (
    ("proj", "core", "gate", "dispatch>"), ("<dispatch", "experts", "combine>"), ("shared", "<combine"))


def delta_stages(decode: bool) -> int:
    return DECODE_DELTA if decode else PREFILL_DELTA


def schedule(num_stages: int, delta: int) -> list[tuple[int, int]]:
    """(micro-batch, stage) in execution order: at tick t, A's stage t then B's stage t - delta."""
    if not 0 <= delta <= num_stages:
        raise ValueError(f"a stage offset must be in 0..{num_stages}, got {delta}")
    order = []
    for t in range(num_stages + delta):
        if t < num_stages:
            order.append((0, t))
        if 0 <= t - delta < num_stages:
            order.append((1, t - delta))
    return order
