"""Make data/gpu-profiles/ from Vidur's published profiles: keep the columns the roofline fit reads, gzip.

    python experiments/roofline_validation/trim_profiles.py SRC_DIR

SRC_DIR holds Vidur's files (microsoft/vidur, commit 7d47513, data/profiling/) renamed as
compute/{gpu}_{model}_mlp.csv and network/{gpu}_dgx_{collective}.csv. Of each time statistic only the median is
kept; the row index, `rank` and `max_devices_per_node` columns are dropped. Output bytes are deterministic.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "data" / "gpu-profiles"
COMPUTE_SHAPE = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
                 "num_tensor_parallel_workers")
NETWORK_SHAPE = ("collective", "num_workers", "devices_per_node", "size")


def trim(src: Path, dst: Path, shape: tuple[str, ...]) -> None:
    with src.open(newline="") as f:
        rows = list(csv.DictReader(f))
    medians = [c for c in rows[0] if c.startswith("time_stats.") and c.endswith(".median")]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(list(shape) + medians)
    for r in rows:
        writer.writerow([r[c] for c in shape] + [r[c] for c in medians])
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(dst, "wb", mtime=0) as f:
        f.write(buf.getvalue().encode())


def main(src: Path) -> None:
    for path in sorted(src.glob("compute/*_mlp.csv")):
        trim(path, OUT / "compute" / (path.name + ".gz"), COMPUTE_SHAPE)
    for path in sorted(src.glob("network/*_dgx_*.csv")):
        trim(path, OUT / "network" / (path.name + ".gz"), NETWORK_SHAPE)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src_dir", type=Path, help="Vidur's profiles, renamed as above")
    main(ap.parse_args().src_dir)
