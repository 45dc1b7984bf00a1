"""Published measurements as tables: reading a rate between the measured points."""
from __future__ import annotations

from math import log2


def log2_interp(row: dict[int, float], x: float) -> float:
    """``row``'s value at ``x``: linear in log2 x between the two measured points around it, the nearest measured
    point's value outside them (a published table says nothing past its ends)."""
    xs = sorted(row)
    if x <= xs[0]:
        return float(row[xs[0]])
    if x >= xs[-1]:
        return float(row[xs[-1]])
    hi = next(v for v in xs if v >= x)
    lo = max(v for v in xs if v <= x)
    if hi == lo:
        return float(row[lo])
    w = (log2(x) - log2(lo)) / (log2(hi) - log2(lo))
    return row[lo] + w * (row[hi] - row[lo])
