"""`drawn`: every figure a test saves, by file name, each checked as it is saved (tests/report/plot_fit.py)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.figure
import pytest
from plot_fit import png_problems, problems


class Drawn(dict):
    """File name -> the saved Figure; `problems`: what keeps any of them from reading well."""
    problems: list[str]


@pytest.fixture
def drawn(monkeypatch) -> Drawn:
    figs = Drawn()
    figs.problems = []
    save = matplotlib.figure.Figure.savefig

    def record(self, fname, *args, **kwargs):
        save(self, fname, *args, **kwargs)
        name = Path(fname).name
        figs[name] = self
        shown = self.dpi
        dpi = kwargs.get("dpi", "figure")
        self.set_dpi(shown if dpi == "figure" else dpi)      # text extents as the PNG has them (hinting: not linear)
        figs.problems += problems(self, name) + png_problems(Path(fname))
        self.set_dpi(shown)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return figs
