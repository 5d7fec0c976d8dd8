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
    name = torch.cuda.get_device_name()
    for key, tbps in COPY_TBPS.items():
        if key in name:
            return name, tbps
    return name, float("nan")


def time_us(fn, *, warmup: int = 5, reps: int = 50) -> float:
    """Median of per-call CUDA-event times in µs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def bench_fused(tokens=(1 << 16, 1 << 20, 1 << 22), page_size: int = 64, verify: bool = True):
    """Rows: kernel, tokens, µs, GB/s, % of copy bandwidth. Inputs are far larger than L2."""
    from snapmla_cute import FP8KVCache, append_kv, dequantize_kv, quantize_q
    from snapmla_cute import reference as ref

    _, copy_tbps = device_copy_tbps()
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
                dict(kernel=name, tokens=n, us=round(us, 1), GBps=round(gbps), pct_copy=round(100 * gbps / (copy_tbps * 1e3), 1))
            )
        del q, kv, cache, out
        torch.cuda.empty_cache()
    return rows


def print_table(rows, json_path: str | None = None):
    from tabulate import tabulate

    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
