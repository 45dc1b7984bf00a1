"""run.log keeps what a cluster's child processes print: a real child started the way the cluster starts its workers
and router (framework/cluster/processes.launch), inside a run's console_to_log, leaves its stdout and stderr lines in
run.log with its name in front; outside a run the child writes to the console only, as before."""
from __future__ import annotations

import sys
import time

from framework.cluster.processes import launch
from framework.runlog import LOG_FILE, console_to_log

CHILD = "import sys; print('ready on 8123', flush=True); print('a warning', file=sys.stderr)"


def test_a_childs_output_lands_in_run_log_with_its_name(tmp_path):
    with console_to_log(str(tmp_path)):
        print("the parent")
        popen = launch([sys.executable, "-c", CHILD], "worker 0")
        assert popen.wait(timeout=30) == 0
        for _ in range(100):        # the relay thread writes as it reads; the child's pipe closes at its exit
            text = (tmp_path / LOG_FILE).read_text()
            if "a warning" in text and "ready on" in text:
                break
            time.sleep(0.05)
    log = (tmp_path / LOG_FILE).read_text().splitlines()
    assert "the parent" in log
    assert "[worker 0] ready on 8123" in log and "[worker 0] a warning" in log


def test_outside_a_run_the_child_keeps_the_console(capfd):
    assert launch([sys.executable, "-c", CHILD], "router").wait(timeout=30) == 0
    out = capfd.readouterr()
    assert "ready on 8123" in out.out and "a warning" in out.err
