"""``snapmla-cute bench sparse``: the sparse (top-k) decode at DeepSeek-V3.2-like shapes,
each row beside FlashMLA's sparse FP8 decode (timed in the same run on the same tokens and
lists where ``flash_mla`` runs here, else the anchors file's figure for this device kind; 8
or 16 heads beside FlashMLA padded to 64) and beside our dense decode over the same number
of tokens (b·s_q requests of ``topk``)."""

from __future__ import annotations

import torch

from snapmla_cute.timing import measure_copy_tbps, time_us

# (b, h, s_q, topk, s_k): random distinct indices into s_k-token requests, as an indexer gives
SPARSE_SHAPES = [
    (128, 128, 1, 2048, 8192),
    (128, 128, 2, 2048, 8192),
    (64, 64, 1, 2048, 8192),
    (64, 64, 2, 2048, 8192),
    (32, 128, 1, 16384, 32768),
    (32, 64, 1, 8192, 16384),
    (1, 128, 1, 2048, 8192),
]

# tensor-parallel serving: 8 or 16 heads per GPU, speculative windows up to 8 (``--few-heads``)
FEW_HEAD_SHAPES = [
    (64, 8, 1, 2048, 8192),
    (128, 8, 2, 2048, 8192),
    (32, 8, 1, 16384, 32768),
    (128, 16, 1, 2048, 8192),
    (64, 8, 8, 2048, 8192),
    (1, 8, 1, 2048, 8192),
]
# a few-head row's goal: 80% of its floor; batch 1 is latency, not bandwidth
FEW_HEAD_FLOOR_SHARE = 0.8
BATCH1_TARGET_US = 10.0


def padded_h64_us(kind: str | None, b, s_q, topk, s_k) -> float | None:
    """FlashMLA's sparse FP8 decode at h64 (what 8 or 16 heads padded to 64 cost) on ``kind``."""
    from snapmla_cute import anchors

    rows = anchors.FLASHMLA_SPARSE_H64_PADDED_US.get(kind, {}) if kind else {}
    return rows.get((b, s_q, topk, s_k))


def flashmla_sparse_us(kind: str | None, b, h, s_q, topk, s_k) -> float | None:
    """FlashMLA's sparse FP8 decode at this shape on ``kind`` (anchors file), if measured."""
    from snapmla_cute import anchors

    rows = anchors.FLASHMLA_SPARSE_US.get(kind, {}) if kind else {}
    return rows.get((b, h, s_q, topk, s_k))


