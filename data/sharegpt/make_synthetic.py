"""Writes synthetic_sharegpt.json.gz: 200 synthetic conversations in the ShareGPT format, so that workload=sharegpt
runs in a fresh clone. Word salad, not real chats: 1-4 human/gpt exchanges, log-normal lengths (human median ~120
characters, gpt ~400, the real dataset's shape at a smaller scale). Deterministic:

    python data/sharegpt/make_synthetic.py
"""
import gzip
import json
import math
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from framework.contracts.workload import random_text  # noqa: E402


def main() -> None:
    rng = random.Random(2024)

    def text(median: float) -> str:
        return random_text(rng, max(4, round(rng.lognormvariate(math.log(median), 0.9))))
    convs = []
    for i in range(200):
        messages = []
        for _ in range(rng.randint(1, 4)):
            messages += [{"from": "human", "value": text(120)}, {"from": "gpt", "value": text(400)}]
        convs.append({"id": f"synthetic-{i}", "conversations": messages})
    data = json.dumps(convs, indent=0).encode()
    with gzip.GzipFile(HERE / "synthetic_sharegpt.json.gz", "wb", mtime=0) as f:
        f.write(data)
    print(f"wrote {HERE / 'synthetic_sharegpt.json.gz'} ({len(convs)} conversations, {len(data):,} bytes of JSON)")


if __name__ == "__main__":
    main()
