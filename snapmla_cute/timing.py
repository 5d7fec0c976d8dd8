"""GPU timers shared by the benches and the peer timings: ``time_us`` (median µs of one call,
CUDA-graph replay by default), ``host_us_per_call`` (host time of issuing one call) and
``measure_copy_tbps`` (the device-to-device copy bandwidth measured now, the floor's unit)."""

from __future__ import annotations

import statistics

import torch


def measure_copy_tbps(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth measured now (read + write bytes per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), graph=False)
    del src, dst
    return 2 * nbytes / us / 1e6


def time_us(fn, *, warmup: int = 3, reps: int = 30, per_group: int = 10, graph: bool = True) -> float:
    """Median GPU time of one call in µs.

    With ``graph`` the calls are captured once in a CUDA graph of ``per_group`` calls and
    the graph is replayed, so host overhead is not counted; otherwise ``per_group`` calls
    run back to back between two events.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = None
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(g, stream=stream):
                for _ in range(per_group):
                    fn()
        torch.cuda.synchronize()
        run = g.replay
    else:
        def run():
            for _ in range(per_group):
                fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_group)
    return statistics.median(times)


def host_us_per_call(fn, calls: int = 200, groups: int = 5) -> float:
    """Wall time of issuing one call from Python (GPU work overlaps; the queue is drained
    between groups): the median over ``groups`` groups of ``calls // groups`` calls, so a
    noisy moment on the host does not set the figure."""
    import time

    fn()
    torch.cuda.synchronize()
    per = max(1, calls // groups)
    samples = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        samples.append((t1 - t0) / per * 1e6)
    return statistics.median(samples)
