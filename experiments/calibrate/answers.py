"""Measure the real engine's answers for `sim.answers=measured`: multi-turn conversations served by the tiny model
(greedy, ignore_eos: what the workloads send), each answer's sampled ids kept, and the mechanism they feed measured.

A real multi-turn client appends each answer's TEXT to the next turn's prompt (the worker streams
ByteTokenizer.decode of the ids: specials dropped, invalid UTF-8 as U+FFFD), and the worker re-encodes it; the radix
cache holds the ids as sampled, so the next turn's hit stops at the first answer token whose re-encoding differs.
mode=sim cannot run the model: with `sim.answers=measured` each simulated answer is one of these measured answers
(framework/sim/answers.py), so its text and where its re-encoding diverges are a real answer's.

Its own prompts (workload seeds --prompt-seeds, each with its own system prompt, which sways the answers of a whole
run: no judged run's), the judged runs' model weights (--weight-seeds: a run's `seed` seeds the weights, and other
weights answer otherwise). Each answer is generated --answer-tokens long (greedy: a shorter answer to the same prompt
is its prefix) and its first `max_new_tokens` are what the conversation appends, as the real client would. Per answer
it records the tokens, the bytes of its text, the first token whose re-encoding differs, and (next turn) the radix
cache's hit against the one the mechanism predicts (the common prefix of the previous prompt + answer ids and the new
prompt). The file keeps each weight seed's answers, each distinct one with how many times it was measured.

    python experiments/calibrate/answers.py        # ~35 s; writes data/calibration/answers.json
"""
from __future__ import annotations

import argparse
import codecs
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402
from framework.engine.request import Req, SamplingParams  # noqa: E402
from framework.instance.client import open_engine  # noqa: E402
from framework.instance.handle import SyncFace  # noqa: E402
from framework.instance.rank_loop import InstanceSpec  # noqa: E402
from framework.sim.answers import DEFAULT_PATH, divergence  # noqa: E402

# the shape of sim_fidelity's multi-turn cells (experiments/router_ablation), on this script's own prompts
WORKLOAD_OVERRIDES = ["workload=multi_turn", "workload.num_conversations=32", "workload.turns=6",
                      "workload.system_prompt_len=16", "workload.user_len=96", "workload.output_len=8"]


def streamed_text(ids: list[int]) -> str:
    """What the real worker streams for these ids (framework/instance/handle.py's Stream: one token at a time
    through an incremental UTF-8 decoder); the client keeps the whole text."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return "".join(dec.decode(bytes(t for t in ids[i:i + 1] if t < 256), final=i == len(ids) - 1)
                   for i in range(len(ids)))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(weight_seed: int, prompt_seed: int, answer_tokens: int) -> tuple[list[list[int]], list[dict]]:
    """(every answer's ids, a row per answer), from conversations played turn by turn on one real instance."""
    cfg = compose(WORKLOAD_OVERRIDES + ["engine.kv_budget_mb=64", "logger.mode=disabled"])   # nothing evicted
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, prompt_seed).sessions()
    longest = max(t.max_new_tokens for s in sessions for t in s.turns)
    if answer_tokens < longest:
        sys.exit(f"--answer-tokens {answer_tokens} is shorter than the workload's longest answer ({longest})")
    handle = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, weight_seed))
    face, tok = SyncFace(handle), handle.tokenizer
    texts = {s.sid: [] for s in sessions}
    last: dict[str, tuple[list[int], dict]] = {}   # each conversation's previous prompt + answer ids, and its row
    answers, rows = [], []
    try:
        for k in range(max(len(s.turns) for s in sessions)):
            reqs = [(s, Req(tok.encode(s.prompt(k, texts[s.sid])),
                            SamplingParams(max_new_tokens=answer_tokens, temperature=cfg.workload.temperature,
                                           ignore_eos=cfg.workload.ignore_eos)))
                    for s in sessions if k < len(s.turns)]
            for _, r in reqs:
                face.add(r)
            while not all(r.finished for _, r in reqs):
                face.step(timeout=1.0)
            for s, r in reqs:
                if s.sid in last:                  # this turn's hit against the previous turn's prompt + answer
                    before, row = last[s.sid]
                    row["next_hit"] = {"cached": r.cached_tokens, "common_prefix": common_prefix(before, r.prompt_ids)}
                ids = r.output_ids[:s.turns[k].max_new_tokens]       # what a max_new_tokens answer would be
                text = tok.decode(ids)
                if streamed_text(ids) != text:
                    raise RuntimeError(f"the streamed text differs from decode for {ids}")
                texts[s.sid].append(text)
                answers.append(r.output_ids)
                rows.append({"sid": s.sid, "turn": k, "tokens": len(ids), "text_bytes": len(tok.encode(text)),
                             "diverge": divergence(ids), "survives": tok.encode(text) == ids, "first": ids[0]})
                last[s.sid] = r.prompt_ids + ids, rows[-1]
    finally:
        handle.close()
        handle.terminate()
    return answers, rows


