"""bench_http's reading of the throughput target: the most CPU per request a proxy may spend and still serve a
throughput, bound by its own threads or by the cores it shares with the harness, whichever is tighter."""
from __future__ import annotations

import pytest
from script_loader import load_script

bench = load_script("experiments/bench_router/bench_http.py")


def test_a_one_thread_router_on_a_two_core_machine_is_bound_by_its_thread():
    # 10,000 req/s: one core gives 100 us a request; two cores less a 60 us harness give 140
    need, bound = bench.cpu_for_throughput(10_000, 60.0, cores=2, threads=1)
    assert need == pytest.approx(100.0) and "thread" in bound


def test_a_heavy_harness_makes_the_shared_cores_bind():
    # 2 cores less a 150 us harness leave 50 us at 10,000 req/s, below the thread's 100
    need, bound = bench.cpu_for_throughput(10_000, 150.0, cores=2, threads=1)
    assert need == pytest.approx(50.0) and "cores" in bound
    # a router on as many threads as cores is bound by the cores whatever the harness costs
    need, bound = bench.cpu_for_throughput(10_000, 10.0, cores=2, threads=2)
    assert need == pytest.approx(190.0) and "cores" in bound
