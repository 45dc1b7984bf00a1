"""RankProcesses.terminate from two threads at once, as it happens when a test stops an instance while the client's
reader thread sits in recv(): the killed ranks read as deaths there, and its failure path tears down too. Each pipe
must be closed once. multiprocessing's Connection.close checks its handle, os.closes it, then forgets it; here a
pause between the check and the close (what a thread switch does, rarely, in CI) makes an unserialized teardown close
one descriptor twice: EBADF (as CI saw once), or a close of whatever file took that number in between."""
from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection

import pytest

from dist_rank_fns import echo_server
from framework.dist import start

pytestmark = pytest.mark.long


def test_two_threads_terminating_at_once_close_each_pipe_once(monkeypatch):
    def close_with_a_pause(self):         # Connection.close, with the thread switch it may take after the check
        if self._handle is not None:
            time.sleep(0.02)
            try:
                self._close()
            finally:
                self._handle = None
    monkeypatch.setattr(Connection, "close", close_with_a_pause)
    instance = start(echo_server, 2, 10, backend="gloo", timeout_s=20, start_method="forkserver")
    both, errors = threading.Barrier(2), []

    def teardown():
        both.wait()
        try:
            instance.terminate()
        except Exception as e:  # noqa: BLE001 - what the test looks for
            errors.append(repr(e))
    threads = [threading.Thread(target=teardown) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert not instance.alive()