def summary(rows: list[dict]) -> dict:
    """What the measured answers say about the mechanism (the figures this script prints)."""
    hits = [r["next_hit"] for r in rows if "next_hit" in r]
    tokens, text_bytes = sum(r["tokens"] for r in rows), sum(r["text_bytes"] for r in rows)
    return {"answers": len(rows), "tokens": tokens, "text_bytes": text_bytes,
            "text_bytes_per_token": round(text_bytes / tokens, 3),
            "first_divergence": dict(sorted(collections.Counter(r["diverge"] for r in rows).items())),
            "survive_whole": sum(r["survives"] for r in rows),
            "first_token": dict(collections.Counter(r["first"] for r in rows).most_common(5)),
            "next_turn_hits": len(hits),
            "next_turn_hit_is_prefix_match": sum(h["cached"] == h["common_prefix"] for h in hits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weight-seeds", type=int, nargs="+", default=[0], help="the runs' `seed`: the model's weights")
    ap.add_argument("--prompt-seeds", type=int, nargs="+", default=list(range(101, 109)),
                    help="the conversations' own seeds, each its own system prompt (no judged run's: those use 0)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="each measured answer's length")
    ap.add_argument("--out", type=Path, default=ROOT / DEFAULT_PATH)
    args = ap.parse_args()
    if args.answer_tokens < 1:
        sys.exit(f"--answer-tokens must be >= 1, got {args.answer_tokens}")
    import torch
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = compose(WORKLOAD_OVERRIDES)
    out = {"what": "the real engine's greedy answers, per weight seed: [times measured, ids] "
                   "(experiments/calibrate/answers.py; framework/sim/answers.py reads it)",
           "model": cfg.model.name, "vocab_size": cfg.model.vocab_size, "temperature": cfg.workload.temperature,
           "ignore_eos": cfg.workload.ignore_eos, "answer_tokens": args.answer_tokens,
           "workload": WORKLOAD_OVERRIDES, "prompt_seeds": args.prompt_seeds, "git_sha": git_sha(),
           "summary": {}, "answers": {}}
    for seed in args.weight_seeds:
        answers, rows, per_prompt = [], [], {}
        for prompt_seed in args.prompt_seeds:
            a, r = measure(seed, prompt_seed, args.answer_tokens)
            answers, rows, per_prompt[prompt_seed] = answers + a, rows + r, summary(r)
            print(f"weight seed {seed}, prompt seed {prompt_seed}: {json.dumps(per_prompt[prompt_seed])}", flush=True)
        out["summary"][str(seed)] = {**summary(rows), "text_bytes_per_token_per_prompt_seed": {
            k: v["text_bytes_per_token"] for k, v in per_prompt.items()}}
        out["answers"][str(seed)] = [[n, list(ids)] for ids, n in collections.Counter(map(tuple, answers)).items()]
        print(f"weight seed {seed}, all: {json.dumps(out['summary'][str(seed)])}", flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({k: v for k, v in out.items() if k != "answers"}, indent=1)[:-2]
    banks = ",\n".join(f'  "{s}": [\n' + ",\n".join("   " + json.dumps(a) for a in v) + "\n  ]"
                        for s, v in out["answers"].items())
    args.out.write_text(body + ',\n "answers": {\n' + banks + "\n }\n}\n")   # one answer a line
    print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()
