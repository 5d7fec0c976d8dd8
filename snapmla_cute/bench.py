"""Benchmarks (commands that print tables; never assertions).

``bench_decode``: µs per decode step at the standard shapes, the HBM floor from the copy
bandwidth measured in the same run, and × against FlashMLA's dense FP8 and BF16 kernels on
this device kind (``anchors.FLASHMLA_HOPPER_US``; x > 1: snapmla-cute is faster) with the
target (the slower of best peer ÷ 1.3 and floor ÷ 0.85).

``bench_fused``: bandwidth of the fused Q-quant / K-append / fetch-dequant kernels against
the H100's measured copy bandwidth (read + write bytes per second).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the timers live in ``timing`` (``peers`` uses them too); experiments import them from here
from snapmla_cute.timing import host_us_per_call, measure_copy_tbps, time_us  # noqa: F401


def device_copy_tbps() -> tuple[str, float]:
    """Device name and its reference copy bandwidth from the anchors (TB/s, read + write)."""
    from snapmla_cute import anchors

    name = torch.cuda.get_device_name()
    kind = anchors.device_kind(name)
    return name, anchors.CEILINGS[kind]["copy_tbps"] if kind else float("nan")


def bench_fused(tokens=(1 << 16, 1 << 20, 1 << 22), page_size: int = 64, verify: bool = True):
    """Rows: kernel, tokens, µs (CUDA-graph replay), GB/s, % of the copy bandwidth measured
    in the same run, and the host cost of one call (``check=False``, outputs given; with
    ``check=True`` add one host sync for the value checks). Inputs of 1M tokens are far
    larger than L2."""
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
        q_out = quantize_q(q)
        row_in, row_fp8 = 576 * 2, 512 + 128 + 4
        cases = [  # the serving calls: check=False, outputs given (one compiled call each)
            ("quantize_q", lambda: quantize_q(q, check=False, out=q_out), n * (row_in + row_fp8)),
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
        del q, kv, cache, out, q_out
        torch.cuda.empty_cache()
    return rows


def print_table(rows, json_path: str | None = None):
    from tabulate import tabulate

    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    keys = list(rows[0]) if rows else []
    # ratios to two places (a 10% difference must show), everything else to one
    print(tabulate(rows, headers="keys", floatfmt=[".2f" if k.startswith("x_") else ".1f" for k in keys]))


DECODE_SHAPES = [
    # (b, h, s_q, s_k, varlen): the standard decode shapes
    (128, 128, 1, 4096, False),
    (128, 128, 1, 8192, False),
    (128, 128, 1, 32768, False),
    (128, 128, 2, 8192, False),
    (32, 64, 1, 8192, False),
    (128, 128, 1, 640, False),
    (1, 128, 1, 640, False),
    (128, 128, 1, 8192, True),
    (128, 128, 1, 2048, False),
    (64, 64, 1, 2048, False),
    (128, 64, 1, 16384, False),
    (16, 16, 1, 65536, False),
    (128, 8, 1, 32768, False),  # 128 heads at TP16
    (64, 128, 8, 8192, False),  # 7 draft tokens, causal
]


def _flash_mla_us(q, kv, lens, block_table, page_size, causal, s_q) -> float | None:
    """BF16 FlashMLA on the same shape, timed in this run, when ``flash_mla`` is importable
    (it is not on the project's GPU machine: then the anchors' figures stand in)."""
    try:
        import flash_mla
    except ImportError:
        return None
    b, _, h, _ = q.shape
    k_cache = kv.view(-1, page_size, 1, 576)  # the same tokens, bf16, one KV head
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    meta, splits = flash_mla.get_mla_metadata(seqlens, s_q * h, 1)
    table = block_table
    qb = q.view(b, s_q, h, 576)
    return time_us(
        lambda: flash_mla.flash_mla_with_kvcache(qb, k_cache, table, seqlens, 512, meta, splits, causal=causal)
    )


def plot_rows(rows, path: str) -> None:
    """Ratios per shape, linear axis (a log-µs chart hides 10% differences): FlashMLA's dense
    FP8 and BF16 time ÷ ours (> 1: we are faster), the target ÷ ours (≥ 1: target met), and
    the fraction of the HBM floor reached — left out where the floor is under 10 µs (batch 1:
    launch latency, not bandwidth, bounds it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("× FlashMLA dense FP8", lambda r: r.get("x_fp8")),
        ("× FlashMLA BF16", lambda r: r.get("x_bf16")),
        ("target ÷ ours", lambda r: r["target_us"] / r["us"] if r.get("target_us") else None),
        ("fraction of HBM floor", lambda r: r["pct_floor"] / 100 if r["floor_us"] >= 10 else None),
    ]
    names = [r["shape"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    w = 0.8 / len(series)
    for i, (label, get) in enumerate(series):
        vals = [get(r) for r in rows]
        ax.bar([j + (i - (len(series) - 1) / 2) * w for j in x], [v or 0 for v in vals], w, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("ratio (> 1: snapmla-cute ahead)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def decode_lengths(b: int, s_k: int, varlen: bool, seed: int = 0) -> list[int]:
    """The bench's request lengths: all ``s_k``, or (varlen) uniform in [s_k/2, 3·s_k/2]
    from a fixed seed, so every run times the same batch."""
    if not varlen:
        return [s_k] * b
    g = torch.Generator().manual_seed(seed)
    return torch.randint(s_k // 2, s_k * 3 // 2 + 1, (b,), generator=g).tolist()


def bench_decode(shapes=DECODE_SHAPES, page_size: int = 64, verify: bool = True) -> list[dict]:
    """Times ``mla_decode`` (pre-quantized q, reused metadata, CUDA-graph replay) and the
    bf16-input path (quantize + decode); checks each shape against the emulation first."""
    from snapmla_cute import FP8KVCache, anchors, decode_metadata, emulation, mla_decode, quantize_q
    from snapmla_cute import reference as ref

    name = torch.cuda.get_device_name()
    kind = anchors.device_kind(name)
    copy_tbps = measure_copy_tbps()
    peak = anchors.CEILINGS[kind]["mixed_fp8_tflops"] if kind else float("nan")
    rows = []
    for b, h, s_q, s_k, varlen in shapes:
        lens = decode_lengths(b, s_k, varlen)
        causal = s_q > 1
        pages_per = [(L + page_size - 1) // page_size for L in lens]
        total_pages = sum(pages_per)
        cache = FP8KVCache.allocate(total_pages, page_size)
        kv = (torch.randn(total_pages * page_size, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
        from snapmla_cute import append_kv

        append_kv(cache, kv, torch.arange(total_pages * page_size, device="cuda"), check=False)
        perm = torch.randperm(total_pages, device="cuda").int()
        block_table = torch.zeros(b, max(pages_per), dtype=torch.int32, device="cuda")
        pos = 0
        for i, n in enumerate(pages_per):
            block_table[i, :n] = perm[pos : pos + n]
            pos += n
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(b, s_q, h, 576, device="cuda").to(torch.bfloat16)
        qq = quantize_q(q)
        md = decode_metadata(seqlens, s_q=s_q, heads=h)
        out, lse = mla_decode(qq, cache, block_table, seqlens, causal=causal, metadata=md)
        if verify:  # two requests against the emulation before any timing
            n_chk = min(b, 2)
            emu = emulation.mla_decode_emulated(
                q[:n_chk], (cache.kv, cache.kv_scale), block_table[:n_chk], seqlens[:n_chk], causal=causal
            )
            err = ref.rel_l2(out[:n_chk].float(), emu[0].bfloat16().float())
            if err > 2e-3:
                raise RuntimeError(f"decode b{b} h{h} s_q{s_q} s_k{s_k}: rel-L2 {err:.2e} vs emulation")
        us = time_us(lambda: mla_decode(qq, cache, block_table, seqlens, causal=causal, metadata=md, out=out, lse=lse, check=False))
        us_e2e = time_us(lambda: mla_decode(q, cache, block_table, seqlens, causal=causal, metadata=md, out=out, lse=lse, check=False))
        host = host_us_per_call(lambda: mla_decode(qq, cache, block_table, seqlens, causal=causal, metadata=md, out=out, lse=lse, check=False))
        host_bf16 = host_us_per_call(lambda: mla_decode(q, cache, block_table, seqlens, causal=causal, metadata=md, out=out, lse=lse, check=False))
        from snapmla_cute.decode import _step_call

        step, step_args = _step_call(qq, cache, block_table, seqlens, md, out, lse, None, causal)
        launch = host_us_per_call(lambda: step(*step_args))
        fm_us = _flash_mla_us(q, kv, lens, block_table, page_size, causal, s_q)
        tokens = sum(lens)
        flops = 2 * (576 + 512) * s_q * h * tokens
        nbytes = tokens * 644 + b * s_q * h * (512 + 128 + 4 + 512 * 2 + 4)
        floor_us = max(nbytes / (copy_tbps * 1e6), flops / (peak * 1e6))
        peers = anchors.peer_us(kind, b, h, s_q, s_k, varlen)
        if fm_us:  # FlashMLA BF16 timed in this run beats the anchors' figure
            peers["bf16"] = round(fm_us, 1)
        target = anchors.target_us(peers, floor_us)
        rows.append(
            dict(
                shape=f"b{b} h{h} s_q{s_q} s_k{s_k}{' varlen' if varlen else ''}{' causal' if causal else ''}",
                us=round(us, 1),
                TFLOPS=round(flops / us / 1e6),
                GBps=round(nbytes / us / 1e3),
                floor_us=round(floor_us, 1),
                pct_floor=round(100 * floor_us / us, 1),
                flashmla_fp8_us=peers["dense_fp8"],
                x_fp8=round(peers["dense_fp8"] / us, 2) if peers["dense_fp8"] else None,
                flashmla_bf16_us=peers["bf16"],
                x_bf16=round(peers["bf16"] / us, 2) if peers["bf16"] else None,
                target_us=target,
                meets=(us <= target) if target else None,
                e2e_bf16_q_us=round(us_e2e, 1),
                host_us=round(host, 1),
                python_us=round(host - launch, 1),
                host_bf16_q_us=round(host_bf16, 1),
                launch_us=round(launch, 1),
                flash_mla_here_us=round(fm_us, 1) if fm_us else None,
            )
        )
        del cache, kv
        torch.cuda.empty_cache()
    return rows
