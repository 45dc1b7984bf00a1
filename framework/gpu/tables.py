"""Measured tables read between their points: linear (or linear in log2) between the two measured keys around a
value, the nearest measured key's entry outside them (a table says nothing past its ends)."""
from __future__ import annotations

from math import log2
from typing import Iterable


def bracket(keys: Iterable[float], x: float, log: bool = False) -> tuple[float, float, float]:
    """(lo, hi, w): the measured keys around ``x`` and its weight towards ``hi`` (lo == hi, w == 0 at or past an end,
    or on a measured key)."""
    known = sorted(keys)
    if x <= known[0]:
        return known[0], known[0], 0.0
    if x >= known[-1]:
        return known[-1], known[-1], 0.0
    hi = next(k for k in known if k >= x)
    lo = max(k for k in known if k <= x)
    if hi == lo:
        return lo, lo, 0.0
    f = log2 if log else float
    return lo, hi, (f(x) - f(lo)) / (f(hi) - f(lo))


def interpolate(row: dict[int, float], x: float, log: bool = False) -> float:
    """``row``'s value at ``x``."""
    lo, hi, w = bracket(row, x, log)
    return float(row[lo]) if lo == hi else row[lo] + w * (row[hi] - row[lo])
