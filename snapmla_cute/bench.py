"""Benchmarks (commands that print tables; never assertions).

``bench_fused``: bandwidth of the fused Q-quant / K-append / fetch-dequant kernels against
the H100's measured copy bandwidth (read + write bytes per second).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

COPY_TBPS = {"H100": 3.02, "H200": 4.3}  # ../shared/anchors: measured device-to-device copy


def device_copy_tbps() -> tuple[str, float]:
    """Device name and its reference copy bandwidth from the anchors (TB/s, read + write)."""
    name = torch.cuda.get_device_name()
    for key, tbps in COPY_TBPS.items():
        if key in name:
            return name, tbps
    return name, float("nan")


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


def host_us_per_call(fn, calls: int = 200) -> float:
    """Wall time of issuing one call from Python (GPU work overlaps; the queue is drained after)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def bench_fused(tokens=(1 << 16, 1 << 20, 1 << 22), page_size: int = 64, verify: bool = True):
    """Rows: kernel, tokens, µs (CUDA-graph replay), GB/s, % of the copy bandwidth measured
    in the same run, and the host cost of one call. Inputs of 1M tokens are far larger than L2."""
    from snapmla_cute import FP8KVCache, append_kv, dequantize_kv, quantize_q
    from snapmla_cute import reference as ref

    copy_tbps = measure_copy_tbps()
    rows = []
    for n in tokens:
        h = 128
        q = (torch.randn(n // h, 1, h, 576, device="cuda") / 10).to(torch.bfloat16)
        kv = (torch.randn(n, 576, device="cuda") / 10).to(torch.bfloat16)
        pages = (n + page_size - 1) // page_size
        cache = FP8KVCache.allocate(pages, page_size)
        order = torch.randperm(pages, device="cuda")
        slots = (order[:, None] * page_size + torch.arange(page_size, device="cuda")).flatten()[:n]
        append_kv(cache, kv, slots)
        if verify:  # check before timing: a fast wrong kernel is not a result
            c, r, s = ref.quantize_rows(kv[:4096])
            assert torch.equal(cache.kv.view(-1, 640)[slots[:4096]], ref.pack_kv_rows(c, r))
            assert torch.equal(quantize_q(q[:8])[2], ref.quantize_rows(q[:8])[2])
        out = torch.empty(n, 576, dtype=torch.bfloat16, device="cuda")
        row_in, row_fp8 = 576 * 2, 512 + 128 + 4
        cases = [
            ("quantize_q", lambda: quantize_q(q, check=False), n * (row_in + row_fp8)),
            ("append_kv", lambda: append_kv(cache, kv, slots, check=False), n * (row_in + row_fp8 + 8)),
            ("dequantize_kv", lambda: dequantize_kv(cache, slots, out=out, check=False), n * (row_fp8 + 8 + row_in)),
        ]
        for name, fn, nbytes in cases:
            us = time_us(fn)
            gbps = nbytes / us / 1e3
            rows.append(
                dict(
                    kernel=name,
                    tokens=n,
                    us=round(us, 1),
                    GBps=round(gbps),
                    pct_copy=round(100 * gbps / (copy_tbps * 1e3), 1),
                    copy_TBps=round(copy_tbps, 2),
                    host_us=round(host_us_per_call(fn), 1),
                )
            )
        del q, kv, cache, out
        torch.cuda.empty_cache()
    return rows


def print_table(rows, json_path: str | None = None):
    from tabulate import tabulate

    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