def _dense_us(b, h, topk, page_size):
    """Our dense decode over b requests of ``topk`` tokens (s_q 1)."""
    from snapmla_cute import FP8KVCache, append_kv, decode_metadata, mla_decode, quantize_q

    pages = b * ((topk + page_size - 1) // page_size)
    cache = FP8KVCache.allocate(pages, page_size)
    kv = (torch.randn(pages * page_size, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    append_kv(cache, kv, torch.arange(pages * page_size, device="cuda"), check=False)
    bt = torch.randperm(pages, device="cuda").int().view(b, -1)
    lens = torch.full((b,), topk, dtype=torch.int32, device="cuda")
    qq = quantize_q(torch.randn(b, 1, h, 576, device="cuda").to(torch.bfloat16))
    md = decode_metadata(lens, s_q=1, heads=h)
    out, lse = mla_decode(qq, cache, bt, lens, metadata=md)
    return time_us(lambda: mla_decode(qq, cache, bt, lens, metadata=md, out=out, lse=lse, check=False))


def sparse_case_tokens(b, h, s_q, topk, s_k, page_size: int = 64):
    """``sparse_case`` and the bf16 tokens its cache was written from, ``kv_pages``
    ``[num_pages, page_size, 576]`` by slot (what FlashMLA's cache is made of, ``peers``):
    ``(kv_pages, cache, q, quantized q, indices, metadata)``."""
    from snapmla_cute import FP8KVCache, append_kv, quantize_q, sparse_decode_metadata

    pages = b * ((s_k + page_size - 1) // page_size)
    cache = FP8KVCache.allocate(pages, page_size)
    kv = (torch.randn(pages * page_size, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    slots = torch.randperm(pages * page_size, device="cuda")
    append_kv(cache, kv, slots, check=False)
    kv_pages = torch.empty_like(kv)
    kv_pages[slots] = kv
    # request i owns slots [i·s_k', (i+1)·s_k'); each query token picks topk distinct ones
    per = pages * page_size // b
    pick = torch.rand(b, s_q, per, device="cuda").argsort(dim=-1)[..., :topk]
    indices = (pick + torch.arange(b, device="cuda").view(b, 1, 1) * per).to(torch.int32).contiguous()
    q = torch.randn(b, s_q, h, 576, device="cuda").to(torch.bfloat16)
    md = sparse_decode_metadata(b, s_q, h, topk)
    return kv_pages.view(pages, page_size, 576), cache, q, quantize_q(q), indices, md


def sparse_case(b, h, s_q, topk, s_k, page_size: int = 64):
    """A bench case: a cache of b requests of ``s_k`` tokens (random content, slots shuffled),
    each query token with ``topk`` distinct random slots of its own request, as an indexer
    gives. Returns ``(cache, q, quantized q, indices, metadata)``."""
    return sparse_case_tokens(b, h, s_q, topk, s_k, page_size)[1:]


def verify_sparse(cache, q, out, indices, name: str) -> None:
    """The last query token of up to two requests against the emulation (rel-L2 ≤ 2e-3)."""
    from snapmla_cute import reference as ref
    from snapmla_cute import sparse_reference

    n, t = min(q.shape[0], 2), q.shape[1] - 1  # the last query token: its own list
    emu = sparse_reference.mla_decode_sparse_emulated(q[:n, t:], (cache.kv, cache.kv_scale), indices[:n, t:])
    err = ref.rel_l2(out[:n, t:].float(), emu[0].bfloat16().float())
    if err > 2e-3:
        raise RuntimeError(f"sparse {name}: rel-L2 {err:.2e} vs emulation")


def sparse_peer(kind, b, h, s_q, topk, s_k, us, kv_pages, q, indices, here: bool = True) -> tuple[dict, dict]:
    """FlashMLA's sparse FP8 decode beside a row (``bench.peer_columns``): timed on the row's
    data where it runs here, else the anchors'; at 64 and 128 heads as is
    (``flashmla_sparse_us``), at fewer padded to 64 (``padded_h64_us``)."""
    from snapmla_cute import peers
    from snapmla_cute.bench import peer_columns

    as_is = peers.sparse_heads(h) == h
    key = "sparse" if as_is else "sparse_h64"
    mine = peers.sparse_fp8_us(q, kv_pages, indices) if here else None
    return peer_columns(us, {key: mine}, {key: anchored_sparse_us(kind, b, h, s_q, topk, s_k)})


def anchored_sparse_us(kind: str | None, b, h, s_q, topk, s_k) -> float | None:
    """The anchors' FlashMLA sparse FP8 figure for a row: at 64 and 128 heads as is, at fewer
    padded to 64 (as the peer runs it)."""
    from snapmla_cute import peers

    if peers.sparse_heads(h) == h:
        return flashmla_sparse_us(kind, b, h, s_q, topk, s_k)
    return padded_h64_us(kind, b, s_q, topk, s_k)


def sparse_floor_us(b, h, s_q, topk, copy_tbps: float) -> float:
    """The HBM floor of a sparse call as the hardware reads it: a gathered 640-byte row is 5
    whole 128-byte lines, its fp32 scale a 32-byte sector of its own, its id 4 bytes; plus q
    (e4m3 content, bf16 RoPE, fp32 scale), out (bf16) and the LSE."""
    tokens = b * s_q * topk
    nbytes = tokens * (640 + 32 + 4) + b * s_q * h * (512 + 128 + 4 + 512 * 2 + 4)
    return nbytes / (copy_tbps * 1e6)


def bench_sparse(shapes=SPARSE_SHAPES, page_size: int = 64, verify: bool = True, dense: bool = True,
                 few_heads: bool = False, peers_here: bool = True) -> list[dict]:
    """Times ``mla_decode_sparse`` (quantized q, reused metadata, CUDA-graph replay); checks
    the last query token of up to two requests of each shape against the emulation first.
    ``few_heads``: the rows are judged against their floor and beside FlashMLA at h64 (the
    padded path) instead of beside FlashMLA at the same heads and our dense decode.
    FlashMLA is timed on the row's data where it runs here (``peers_here``), else its figure
    comes from the anchors (column ``peer_src``)."""
    from snapmla_cute import anchors, mla_decode_sparse

    kind = anchors.device_kind(torch.cuda.get_device_name())
    copy_tbps = measure_copy_tbps()
    rows = []
    for b, h, s_q, topk, s_k in shapes:
        name = f"b{b} h{h} s_q{s_q} topk{topk} of {s_k}"
        kv_pages, cache, q, qq, indices, md = sparse_case_tokens(b, h, s_q, topk, s_k, page_size)
        out, lse = mla_decode_sparse(qq, cache, indices, metadata=md)
        if verify:
            verify_sparse(cache, q, out, indices, name)
        us = time_us(lambda: mla_decode_sparse(qq, cache, indices, metadata=md, out=out, lse=lse, check=False))
        tokens = b * s_q * topk
        floor_us = sparse_floor_us(b, h, s_q, topk, copy_tbps)
        flops = 2 * (576 + 512) * h * tokens
        cols, figures = sparse_peer(kind, b, h, s_q, topk, s_k, us, kv_pages, q, indices, here=peers_here)
        if few_heads:
            target = BATCH1_TARGET_US if b == 1 else floor_us / FEW_HEAD_FLOOR_SHARE
            rows.append(dict(
                shape=name,
                us=round(us, 1),
                floor_us=round(floor_us, 1) if b > 1 else None,
                pct_floor=round(100 * floor_us / us, 1) if b > 1 else None,
                **cols,
                target_us=round(target, 1),
                met=us <= target,
            ))
            del cache, kv_pages
            continue
        fm = figures.get("sparse")
        dense_us = _dense_us(b * s_q, h, topk, page_size) if dense else None
        rows.append(dict(
            shape=name,
            us=round(us, 1),
            TFLOPS=round(flops / us / 1e6),
            floor_us=round(floor_us, 1),
            pct_floor=round(100 * floor_us / us, 1),
            **cols,
            dense_us=round(dense_us, 1) if dense_us else None,
            x_dense=round(us / dense_us, 2) if dense_us else None,
            met=bool(fm and us * 1.5 <= fm and (dense_us is None or us <= 1.15 * dense_us)),
        ))
        del cache, kv_pages
    return rows
