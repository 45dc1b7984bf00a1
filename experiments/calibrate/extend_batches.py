"""Extend steps of several requests on the real single-rank engine, beside their prices by `sim.cost=calibrated`
with `extend=batch` (one request of the batch's total tokens) and `extend=per_request` (each request's attention on
its own), by the fit and by the grid. The profile measures one request at a time, so this is the check of how a
batch of them is priced (issue 19, item 9). Each shape: k requests of n new tokens, each on its own cached prefix of
p tokens (served first; p = 0: none), sent at once (one extend step), the median of 7 times to the last first token.
The prefixed shapes are multi-turn's (a next turn of ~100 new tokens on a history of up to ~540). A profile normalized
to a reference speed (experiments/calibrate/run.py --normalize pinned) is priced at the host's pinned speed taken before
each shape (framework/core/host_probe.pinned), as sim_fidelity's --host-scale pinned does.

    python experiments/calibrate/extend_batches.py      # ~1 min; prints a table, writes extend_batches.json here
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.contracts.cost import BatchShape, Step  # noqa: E402
from framework.core.host_probe import pinned  # noqa: E402
from framework.core.paths import git_sha, load_script  # noqa: E402
from framework.core.registry import COST  # noqa: E402
from framework.runs.sim import cost_instance  # noqa: E402
from plugins.cost.calibrated import DEFAULT_PATH, read_calibration, reference_pinned_s  # noqa: E402

_calibrate = load_script(HERE / "run.py")   # (by path: a bare `run` may be another folder's run.py)
CONFIGS, _serve, _text = _calibrate.CONFIGS, _calibrate._serve, _calibrate._text

SHAPES = [(1, 512, 0), (2, 256, 0), (4, 128, 0), (8, 64, 0), (4, 64, 0), (2, 64, 0),     # (requests, new, prefix)
          (1, 104, 512), (2, 104, 512), (4, 104, 512), (4, 104, 256), (2, 256, 256)]   # each one step (<= 512 new)
REPEATS = 7


def main() -> None:
    import torch
    torch.set_num_threads(1)                       # as experiments/calibrate/run.py profiles
    cfg, handle, face = _calibrate.profiled_engine(CONFIGS["single"])
    inst = cost_instance(cfg)
    prices = {(b, e): COST.build("calibrated", COST.get("calibrated").Config(between=b, extend=e), inst)
              for b in ("fit", "grid") for e in ("batch", "per_request")}
    reference = reference_pinned_s(read_calibration(DEFAULT_PATH).get("host_probe"))
    rng, rows = random.Random(5), []
    try:
        _serve(face, [_text(rng, 64)], 4)          # warm-up
        for k, n, p in SHAPES:
            scale = pinned() / reference if reference else 1.0
            times = []
            for _ in range(REPEATS):
                prefixes = [_text(rng, p) for _ in range(k)]
                if p:
                    _serve(face, prefixes, 1)      # cached, each its own (a conversation's history)
                runs = _serve(face, [prefix + _text(rng, n) for prefix in prefixes], 1)
                times.append(max(r[1] for r in runs) - runs[0][0])
            step = Step(batches=(BatchShape("extend", (n,) * k, (p,) * k),))
            rows.append({"requests": k, "new_tokens": n, "prefix_tokens": p, "host_scale": scale,
                         "measured_ms": statistics.median(times) * 1e3,
                         **{f"{b}_{e}_ms": pr.step_time(step) * scale * 1e3 for (b, e), pr in prices.items()}})
    finally:
        handle.close()
        handle.terminate()
    cols = [c for c in rows[0] if c.endswith("_ms")]
    print("| requests x new tokens on prefix | host x | " + " | ".join(cols) + " |\n|---|---:|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['requests']} x {r['new_tokens']} on {r['prefix_tokens']} | {r['host_scale']:.2f} | "
              + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
    (HERE / "extend_batches.json").write_text(json.dumps({"git_sha": git_sha(), "repeats": REPEATS,
                                                          "reference_pinned_s": reference, "rows": rows},
                                                         indent=1) + "\n")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
