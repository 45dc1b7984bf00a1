"""What a run leaves behind for a researcher, piece by piece (the whole runs are in test_run_user.py): git_sha marks
uncommitted code, new files included; results.json is strict JSON; run.log holds what the run printed; a failure
after composing is written into the run's folder; off a terminal a progress line comes every N seconds."""
from __future__ import annotations

import io
import json
import subprocess
import time

import pytest

from framework.core import paths
from framework.core.errors import UserError
from framework.runlog import console_to_log, record_error
from framework.runs.finish import json_safe, strict_json
from framework.runs.progress import heartbeat, phase


def strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, as strict parsers (jq, JavaScript, Go) do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_sha_marks_edited_and_new_code_but_not_docs(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    (tmp_path / "plugin.py").write_text("x = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path)
    clean = paths.git_sha()
    assert len(clean) >= 7 and not clean.endswith("+dirty")
    (tmp_path / "notes.md").write_text("a doc\n")                 # docs and results do not count
    assert paths.git_sha() == clean
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "my_policy.py").write_text("y = 2\n")  # a new plugin, never `git add`ed
    assert paths.git_sha() == clean + "+dirty"
    (tmp_path / "plugins" / "my_policy.py").unlink()
    (tmp_path / "plugin.py").write_text("x = 2\n")                 # a tracked file edited
    assert paths.git_sha() == clean + "+dirty"


def test_results_are_strict_json():
    results = {"router_confirmed_hit_rate": float("nan"), "ttft_p50_ms": 21.5, "rates": [1.0, float("inf")],
               "per_worker": {"w0": {"hit": float("nan")}}}
    text = strict_json(results)
    assert strict_loads(text) == {"router_confirmed_hit_rate": None, "ttft_p50_ms": 21.5, "rates": [1.0, None],
                                  "per_worker": {"w0": {"hit": None}}}
    assert json_safe(3) == 3 and json_safe("nan") == "nan"


def test_run_log_holds_what_the_run_printed_and_its_error(tmp_path, capsys):
    with console_to_log(str(tmp_path)):
        print("the table")
        print("\r 40% bar redraw", end="")               # a progress bar's redraw stays on the console
        print("error: it failed", file=__import__("sys").stderr)
    assert (tmp_path / "run.log").read_text() == "the table\nerror: it failed\n"
    assert "the table" in capsys.readouterr().out        # the console still gets everything

    (tmp_path / "results.json").write_text('{"ttft_p50_ms": 3.0, "hit": NaN}')   # a run that reported, then failed
    message, path = record_error(str(tmp_path), UserError("2 request(s) failed"), {"mode": "bench"})
    assert message == "2 request(s) failed" and path == tmp_path / "results.json"
    assert strict_loads(path.read_text()) == {"ttft_p50_ms": 3.0, "hit": None, "error": "2 request(s) failed"}
    assert json.loads((tmp_path / "config.json").read_text()) == {"mode": "bench"}
    assert not (tmp_path / "error.txt").exists()         # a bad setting is one sentence, not a traceback

    try:
        {}["missing"]
    except KeyError as bug:
        message, _ = record_error(str(tmp_path / "bug"), bug, {})
    assert message == "KeyError: 'missing'"
    assert "Traceback" in (tmp_path / "bug" / "error.txt").read_text()


class Console(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_progress_lines_off_a_terminal_only(tty):
    stream, done, wait = Console(tty), [], 0.05 if tty else 0.2
    with heartbeat(0.02 if tty else 0.05, stream):
        phase("starting 2 workers and the router")
        time.sleep(wait)
        phase("playing 8 requests through the router", done=lambda: f"{len(done)} of 8 done")
        done.append(1)
        time.sleep(wait)
    lines = stream.getvalue().splitlines()
    if tty:
        assert lines == []                                # the terminal has the progress bars
        return
    assert any(line.startswith("progress: starting 2 workers and the router, ") for line in lines), lines
    assert any(line.startswith("progress: playing 8 requests through the router, ") and ", 1 of 8 done (run: "
               in line for line in lines), lines
    with heartbeat(0, stream):                            # progress_interval_s=0: none
        phase("quiet")
        time.sleep(0.1)
    assert stream.getvalue().splitlines() == lines
