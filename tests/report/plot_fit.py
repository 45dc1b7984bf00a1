"""Does a drawn figure read? Its text inside the figure, tick labels apart, legends off the data, the frame's labels
(titles, axis labels, tick labels, legends) clear of one another, and the PNG within a screen's size. Used by
test_plots_fit.py on every plot the project draws."""
from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox

MAX_PNG_PX = (2000, 2700)             # width, height: a screen's width, a tall page of bars
SLACK_PX = 1.0                        # rounding at the edges


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    return struct.unpack(">II", head[16:24])


def _overlap(a: Bbox, b: Bbox, slack: float = SLACK_PX) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack)


def _shown(t: Text) -> bool:
    return t.get_visible() and bool(t.get_text().strip())


def _tick_labels(axis) -> list[Text]:
    """The tick labels drawn: visible, with text, at a tick inside the view (matplotlib keeps others around)."""
    lo, hi = sorted(axis.get_view_interval())
    out = []
    for locs, labels in ((axis.get_majorticklocs(), axis.get_majorticklabels()),
                         (axis.get_minorticklocs(), axis.get_minorticklabels())):
        span = (hi - lo) * 1e-9
        out += [t for loc, t in zip(locs, labels) if lo - span <= loc <= hi + span and _shown(t)]
    return out


def _legends(fig) -> list:
    return [lg for lg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if lg is not None and lg.get_visible()]


def _data_boxes(ax, renderer) -> list[Bbox]:
    """Where the axes' data lie on the canvas: each line's points, each bar, each scatter point."""
    boxes = []
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        boxes += [Bbox.from_extents(x - 1, y - 1, x + 1, y + 1) for x, y in xy if np.isfinite(x) and np.isfinite(y)]
    for p in ax.patches:
        if isinstance(p, Rectangle) and p.get_visible() and p.get_width() and p.get_height():
            boxes.append(p.get_window_extent(renderer))
    for c in ax.collections:
        if isinstance(c, PathCollection) and c.get_visible():
            xy = c.get_offset_transform().transform(np.asarray(c.get_offsets(), dtype=float))
            boxes += [Bbox.from_extents(x - 1, y - 1, x + 1, y + 1) for x, y in xy]
    return boxes


def problems(fig, name: str = "figure") -> list[str]:
    """What keeps this figure (saved, so laid out) from reading well; [] when nothing does."""
    renderer = fig.canvas.get_renderer()          # a saved figure is laid out and drawn: its extents hold
    frame = fig.bbox
    found = []
    drawn = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for t in _tick_labels(axis)}
    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for t in (*axis.get_majorticklabels(), *axis.get_minorticklabels())}
    for t in fig.findobj(Text):
        if not _shown(t) or id(t) in ticks and id(t) not in drawn:
            continue
        box = t.get_window_extent(renderer)
        if box.x0 < frame.x0 - SLACK_PX or box.y0 < frame.y0 - SLACK_PX or box.x1 > frame.x1 + SLACK_PX \
                or box.y1 > frame.y1 + SLACK_PX:
            found.append(f"{name}: text {t.get_text()!r} runs outside the figure")
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = _tick_labels(axis)
            boxes = [t.get_window_extent(renderer) for t in labels]
            for (a, ta), (b, tb) in itertools.combinations(zip(boxes, labels), 2):
                if _overlap(a, b):
                    found.append(f"{name}: tick labels {ta.get_text()!r} and {tb.get_text()!r} overlap")
    for legend in _legends(fig):
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if any(_overlap(box, d, 0) for d in _data_boxes(ax, renderer)):
                found.append(f"{name}: a legend covers data of the axes titled {ax.get_title()!r}")
                break
    frame_texts = []                  # the labels around the plots, each with its owner: none may cover another
    for i, ax in enumerate(fig.axes):
        owned = [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label,
                 *_tick_labels(ax.xaxis), *_tick_labels(ax.yaxis)]
        frame_texts += [(i, t.get_window_extent(renderer), t.get_text()) for t in owned if _shown(t)]
    for j, legend in enumerate(_legends(fig)):
        frame_texts.append((f"legend{j}", legend.get_window_extent(renderer), "a legend"))
    if fig._suptitle is not None and _shown(fig._suptitle):
        frame_texts.append(("suptitle", fig._suptitle.get_window_extent(renderer), fig._suptitle.get_text()))
    for (oa, a, ta), (ob, b, tb) in itertools.combinations(frame_texts, 2):
        if oa != ob and _overlap(a, b):
            found.append(f"{name}: {ta!r} and {tb!r} overlap")
    return found


def png_problems(path: Path) -> list[str]:
    w, h = png_size(path)
    return [] if w <= MAX_PNG_PX[0] and h <= MAX_PNG_PX[1] else \
        [f"{Path(path).name}: {w} x {h} px, above {MAX_PNG_PX[0]} x {MAX_PNG_PX[1]}"]
