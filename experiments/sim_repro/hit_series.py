"""SGLang's cache hit rate over time in the router benchmark (issue 19, item 1): when does each worker's hit rate,
as SGLang v0.4's Scheduler.log_prefill_stats prints it (cumulative since start, token-weighted), reach the figure
SGLang PR #2170 published (round robin 20%, cache-aware 75%), and what does it read at the end?

conf/experiment/sglang_router_blog.yaml in mode=sim, both routers, the Llama-3.1-8B stand-in. Writes hit_series.json,
hit_series.md and plots/hit_series.png here.

    python experiments/sim_repro/hit_series.py            # seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.engine.stats import crossing_time  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

HERE = Path(__file__).resolve().parent


def router_series(router: str) -> dict:
    cfg = compose(["experiment=sglang_router_blog", f"router={router}"])
    published = cfg.sim.published["figures"][router]["sglang_cache_hit_rate"]
    results, _ = simulate(cfg)
    series = [s for inst in results["sglang_cache_hit_rate_series"] for s in inst]   # one scheduler per worker
    cross = [crossing_time(s, published) for s in series]
    second = [s[1][1] if len(s) > 1 else float("nan") for s in series]    # each worker's second prefill log line
    return {"router": router, "published_hit_rate": published, "duration_s": results["duration_s"],
            "final_hit_rate": results["sglang_cache_hit_rate"],
            "final_per_worker": results["sglang_cache_hit_rate_per_instance"],
            "request_hit_rate": results["cache_hit_rate"], "crossing_s": cross,
            "second_prefill_t_s": [s[1][0] if len(s) > 1 else None for s in series],
            "second_prefill_rate": second, "min_after_third_prefill": [min(r for _, r in s[2:]) for s in series],
            "series": series}


def markdown(rows: list[dict]) -> str:
    out = ["| router | published | rate at each worker's 2nd prefill (mean; t) | reaches published at (s, per "
           "worker: median [min-max]) | lowest after the 3rd prefill | end of run (all; per worker min-max) | "
           "duration s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cross = [c for c in r["crossing_s"] if c is not None]
        out.append(
            f"| {r['router']} | {r['published_hit_rate']:.2f} | {statistics.mean(r['second_prefill_rate']):.3f}; "
            f"t {statistics.median(r['second_prefill_t_s']):.2f} s | "
            f"{statistics.median(cross):.2f} [{min(cross):.2f}-{max(cross):.2f}] ({len(cross)}/{len(r['crossing_s'])}) | "
            f"{min(r['min_after_third_prefill']):.3f} | {r['final_hit_rate']:.3f}; {min(r['final_per_worker']):.3f}-"
            f"{max(r['final_per_worker']):.3f} | {r['duration_s']:.1f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.2), constrained_layout=True)
    for r, color in zip(rows, ("tab:red", "tab:blue")):
        for i, s in enumerate(r["series"]):
            ax.plot([t for t, _ in s], [x for _, x in s], color=color, lw=0.8, alpha=0.7,
                    label=f"{r['router']} (each worker)" if i == 0 else None)
        ax.axhline(r["published_hit_rate"], color=color, ls="--", lw=1, label=f"PR #2170 {r['router']}")
    ax.set_xlabel("time since the run began (s, simulated)")
    ax.set_ylabel("SGLang's cache hit rate (cumulative)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    rows = [router_series(r) for r in ("round_robin", "cache_aware")]
    text = markdown(rows)
    (HERE / "hit_series.json").write_text(json.dumps({"experiment": "sim_repro/hit_series", "git_sha": git_sha(),
                                                      "rows": rows}, indent=2) + "\n")
    (HERE / "hit_series.md").write_text(text)
    p = plot(rows, HERE / "plots" / "hit_series.png")
    print(text + f"results: {HERE / 'hit_series.json'}  plot: {p}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
