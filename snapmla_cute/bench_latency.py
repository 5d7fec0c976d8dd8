"""``snapmla-cute bench latency``: batches of 1-8 requests, where a decode's time is latency
(the launch, the in-kernel plan, the first loads, the split merge), not bandwidth.

Dense rows: b ∈ {1, 2, 4, 8} at (h128, s_k 640), (h128, s_k 8192), (h64, s_k 8192) and
(h16, s_k 32768); sparse rows: b ∈ {1, 2, 4, 8} × h ∈ {8, 128}, topk 2048 of 8192 tokens
per request; s_q 1, page 64. Each row: our µs (CUDA-graph replay of the serving call: a
quantized q, metadata and outputs given, ``check=False``), the host µs of issuing that call,
FlashMLA beside it (dense FP8 and BF16, or sparse FP8: h128 as is, h8 padded to h64) timed in
this run on the same data where ``flash_mla`` runs here, else the anchors' figure where there
is one (``peer_src``), × = FlashMLA ÷ ours, FlashInfer's MLA decode (BF16 and FP8 KV) beside
the dense rows where it imports (its columns are absent otherwise; a sparse row says why it has
none), the HBM floor at the copy bandwidth measured in the run, and the target where one is
set (``anchors.LATENCY_TARGETS_US``, H100). Each of our rows is checked against the emulation
before it is timed.
"""

from __future__ import annotations

LATENCY_BATCHES = (1, 2, 4, 8)
LATENCY_DENSE = ((128, 640), (128, 8192), (64, 8192), (16, 32768))  # (h, s_k)
LATENCY_SPARSE_HEADS = (8, 128)
LATENCY_TOPK, LATENCY_SPARSE_SK = 2048, 8192

# every row has every column (a dense row has no sparse peer and the other way round)
COLUMNS = ("shape", "us", "host_us", "flashmla_fp8_us", "x_fp8", "flashmla_bf16_us", "x_bf16",
           "flashmla_sparse_us", "x_flashmla", "peer_heads", "peer_src", "floor_us", "pct_floor",
           "target_us", "met")


def latency_shapes() -> list[tuple]:
    """The rows: ``("dense", b, h, s_k)`` then ``("sparse", b, h, topk, s_k)``, by batch
    within each (h, s_k); these tuples are also the keys of ``anchors.LATENCY_TARGETS_US``."""
    dense = [("dense", b, h, s_k) for h, s_k in LATENCY_DENSE for b in LATENCY_BATCHES]
    sparse = [("sparse", b, h, LATENCY_TOPK, LATENCY_SPARSE_SK) for h in LATENCY_SPARSE_HEADS for b in LATENCY_BATCHES]
    return dense + sparse


def shape_name(spec: tuple) -> str:
    if spec[0] == "dense":
        _, b, h, s_k = spec
        return f"dense b{b} h{h} s_k{s_k}"
    _, b, h, topk, s_k = spec
    return f"sparse b{b} h{h} topk{topk} of {s_k}"


def peer_heads(spec: tuple) -> str | None:
    """The heads FlashMLA's sparse decode runs beside a sparse row (None for a dense row)."""
    from snapmla_cute.peers import sparse_heads

    if spec[0] != "sparse":
        return None
    h, heads = spec[2], sparse_heads(spec[2])
    return f"h{heads}" if heads == h else (f"h{heads} padded" if heads else None)


