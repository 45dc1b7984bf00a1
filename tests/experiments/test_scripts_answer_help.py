"""Every script under experiments/ reads its command line with argparse, so ``--help`` prints its usage instead of
running it: eight did not, and ``--help`` ran them and rewrote their committed results."""
from __future__ import annotations

import ast
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def entry_points() -> list[Path]:
    return [p for p in sorted(EXPERIMENTS.rglob("*.py")) if 'if __name__ == "__main__":' in p.read_text()]


def test_every_experiment_script_parses_its_command_line_with_argparse():
    scripts = entry_points()
    assert len(scripts) > 40
    plain = []
    for path in scripts:
        tree = ast.parse(path.read_text())
        names = {a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for a in node.names}
        if "argparse" not in names and "ArgumentParser" not in names:
            plain.append(str(path.relative_to(EXPERIMENTS)))
    assert plain == [], f"scripts that would run on --help: {plain}"
