"""Device time of a sequence of kernel launches, without the host around them.

On CUDA the launches are captured once into a CUDA graph and the graph's replays are timed with CUDA events, many
back to back, so neither Python's launch overhead nor the gaps between launches count, only what the GPU does.
Elsewhere (the Triton interpreter on a CPU) plain calls are timed with perf_counter: that only checks the plumbing.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def device_time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20, replays: int = 10) -> float:
    """Median over ``repeats`` of the time of one ``fn()`` in milliseconds, each sample averaged over ``replays``
    back-to-back replays. ``fn`` must be capturable: no host sync, fixed shapes (its first call, outside the
    capture, compiles whatever Triton kernels it launches)."""
    device = torch.device(device)
    fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()   # the first replay uploads the graph
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    del graph
    return statistics.median(samples)