def latency_row(spec: tuple, us: float, host_us: float, floor_us: float, here: dict, anchored: dict,
                target: float | None, fi: dict | None = None) -> dict:
    """One table row from its figures (no GPU: the CPU tests build rows from made-up ones).
    ``here`` / ``anchored``: FlashMLA's µs by peer (``bf16``, ``dense_fp8`` or ``sparse``)
    timed in this run / from the anchors; ``bench.peer_columns`` picks and names them. ``fi``:
    FlashInfer's figures (``peers.flashinfer_us``), whose columns follow ``peer_src`` where
    FlashInfer ran (``bench.flashinfer_columns``); the row has exactly ``COLUMNS`` otherwise."""
    from snapmla_cute.bench import flashinfer_columns, peer_columns

    cols, _ = peer_columns(us, here, anchored)
    row = dict.fromkeys(COLUMNS)
    row.update(
        shape=shape_name(spec),
        us=round(us, 1),
        host_us=round(host_us, 1),
        **cols,
        peer_heads=peer_heads(spec),
        floor_us=round(floor_us, 1),
        pct_floor=round(100 * floor_us / us, 1),
        target_us=target,
        met=(us <= target) if target else None,
    )
    fi_cols = flashinfer_columns(us, fi or {})
    if fi_cols:
        items = list(row.items())
        at = COLUMNS.index("peer_src") + 1
        row = dict(items[:at] + list(fi_cols.items()) + items[at:])
    return row


def _dense_row(spec, kind, copy_tbps, peak, page_size, verify, peers_here):
    from snapmla_cute import anchors, peers
    from snapmla_cute.bench import decode_case, dense_floor_us, verify_decode
    from snapmla_cute.timing import host_us_per_call, time_us

    _, b, h, s_k = spec
    c = decode_case(b, h, 1, [s_k] * b, page_size)
    if verify:
        verify_decode(c, shape_name(spec))
    call = c.serving_call()
    us, host = time_us(call), host_us_per_call(call)
    here = peers.dense_us(c.q, c.kv_pages, c.block_table, c.seqlens) if peers_here else {}
    fi = peers.flashinfer_us(c.q, c.kv_pages, c.block_table, c.seqlens,
                             cache=(c.cache.kv, c.cache.kv_scale)) if peers_here else {}
    floor_us = dense_floor_us(b, h, 1, [s_k] * b, copy_tbps, peak)
    return latency_row(spec, us, host, floor_us, here, anchors.peer_us(kind, b, h, 1, s_k, False),
                       anchors.latency_target_us(kind, spec), fi)


def _sparse_row(spec, kind, copy_tbps, page_size, verify, peers_here):
    from snapmla_cute import anchors, mla_decode_sparse, peers
    from snapmla_cute.timing import host_us_per_call, time_us
    from snapmla_cute.bench_sparse import (anchored_sparse_us, sparse_case_tokens,
                                           sparse_floor_us, verify_sparse)

    _, b, h, topk, s_k = spec
    kv_pages, cache, q, qq, indices, md = sparse_case_tokens(b, h, 1, topk, s_k, page_size)
    out, lse = mla_decode_sparse(qq, cache, indices, metadata=md)
    if verify:
        verify_sparse(cache, q, out, indices, shape_name(spec))

    def step():
        return mla_decode_sparse(qq, cache, indices, metadata=md, out=out, lse=lse, check=False)

    us, host = time_us(step), host_us_per_call(step)
    here = {"sparse": peers.sparse_fp8_us(q, kv_pages, indices)} if peers_here else {}
    anchored = {"sparse": anchored_sparse_us(kind, b, h, 1, topk, s_k)}
    return latency_row(spec, us, host, sparse_floor_us(b, h, 1, topk, copy_tbps), here, anchored,
                       anchors.latency_target_us(kind, spec), peers.flashinfer_sparse() if peers_here else {})


def bench_latency(shapes=None, page_size: int = 64, verify: bool = True, peers_here: bool = True) -> list[dict]:
    """The table's rows (``latency_shapes()`` unless ``shapes``), one GPU case at a time."""
    import torch

    from snapmla_cute import anchors
    from snapmla_cute.timing import measure_copy_tbps

    kind = anchors.device_kind(torch.cuda.get_device_name())
    copy_tbps = measure_copy_tbps()
    peak = anchors.CEILINGS[kind]["mixed_fp8_tflops"] if kind else float("nan")
    rows = []
    for spec in latency_shapes() if shapes is None else shapes:
        if spec[0] == "dense":
            rows.append(_dense_row(spec, kind, copy_tbps, peak, page_size, verify, peers_here))
        else:
            rows.append(_sparse_row(spec, kind, copy_tbps, page_size, verify, peers_here))
        torch.cuda.empty_cache()
    return rows
