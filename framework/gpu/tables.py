"""Measured tables read between their points: linear (or linear in log2) between the two measured keys around a
value, the nearest measured key's entry outside them (a table says nothing past its ends; ``segment`` can extend the
end segments instead, for a model that prices past them as its source does)."""
from __future__ import annotations

from bisect import bisect_right
from math import log2
from typing import Iterable, Sequence


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


def segment(keys: Sequence[float], x: float, extend: bool = False) -> tuple[int, float]:
    """(i, w): the segment of ascending ``keys`` (at least 2) that reads ``x``, keys[i] to keys[i + 1], and x's weight
    towards keys[i + 1]; past an end, the end segment with w clamped to 0 or 1 (``extend``: not clamped). A hot-path
    reader: the keys are sorted once by the caller."""
    i = min(max(bisect_right(keys, x) - 1, 0), len(keys) - 2)
    w = (x - keys[i]) / (keys[i + 1] - keys[i])
    return i, w if extend else min(max(w, 0.0), 1.0)


def interpolate(row: dict[int, float], x: float, log: bool = False) -> float:
    """``row``'s value at ``x``."""
    lo, hi, w = bracket(row, x, log)
    return float(row[lo]) if lo == hi else row[lo] + w * (row[hi] - row[lo])
