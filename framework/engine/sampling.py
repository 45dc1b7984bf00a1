"""Greedy, temperature and top-p sampling, batched; per-request parameters."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, params: list, generator: torch.Generator) -> list[int]:
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature <= 0:
            continue
        probs = (logits[i].float() / p.temperature).softmax(dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p     # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        tokens[i] = torch.multinomial(probs.cpu(), 1, generator=generator).item()
    return tokens.tolist()
