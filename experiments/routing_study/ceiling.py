"""A workload's hit-rate ceiling: the share of prompt tokens one unbounded prefix cache would serve if it kept every
prompt and every answer, requests taken in arrival order (sessions by arrival, each session's turns in order). Answers
are placeholders of the asked length, unique per request (generated text shares nothing by chance). With the byte
tokenizer and ASCII workloads characters are tokens, so the cache-aware policy's radix tree over text does it.

`worker_of(i)` (session index -> worker) gives a fixed assignment's ceiling instead: one unbounded cache per worker,
each seeing only its sessions (e.g. round robin's `i % n` when every session is one request sent in order)."""
from __future__ import annotations

from plugins.routing.lib.radix_tree import RadixTree


def hit_rate_ceiling(sessions, worker_of=lambda i: 0) -> float:
    trees: dict = {}
    answers: list[list[str]] = [[] for _ in sessions]
    hit = total = 0
    for _, i, k in sorted((s.arrival_s, i, k) for i, s in enumerate(sessions) for k in range(len(s.turns))):
        prompt = sessions[i].prompt(k, answers[i])
        tree = trees.setdefault(worker_of(i), RadixTree())
        matched, _ = tree.walk(prompt)
        hit += min(matched, len(prompt) - 1)  # an engine computes the last prompt token at least
        total += len(prompt)
        answers[i].append(f"\x00{i}.{k}\x00".ljust(sessions[i].turns[k].max_new_tokens, "\x01"))
        tree.insert(prompt + answers[i][-1], "cache", 0.0)
    return hit / total if total else 0.0
