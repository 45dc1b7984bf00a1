"""Issue 21, item 6: the pre-registered prediction of SGLang's large-scale EP figures (lmsys blog 2025-05-05), priced
by the simulator's cost model (sim.cost=roofline) on conf/experiment/wide_ep_{prefill,decode}.yaml. Every parameter
comes from a source other than the predicted figures (docs/fidelity.md; DeepEP's tables, SGLang's TBO stage offsets,
the GPU fit of experiments/roofline_validation); the expert-load skew has no published source (sim.cost.zipf_exponent,
default 1.0, a free knob): the EPLB ratios are also written across exponents.

Each figure is the steady-state step the blog describes, priced once (no request arrivals: the blog saturates the
tested phase):
- prefill (EP32): every device holds `tokens_per_device` tokens of 4,096-token prompts, no cached prefix;
- decode (EP72): every device decodes `batch` requests holding 2,000 tokens of KV each, replaying a CUDA graph where
  the dispatch allows it.
Throughput per node = 8 x tokens per device / step seconds.

Writes predictions.json (the figures, the configs, git commit and a digest of the model's files; no published
figure). compare.py holds the published figures.

    python experiments/wide_ep/predict.py        # ~30 s
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.contracts.cost import BatchShape, Step, decode_shape  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.runs.sim import cost_model  # noqa: E402

PROMPT, CONTEXT, GPUS_PER_NODE = 4096, 2000, 8
EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25)
MODEL_FILES = ("plugins/cost/roofline.py", "plugins/cost/_layout.py", "plugins/cost/_host.py",
               "plugins/cost/lib/deepep.py", "plugins/cost/lib/expert_load.py", "plugins/cost/lib/tbo.py",
               "framework/gpu/roofline.py", "framework/gpu/hardware.py", "conf/experiment/wide_ep_prefill.yaml",
               "conf/experiment/wide_ep_decode.yaml", "data/gpu-profiles/fit/h100.json")


def prefill(tokens_per_device: int, extra: list[str]) -> dict:
    cfg = compose(["experiment=wide_ep_prefill"] + extra)
    n = tokens_per_device // PROMPT
    if n >= 1:
        batch = BatchShape("extend", (PROMPT,) * n, (0,) * n)
    else:
        batch = BatchShape("extend", (tokens_per_device,), (0,))
    r = cost_model(cfg).step_breakdown(Step((batch,) * cfg.parallel.size, graph=False))
    return {"tok_s_per_node": GPUS_PER_NODE * tokens_per_device / r["total_s"], "step_s": r["total_s"],
            "overrides": extra, "breakdown": r}


def decode(batch: int, extra: list[str]) -> dict:
    cfg = compose(["experiment=wide_ep_decode"] + extra)
    r = cost_model(cfg).step_breakdown(Step((decode_shape(batch, batch * CONTEXT),) * cfg.parallel.size,
                                            graph=True))
    return {"tok_s_per_node": GPUS_PER_NODE * batch / r["total_s"], "step_s": r["total_s"], "overrides": extra,
            "breakdown": r}


def ratio(on: dict, off: dict) -> float:
    return on["tok_s_per_node"] / off["tok_s_per_node"]


def main() -> None:
    t0 = time.time()
    cells: dict[str, dict] = {}
    # EPLB: with vs without (the same 288 slots, placed in order), at the blog's settings
    for e in EXPONENTS:
        z = [f"sim.cost.zipf_exponent={e}"]
        cells[f"eplb_prefill_s{e}"] = {"value": ratio(prefill(16384, z), prefill(16384, z + ["moe.eplb.rebalance_every=0"]))}
        cells[f"eplb_decode_s{e}"] = {"value": ratio(decode(256, z), decode(256, z + ["moe.eplb.rebalance_every=0"]))}
    cells["eplb_prefill"] = dict(cells["eplb_prefill_s1.0"], primary="zipf_exponent=1.0 (the default)")
    cells["eplb_decode"] = dict(cells["eplb_decode_s1.0"], primary="zipf_exponent=1.0 (the default)")
    # two-batch overlap: on vs off at the same tokens per device
    for tokens in (4096, 8192, 16384):
        cells[f"tbo_prefill_{tokens}"] = {"value": ratio(prefill(tokens, []), prefill(tokens, ["moe.tbo=false"])) - 1}
    for batch in (32, 64, 128, 256):
        cells[f"tbo_decode_{batch}"] = {"value": ratio(decode(batch, []), decode(batch, ["moe.tbo=false"])) - 1}
    # DeepEP's modes: what each allows (graph replay) and costs, decode at 256
    for mode in ("deepep_low_latency", "deepep_normal", "all_to_all"):
        d = decode(256, [f"moe.dispatch={mode}"])
        cells[f"decode_256_{mode}"] = {"value": d["tok_s_per_node"], "graph": bool(d["breakdown"]["graph"])}
    # absolute figures (issue 19's absolute model is still off for PR #1970: experiments/sim_repro/comparison_round1.json)
    p, pu, d = prefill(16384, []), prefill(16384, ["sim.cost.expert_loads=uniform"]), decode(256, [])
    cells["prefill_4k_ep32_tok_s_per_node"] = {"value": p["tok_s_per_node"], "breakdown": p["breakdown"]}
    cells["prefill_4k_ep32_uniform_tok_s_per_node"] = {"value": pu["tok_s_per_node"]}
    cells["decode_2k_ep72_tok_s_per_node"] = {"value": d["tok_s_per_node"], "breakdown": d["breakdown"]}
    out = {"experiment": "wide_ep", "git_sha": git_sha(), "wall_s": time.time() - t0,
           "digest": {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:16] for f in MODEL_FILES},
           "configs": {name: {"sim.cost": vars(c.sim.cost), "moe": vars(c.moe), "parallel": vars(c.parallel)}
                       for name, c in (("prefill", compose(["experiment=wide_ep_prefill"])),
                                       ("decode", compose(["experiment=wide_ep_decode"])))},
           "cells": cells}
    (HERE / "predictions.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    for k, v in cells.items():
        print(f"{k:45s} {v['value']:12.3f}")


if __name__ == "__main__":
    main()
