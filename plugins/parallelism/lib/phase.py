"""Telling the MoE backend the step's phase before an FFN layer runs: two-batch overlap orders its stages by it
(SGLang: micro-batch B lags two stages in decode, none in prefill), and every rank must pick the same order, so the
phase is the instance's: decode only when every DP group decodes (or idles)."""
from __future__ import annotations

from framework.model.layers import MoE


def tell_phase(module, decode: bool) -> None:
    if isinstance(module, MoE) and module.backend is not None:
        module.backend.set_phase(decode)
