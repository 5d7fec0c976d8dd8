"""``snapmla-cute bench sparse``: the sparse (top-k) decode at DeepSeek-V3.2-like shapes,
each row beside FlashMLA's sparse FP8 decode on the same device kind (anchors file) and
beside our dense decode over the same number of tokens (b·s_q requests of ``topk``)."""

from __future__ import annotations

import torch

from snapmla_cute.bench import measure_copy_tbps, time_us

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


def sparse_case(b, h, s_q, topk, s_k, page_size: int = 64):
    """A bench case: a cache of b requests of ``s_k`` tokens (random content, slots shuffled),
    each query token with ``topk`` distinct random slots of its own request, as an indexer
    gives. Returns ``(cache, q, quantized q, indices, metadata)``."""
    from snapmla_cute import FP8KVCache, append_kv, quantize_q, sparse_decode_metadata

    pages = b * ((s_k + page_size - 1) // page_size)
    cache = FP8KVCache.allocate(pages, page_size)
    kv = (torch.randn(pages * page_size, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    append_kv(cache, kv, torch.randperm(pages * page_size, device="cuda"), check=False)
    # request i owns slots [i·s_k', (i+1)·s_k'); each query token picks topk distinct ones
    per = pages * page_size // b
    pick = torch.rand(b, s_q, per, device="cuda").argsort(dim=-1)[..., :topk]
    indices = (pick + torch.arange(b, device="cuda").view(b, 1, 1) * per).to(torch.int32).contiguous()
    q = torch.randn(b, s_q, h, 576, device="cuda").to(torch.bfloat16)
    return cache, q, quantize_q(q), indices, sparse_decode_metadata(b, s_q, h, topk)


def sparse_floor_us(b, h, s_q, topk, copy_tbps: float) -> float:
    """The HBM floor of a sparse call as the hardware reads it: a gathered 640-byte row is 5
    whole 128-byte lines, its fp32 scale a 32-byte sector of its own, its id 4 bytes; plus q
    (e4m3 content, bf16 RoPE, fp32 scale), out (bf16) and the LSE."""
    tokens = b * s_q * topk
    nbytes = tokens * (640 + 32 + 4) + b * s_q * h * (512 + 128 + 4 + 512 * 2 + 4)
    return nbytes / (copy_tbps * 1e6)


def bench_sparse(shapes=SPARSE_SHAPES, page_size: int = 64, verify: bool = True, dense: bool = True,
                 few_heads: bool = False) -> list[dict]:
    """Times ``mla_decode_sparse`` (quantized q, reused metadata, CUDA-graph replay); checks
    the last query token of up to two requests of each shape against the emulation first.
    ``few_heads``: the rows are judged against their floor and beside FlashMLA at h64 (the
    padded path) instead of beside FlashMLA at the same heads and our dense decode."""
    from snapmla_cute import anchors, mla_decode_sparse, sparse_reference
    from snapmla_cute import reference as ref

    kind = anchors.device_kind(torch.cuda.get_device_name())
    copy_tbps = measure_copy_tbps()
    rows = []
    for b, h, s_q, topk, s_k in shapes:
        cache, q, qq, indices, md = sparse_case(b, h, s_q, topk, s_k, page_size)
        out, lse = mla_decode_sparse(qq, cache, indices, metadata=md)
        if verify:
            n, t = min(b, 2), s_q - 1  # the last query token: its own list
            emu = sparse_reference.mla_decode_sparse_emulated(q[:n, t:], (cache.kv, cache.kv_scale), indices[:n, t:])
            err = ref.rel_l2(out[:n, t:].float(), emu[0].bfloat16().float())
            if err > 2e-3:
                raise RuntimeError(f"sparse b{b} h{h} s_q{s_q} topk{topk}: rel-L2 {err:.2e} vs emulation")
        us = time_us(lambda: mla_decode_sparse(qq, cache, indices, metadata=md, out=out, lse=lse, check=False))
        tokens = b * s_q * topk
        floor_us = sparse_floor_us(b, h, s_q, topk, copy_tbps)
        flops = 2 * (576 + 512) * h * tokens
        if few_heads:
            padded = padded_h64_us(kind, b, s_q, topk, s_k)
            target = BATCH1_TARGET_US if b == 1 else floor_us / FEW_HEAD_FLOOR_SHARE
            rows.append(dict(
                shape=f"b{b} h{h} s_q{s_q} topk{topk} of {s_k}",
                us=round(us, 1),
                floor_us=round(floor_us, 1) if b > 1 else None,
                pct_floor=round(100 * floor_us / us, 1) if b > 1 else None,
                padded_h64_us=padded,
                x_padded=round(padded / us, 2) if padded else None,
                target_us=round(target, 1),
                met=us <= target,
            ))
            del cache
            continue
        fm = flashmla_sparse_us(kind, b, h, s_q, topk, s_k)
        dense_us = _dense_us(b * s_q, h, topk, page_size) if dense else None
        rows.append(dict(
            shape=f"b{b} h{h} s_q{s_q} topk{topk} of {s_k}",
            us=round(us, 1),
            TFLOPS=round(flops / us / 1e6),
            floor_us=round(floor_us, 1),
            pct_floor=round(100 * floor_us / us, 1),
            flashmla_sparse_us=fm,
            x_flashmla=round(fm / us, 2) if fm else None,
            dense_us=round(dense_us, 1) if dense_us else None,
            x_dense=round(us / dense_us, 2) if dense_us else None,
            met=bool(fm and us * 1.5 <= fm and (dense_us is None or us <= 1.15 * dense_us)),
        ))
        del cache
    return rows
