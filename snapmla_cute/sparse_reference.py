"""Reference math of the sparse (top-k) decode: exact attention over each query token's index
list (float64) and the bit-faithful emulation of ``mla_decode_sparse``.

A list's entries are slot ids ``page * page_size + offset`` into the cache; only the first
``topk_length[b]`` of request b's ``topk`` entries count (all of them without
``topk_length``); -1, and ids outside the cache, are no token. A token listed twice counts
twice. A list with no token gives zero output and LSE -inf.
"""

from __future__ import annotations

import math

import torch

from snapmla_cute.emulation import SNAPMLA, decode_one, quantize_q_codes, QuantizedK
from snapmla_cute.reference import CONTENT_DIM, HEAD_DIM, default_softmax_scale, unpack_kv_rows


def sparse_lists(indices: torch.Tensor, topk_length: torch.Tensor | None, num_slots: int):
    """Per (request, query token): ``(ids [L] int64, valid [L] bool)`` for the list's first L
    entries (L = ``topk_length[b]`` clamped to [0, topk], or topk); ``valid`` marks ids in
    ``[0, num_slots)``. Invalid ids are returned as 0 (a safe gather index)."""
    b, s_q, topk = indices.shape
    lens = [topk] * b if topk_length is None else [max(0, min(topk, int(x))) for x in topk_length.tolist()]
    idx = indices.long().cpu()
    out = []
    for bi in range(b):
        row = []
        for t in range(s_q):
            ids = idx[bi, t, : lens[bi]]
            valid = (ids >= 0) & (ids < num_slots)
            row.append((torch.where(valid, ids, torch.zeros_like(ids)), valid))
        out.append(row)
    return out


def mla_decode_sparse_exact(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    indices: torch.Tensor,
    *,
    topk_length: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact sparse MLA decode in float64 on unquantized q ``[b, s_q, h, 576]`` and K pages
    ``[P, page_size, 576]``: query token (b, t) attends to the listed tokens of
    ``indices[b, t]``. Returns float64 ``out [b, s_q, h, 512]`` and ``lse [b, h, s_q]``."""
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    b, s_q, h, _ = q.shape
    k = k_pages.reshape(-1, HEAD_DIM)
    out = torch.zeros(b, s_q, h, CONTENT_DIM, dtype=torch.float64, device=q.device)
    lse = torch.full((b, h, s_q), -math.inf, dtype=torch.float64, device=q.device)
    for bi, row in enumerate(sparse_lists(indices, topk_length, k.shape[0])):
        for t, (ids, valid) in enumerate(row):
            ids = ids[valid]
            if ids.numel() == 0:
                continue
            kk = k.index_select(0, ids.to(k.device)).to(q.device, torch.float64)
            s = (q[bi, t].to(torch.float64) @ kk.T) * scale  # [h, n]
            out[bi, t] = torch.softmax(s, dim=-1) @ kk[:, :CONTENT_DIM]
            lse[bi, :, t] = torch.logsumexp(s, dim=-1)
    return out, lse


def mla_decode_sparse_emulated(
    q: torch.Tensor,
    cache,
    indices: torch.Tensor,
    *,
    topk_length: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-faithful emulation of ``mla_decode_sparse`` (``config``: ``emulation.SNAPMLA``, or
    ``emulation.SNAPMLA_X2`` for the accurate mode's query) on the FP8 cache ``(kv [P, ps, 640],
    kv_scale [P, ps])``: per query token the dense decode's Algorithm 1 over its list in
    list order, 64 entries per block (the kernel's P' blocks), an entry that is no token (or
    a slot whose scale is 0: never written) a zero row with σ_k 0 and score -inf. Returns fp32 ``out [b, s_q, h, 512]`` and ``lse [b, h, s_q]``."""
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    kv, kv_scale = cache
    kv = kv.reshape(-1, kv.shape[-1])
    kv_scale = kv_scale.reshape(-1)
    b, s_q, h, _ = q.shape
    dev = q.device
    out = torch.zeros(b, s_q, h, CONTENT_DIM, dtype=torch.float32, device=dev)
    lse = torch.full((b, h, s_q), -math.inf, dtype=torch.float32, device=dev)
    q_codes, q_scale = quantize_q_codes(q, SNAPMLA if config is None else config)
    for bi, row in enumerate(sparse_lists(indices, topk_length, kv.shape[0])):
        for t, (ids, valid) in enumerate(row):
            if ids.numel() == 0:
                continue
            content, rope = unpack_kv_rows(kv.index_select(0, ids.to(kv.device)).to(dev))
            s_k = kv_scale.index_select(0, ids.to(kv_scale.device)).to(dev).float()
            # the kernel marks a masked key by its zero-filled scale: a slot whose scale is 0
            # (never written) is no token either
            v = valid.to(dev) & (s_k > 0)
            codes = torch.where(v[:, None], torch.cat([content.float(), rope.float()], -1), 0.0)  # zero-filled
            s_k = torch.where(v, s_k, 0.0)
            kq = QuantizedK(codes, s_k, codes[:, :CONTENT_DIM], s_k)
            vis = torch.full((h,), ids.numel(), device=dev)
            o, l_ = decode_one(q_codes[bi, t], q_scale[bi, t], kq, vis, scale, "hopper", key_mask=v)
            out[bi, t] = o
            lse[bi, :, t] = l_
    return out, lse
