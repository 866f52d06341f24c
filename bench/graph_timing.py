"""Timing of a few kernels replayed in one CUDA graph (no launch overhead), shared by the kernel sweeps."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_graph(fn: Callable[[], object], calls: int, reps: int = 10) -> float:
    """Median microseconds per call of `fn`'s `calls` kernel calls: one warm-up run on a side stream, one capture,
    `reps` timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
