"""The launcher: failures become one clear error, no rank outlives it, long-lived instances talk to rank 0."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dist_rank_fns import echo_server, raise_on_rank_1, sigkill_rank_1, skip_a_collective, sleep_forever
from framework.dist import PortInUse, RankFailed, launch, start
from framework.dist.rank import init_group

HERE = Path(__file__).parent
FAST = "forkserver"  # ranks forked from a server that imported torch once; the raise test uses the default (spawn)


def _rank_pids(pid_dir: Path, size: int) -> list[int]:
    return [int((pid_dir / f"rank{r}.pid").read_text()) for r in range(size)]


def _assert_all_gone(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_skipped_collective_times_out_naming_rank_collective_and_step():
    timeout_s = 2.0
    with pytest.raises(RankFailed) as info:
        launch(skip_a_collective, 2, timeout_s, backend="gloo", timeout_s=timeout_s, start_method=FAST)
    err = info.value
    assert err.rank == 1 and err.exc_type == "CollectiveTimeout"
    assert err.exc_message.startswith(f"rank 1: all_gather_uneven timed out after {timeout_s} s at step 7")
    assert "parallel.idle_batches" in err.exc_message
    elapsed = float(re.search(r"elapsed_s=([0-9.]+)", err.traceback_text).group(1))
    assert timeout_s <= elapsed < timeout_s + 1.5
    assert multiprocessing.active_children() == []


def test_a_rank_that_raises_fails_the_launch_with_its_error_and_leaves_no_process(tmp_path):
    with pytest.raises(RankFailed) as info:
        launch(raise_on_rank_1, 2, str(tmp_path), backend="gloo", timeout_s=20)
    err = info.value
    assert (err.rank, err.exc_type, err.exc_message) == (1, "ValueError", "bad token id 42 on rank 1")
    assert str(err).startswith("rank 1 failed: ValueError: bad token id 42 on rank 1")
    assert "--- traceback from rank 1 ---" in str(err) and "in raise_on_rank_1" in err.traceback_text
    _assert_all_gone(_rank_pids(tmp_path, 2))  # rank 0 was blocked in a barrier (timeout 20 s): it was stopped


def test_a_rank_killed_mid_run_is_reported_and_the_others_stopped(tmp_path):
    with pytest.raises(RankFailed) as info:
        launch(sigkill_rank_1, 2, str(tmp_path), backend="gloo", timeout_s=20, start_method=FAST)
    err = info.value
    assert err.rank == 1 and err.exc_type == "RankDied"
    assert "rank 1 exited without reporting (killed by signal SIGKILL;" in err.exc_message
    _assert_all_gone(_rank_pids(tmp_path, 2))


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port} is in use; set master_port="):
            launch(sigkill_rank_1, 2, "unused", backend="gloo", master_port=port)
        # the same error from inside a rank, when another process takes the port after the launcher's check
        with pytest.raises(PortInUse, match=f"port {port} is in use"):
            init_group(0, 1, 0, "gloo", f"tcp://127.0.0.1:{port}", timeout_s=2, startup_timeout_s=5)
    assert multiprocessing.active_children() == []


def test_a_started_instance_serves_requests_from_the_parent_then_joins():
    with start(echo_server, 2, 10, backend="gloo", timeout_s=20, start_method=FAST) as instance:
        for n in (1, 5):
            instance.send(n)
            assert instance.recv(timeout=20) == {"request": n, "total": 2 * n * 10 + 1}
        assert instance.alive()
        with pytest.raises(TimeoutError, match="no message from rank 0 within 0.2 s"):
            instance.recv(timeout=0.2)
        instance.send(None)
        assert instance.join(timeout=20) == [2, 2]  # each rank's count of served requests
    assert not instance.alive() and multiprocessing.active_children() == []


def test_a_started_instance_reports_a_rank_that_exits_abruptly():
    with start(echo_server, 2, 10, backend="gloo", timeout_s=20, start_method=FAST) as instance:
        instance.send("exit")  # rank 1 calls os._exit(3); rank 0's barrier fails next
        with pytest.raises(RankFailed, match=r"rank 1 exited without reporting \(exit code 3;") as info:
            instance.recv(timeout=20)
        assert "rank 0: CollectiveError" in str(info.value)
        with pytest.raises(RankFailed):  # the instance stays failed
            instance.send(1)
    assert not instance.alive() and multiprocessing.active_children() == []


def test_ctrl_c_in_the_parent_stops_every_rank(tmp_path):
    main_thread, test_over = threading.get_ident(), threading.Event()

    def press_ctrl_c() -> None:  # once both ranks run, deliver SIGINT to the thread blocked in launch()
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            if test_over.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.05)
        time.sleep(0.2)
        if not test_over.is_set():
            signal.pthread_kill(main_thread, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    # Ctrl-C must reach Python as KeyboardInterrupt: a shell starts a background job with SIGINT ignored, and Python
    # then installs no handler (pytest run as `... &` waited out sleep_forever's 600 s and failed: DID NOT RAISE)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(sleep_forever, 2, str(tmp_path), backend="gloo", start_method=FAST)
    finally:
        test_over.set()
        presser.join()
        signal.signal(signal.SIGINT, before)
    _assert_all_gone(_rank_pids(tmp_path, 2))


@pytest.mark.long
def test_a_rank_exits_when_its_launcher_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from dist_rank_fns import sleep_forever
        from framework.dist import launch
        launch(sleep_forever, 1, {str(tmp_path)!r}, backend="gloo", start_method="spawn")
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "rank0.pid").exists():
            assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
            time.sleep(0.05)
        time.sleep(0.2)
        rank_pid = _rank_pids(tmp_path, 1)[0]
        parent.kill()  # SIGKILL: no finally block runs in the launcher; the rank must notice by itself
        parent.wait(timeout=20)
    finally:
        parent.kill()
    deadline = time.monotonic() + 5
    while _running(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(rank_pid)


def _running(pid: int) -> bool:
    """True while pid exists and is not a zombie (an orphaned rank is reaped by init, not by this test)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow   # torchrun's rendezvous plus two interpreters: ~5 s, and load-sensitive on a shared 2-core box
def test_launch_runs_in_process_under_torchrun(tmp_path):
    script = tmp_path / "under_torchrun.py"
    script.write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        import multiprocessing, os
        from dist_rank_fns import run_every_collective
        from framework.dist import launch
        results = launch(run_every_collective, 2, backend="auto", timeout_s=20)
        assert multiprocessing.active_children() == [], "launch must not spawn under torchrun"
        print("RANK", os.environ["RANK"], "PID", os.getpid(), results[0]["counts"], results[1]["a2a_recv_counts"])
    """))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK"))
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert all(line.endswith("[0, 3] [2, 0]") for line in lines)
