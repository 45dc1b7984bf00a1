"""A profile taken as measured (`run.py --normalize none`), normalized afterwards as run.py's `--normalize pinned` (the
default) or `--normalize engine` would have done it, from the readings it recorded before each point. It is the same
measurement under another method: experiments/sim_fidelity compares the scales on the same real runs (issue 19, item
9; protocol_engine_probe.md, protocol_engine_level.md). Under `pinned` the serving measurement is moved to the same
reference by the speeds serving.py took before each of its runs; under `engine` it stays as measured (serving.py
reads host_probe only).

    python experiments/calibrate/renormalize.py data/calibration/cpu_amd_epyc_engine.json \\
        data/calibration/cpu_amd_epyc_engine_pinned.json
    python experiments/calibrate/renormalize.py --by engine data/calibration/cpu_amd_epyc_engine.json \\
        data/calibration/cpu_amd_epyc_engine_level.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.core.paths import load_script  # noqa: E402

calibrate = load_script(HERE / "run.py")   # (by path: a bare `run` may be another folder's run.py)


def pinned_twin(data: dict) -> dict:
    """``data`` (a profile as measured) with its configs and serving measurement at host_probe's reference speed, the
    mean of its points' readings. It no longer carries the engine probe's speed: its points are not as measured."""
    out, stamp, keys = _as_measured(data)
    reference = calibrate.normalize(out["profiles"], keys)
    out["host_probe"] = {**{k: v for k, v in stamp.items() if k != "engine_s"}, "pinned_s": reference,
                         "normalized": "pinned"}
    serving = out.get("serving")
    if serving:
        if serving.get("normalized_to_pinned_s") is not None or not serving.get("pinned_s"):
            raise ValueError("the serving measurement is normalized already, or recorded no host speeds: re-measure "
                             "it with experiments/calibrate/serving.py on the profile as measured")
        k = reference / statistics.fmean(serving["pinned_s"])
        out["serving"] = {**serving, "request_cpu_s": serving["request_cpu_s"] * k,
                          "token_cpu_s": serving["token_cpu_s"] * k, "normalized_to_pinned_s": reference,
                          "per_request_by_output": {o: [v * k for v in vs]
                                                    for o, vs in serving["per_request_by_output"].items()}}
    out["note"] = out.get("note", "") + "; normalized by host_probe afterwards (experiments/calibrate/renormalize.py)"
    return out


def engine_twin(data: dict) -> dict:
    """``data`` (a profile as measured with --engine-probe) with each config's points at the engine probe's reference
    speed, the mean of its points' readings (the stamp's `engine_s`, unchanged), as `run.py --normalize engine`."""
    out, stamp, keys = _as_measured(data)
    if not stamp.get("engine_s") or any("engine_s" not in out["profiles"][k][kind] for k in keys
                                        for kind in ("prefill", "decode")):
        raise ValueError("the profile has no engine probe's readings before its points: take it with "
                         "experiments/calibrate/run.py --engine-probe --normalize none")
    reference = calibrate.normalize(out["profiles"], keys, by="engine_s")
    out["host_probe"] = {**stamp, "engine_s": reference, "normalized": "engine"}
    out["note"] = out.get("note", "") + ("; normalized by the engine probe afterwards "
                                         "(experiments/calibrate/renormalize.py --by engine); serving as measured")
    return out


def _as_measured(data: dict) -> tuple[dict, dict, list[str]]:
    """A copy of ``data`` to normalize, its host stamp and its configs' keys, refused unless it is as measured and
    every config in it was measured in the one run."""
    stamp = data.get("host_probe") or {}
    if stamp.get("normalized") != "none":
        raise ValueError(f"the profile's host_probe.normalized is {stamp.get('normalized')!r}: renormalize takes a "
                         f"profile taken with experiments/calibrate/run.py --normalize none")
    keys = [calibrate.config_key_of(name) for name in data.get("profiled_now", [])]
    if not keys or set(data["profiles"]) != set(keys):
        raise ValueError(f"the profile holds configs {sorted(data['profiles'])}, measured now {sorted(keys)}: only a "
                         f"profile whose every config was measured in the one run can be normalized to its speed")
    return json.loads(json.dumps(data)), stamp, keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--by", choices=["pinned", "engine"], default="pinned",
                    help="host_probe's readings (run.py's default), or the engine probe's")
    args = ap.parse_args()
    twin = (engine_twin if args.by == "engine" else pinned_twin)(json.loads(args.source.read_text()))
    args.out.write_text(json.dumps(twin, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
