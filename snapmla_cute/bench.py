"""Benchmarks (commands that print tables; never assertions).

``bench_decode``: µs per decode step at the standard shapes, the HBM floor from the copy
bandwidth measured in the same run, and × against FlashMLA's dense FP8 and BF16 kernels
(x > 1: snapmla-cute is faster), timed in the same run on the same data where ``flash_mla``
runs here (``peers``), else this device kind's figures from ``anchors.FLASHMLA_HOPPER_US``;
with the target (the slower of best FlashMLA figure ÷ 1.3 and floor ÷ 0.85); and × against
FlashInfer's MLA decode (BF16 and FP8 KV) where ``flashinfer`` imports (no anchors for it).
``decode_case``, ``verify_decode``, ``dense_floor_us``, ``peer_columns`` and
``flashinfer_columns`` are the pieces the other benches share.

``bench_fused``: bandwidth of the fused Q-quant / K-append / fetch-dequant kernels against
the H100's measured copy bandwidth (read + write bytes per second).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's columns, in order
    rows = [{k: r.get(k) for k in keys} for r in rows]
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


@dataclass
class DecodeCase:
    """One dense bench row's data: our FP8 ``cache`` written from the bf16 tokens
    ``kv_pages`` ``[num_pages, page_size, 576]`` (slot = page · page_size + offset), pages
    shuffled in ``block_table``; the bf16 ``q``, its ``quantize_q`` tuple ``qq``, reused
    ``metadata`` and the ``out``/``lse`` buffers. The peers (``peers``) read ``kv_pages``."""

    q: torch.Tensor
    qq: tuple
    kv_pages: torch.Tensor
    cache: object
    block_table: torch.Tensor
    seqlens: torch.Tensor
    causal: bool
    metadata: object
    out: torch.Tensor
    lse: torch.Tensor

    def serving_call(self, bf16_q: bool = False, q=None):
        """The decode as a serving loop issues it (metadata and outputs given, ``check=False``):
        a function of no arguments over locals, so its host time is the call's own. ``q``: a
        quantized query of its own (the accurate mode's four tensors) instead of ``qq``."""
        from snapmla_cute import mla_decode

        q = q if q is not None else (self.q if bf16_q else self.qq)
        cache, table, lens, causal = self.cache, self.block_table, self.seqlens, self.causal
        md, out, lse = self.metadata, self.out, self.lse
        return lambda: mla_decode(q, cache, table, lens, causal=causal, metadata=md, out=out, lse=lse, check=False)


def decode_case(b: int, h: int, s_q: int, lens: list[int], page_size: int = 64, causal: bool = False) -> DecodeCase:
    """A bench row's data (``DecodeCase``): random tokens (randn/10 clamped to ±1), one
    decode run so the compiled step is loaded and the buffers filled."""
    from snapmla_cute import FP8KVCache, append_kv, decode_metadata, mla_decode, quantize_q

    pages_per = [(L + page_size - 1) // page_size for L in lens]
    total_pages = sum(pages_per)
    cache = FP8KVCache.allocate(total_pages, page_size)
    kv = (torch.randn(total_pages * page_size, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
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
    # the metadata states the longest length its calls see, as a serving engine can
    md = decode_metadata(seqlens, s_q=s_q, heads=h, max_seqlen=max(lens))
    out, lse = mla_decode(qq, cache, block_table, seqlens, causal=causal, metadata=md)
    return DecodeCase(q, qq, kv.view(total_pages, page_size, 576), cache, block_table, seqlens, causal, md, out, lse)


def verify_decode(case: DecodeCase, name: str, config=None) -> None:
    """Two requests of the case's last output against the emulation (rel-L2 ≤ 2e-3): a fast
    wrong kernel is not a result. ``config``: the emulation's format (default SnapMLA's)."""
    from snapmla_cute import emulation
    from snapmla_cute import reference as ref

    n = min(case.q.shape[0], 2)
    emu = emulation.mla_decode_emulated(case.q[:n], (case.cache.kv, case.cache.kv_scale), case.block_table[:n],
                                        case.seqlens[:n], causal=case.causal, config=config or emulation.SNAPMLA)
    err = ref.rel_l2(case.out[:n].float(), emu[0].bfloat16().float())
    if err > 2e-3:
        raise RuntimeError(f"decode {name}: rel-L2 {err:.2e} vs emulation")


def dense_work(b: int, h: int, s_q: int, lens: list[int]) -> tuple[int, int]:
    """A decode's bytes (644 per token; q, out and LSE) and FLOPs (QK over 576 dims, PV over 512)."""
    tokens = sum(lens)
    nbytes = tokens * 644 + b * s_q * h * (512 + 128 + 4 + 512 * 2 + 4)
    return nbytes, 2 * (576 + 512) * s_q * h * tokens


def dense_floor_us(b: int, h: int, s_q: int, lens: list[int], copy_tbps: float, peak_tflops: float) -> float:
    """The decode's floor: its bytes at the copy bandwidth or its FLOPs at the tensor cores'
    peak, whichever is longer."""
    nbytes, flops = dense_work(b, h, s_q, lens)
    return max(nbytes / (copy_tbps * 1e6), flops / (peak_tflops * 1e6))


# a peer's figure → its columns (µs, × ours): FlashMLA's dense FP8 and BF16, sparse FP8 at
# the same heads and at h64 (the padded path of 8 or 16 heads)
PEER_COLUMNS = {
    "dense_fp8": ("flashmla_fp8_us", "x_fp8"),
    "bf16": ("flashmla_bf16_us", "x_bf16"),
    "sparse": ("flashmla_sparse_us", "x_flashmla"),
    "sparse_h64": ("padded_h64_us", "x_padded"),
}


def peer_columns(us: float, here: dict, anchored: dict) -> tuple[dict, dict]:
    """Each peer's figure: the one timed in this run (``here``) where there is one, else the
    anchors'. Returns ``(columns, figures)``: the row's columns (µs and × = peer ÷ ours per
    ``PEER_COLUMNS``, and ``peer_src``: "here", "anchors", "mixed", or None without any
    figure) and the figures by peer (what ``anchors.target_us`` takes)."""
    figures, sources = {}, set()
    for key in [k for k in PEER_COLUMNS if k in anchored or k in here]:
        mine = here.get(key)
        figures[key] = round(mine, 1) if mine else anchored.get(key)
        if figures[key]:
            sources.add("here" if mine else "anchors")
    cols = {}
    for key, v in figures.items():
        us_col, x_col = PEER_COLUMNS[key]
        cols[us_col] = v
        cols[x_col] = round(v / us, 2) if v else None
    cols["peer_src"] = sources.pop() if len(sources) == 1 else ("mixed" if sources else None)
    return cols, figures


# FlashInfer's MLA decode (``peers.flashinfer_us``) → its columns (µs, × ours); ``fi_note``:
# why a figure is missing. No anchors: a run without FlashInfer prints none of these.
FI_COLUMNS = {"fi_fp8": ("flashinfer_fp8_us", "x_fi_fp8"), "fi_bf16": ("flashinfer_bf16_us", "x_fi_bf16")}
FI_COLUMN_NAMES = (*(c for pair in FI_COLUMNS.values() for c in pair), "fi_note")


def flashinfer_columns(us: float, fi: dict) -> dict:
    """A row's FlashInfer columns from ``peers.flashinfer_us`` (or ``flashinfer_sparse``):
    none where FlashInfer was not asked for or does not import (``fi`` empty); else each
    kind's µs and × = FlashInfer ÷ ours (x > 1: snapmla-cute is faster), None where it was not
    timed, and ``fi_note``, the one-line reason of a refusal."""
    if not fi:
        return {}
    cols = {}
    for key, (us_col, x_col) in FI_COLUMNS.items():
        v = fi.get(key)
        cols[us_col] = round(v, 1) if v else None
        cols[x_col] = round(v / us, 2) if v else None
    cols["fi_note"] = fi.get("note")
    return cols


def accurate_mode_us(case: DecodeCase, name: str, verify: bool = True) -> float:
    """The case's serving call in the accurate mode (the query as hi + lo, ``quantize_q``'s
    four tensors), checked against that mode's emulation first."""
    from snapmla_cute import emulation, quantize_q

    call = case.serving_call(q=quantize_q(case.q, precision="e4m3x2"))
    call()
    if verify:
        verify_decode(case, f"{name}, q_precision e4m3x2", config=emulation.SNAPMLA_X2)
    return time_us(call)


def bench_decode(shapes=DECODE_SHAPES, page_size: int = 64, verify: bool = True, peers_here: bool = True,
                 accurate: bool = False) -> list[dict]:
    """Times ``mla_decode`` (pre-quantized q, reused metadata, CUDA-graph replay) and the
    bf16-input path (quantize + decode); checks each shape against the emulation first.
    FlashMLA's dense FP8 and BF16 decodes are timed on the same data where ``flash_mla``
    runs here (``peers``), else their figures come from the anchors (column ``peer_src``);
    FlashInfer's MLA decode (BF16 and FP8 KV, our cache's codes) beside them where it imports
    (``flashinfer_columns``). ``accurate``: also the accurate mode's time (``accurate_mode_us``)
    and its cost."""
    from snapmla_cute import anchors, peers, steps

    name = torch.cuda.get_device_name()
    kind = anchors.device_kind(name)
    copy_tbps = measure_copy_tbps()
    peak = anchors.CEILINGS[kind]["mixed_fp8_tflops"] if kind else float("nan")
    rows = []
    for b, h, s_q, s_k, varlen in shapes:
        lens = decode_lengths(b, s_k, varlen)
        causal = s_q > 1
        shape = f"b{b} h{h} s_q{s_q} s_k{s_k}{' varlen' if varlen else ''}{' causal' if causal else ''}"
        c = decode_case(b, h, s_q, lens, page_size, causal)
        if verify:
            verify_decode(c, shape)
        call, call_bf16_q = c.serving_call(), c.serving_call(bf16_q=True)
        us, us_e2e = time_us(call), time_us(call_bf16_q)
        host, host_bf16 = host_us_per_call(call), host_us_per_call(call_bf16_q)
        step, step_args = steps.dense_call(c.qq, c.cache, c.block_table, c.seqlens, c.metadata, c.out, c.lse, None,
                                           causal)
        launch = host_us_per_call(lambda: step(*step_args))
        here = peers.dense_us(c.q, c.kv_pages, c.block_table, c.seqlens, causal=causal) if peers_here else {}
        fi = peers.flashinfer_us(c.q, c.kv_pages, c.block_table, c.seqlens, cache=(c.cache.kv, c.cache.kv_scale),
                                 causal=causal) if peers_here else {}
        floor_us = dense_floor_us(b, h, s_q, lens, copy_tbps, peak)
        nbytes, flops = dense_work(b, h, s_q, lens)
        cols, figures = peer_columns(us, here, anchors.peer_us(kind, b, h, s_q, s_k, varlen))
        target = anchors.target_us(figures, floor_us)
        extra = {}
        if accurate:
            x2 = accurate_mode_us(c, shape, verify)
            extra = dict(e4m3x2_us=round(x2, 1), e4m3x2_cost_pct=round(100 * (x2 / us - 1), 1))
        rows.append(
            dict(
                shape=shape,
                us=round(us, 1),
                TFLOPS=round(flops / us / 1e6),
                GBps=round(nbytes / us / 1e3),
                floor_us=round(floor_us, 1),
                pct_floor=round(100 * floor_us / us, 1),
                **cols,
                **flashinfer_columns(us, fi),
                target_us=target,
                meets=(us <= target) if target else None,
                e2e_bf16_q_us=round(us_e2e, 1),
                host_us=round(host, 1),
                python_us=round(host - launch, 1),
                host_bf16_q_us=round(host_bf16, 1),
                launch_us=round(launch, 1),
                **extra,
            )
        )
        del c
        torch.cuda.empty_cache()
    return rows
