"""The structural checks of a decode call, shared by the dense, sparse and context-parallel
decodes: the query (bf16 or quantized), the outputs and the memory they may not share, the
whole dense call, and the block table's values (read in the call's one host sync).

Each raises with what was expected and what came; none launches or writes anything.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_disjoint as _check_disjoint
from snapmla_cute.checks import check_same_device as _check_same_device
from snapmla_cute.checks import check_softmax_scale as _check_softmax_scale
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, Q_PRECISIONS, ROPE_DIM
from snapmla_cute.kernels import decode_scheduler as _scheduler
from snapmla_cute.kv_cache import FP8KVCache
from snapmla_cute.heads import HEADS, MAX_S_Q
from snapmla_cute.planning import DecodeMetadata


def check_precision(precision) -> bool:
    """True for the accurate mode ("e4m3x2"); a clear error for anything but the two names
    (``format.Q_PRECISIONS``)."""
    if precision not in Q_PRECISIONS:
        raise ValueError(f"q_precision: expected one of {Q_PRECISIONS}, got {precision!r}")
    return precision == "e4m3x2"


def query_values(q) -> tuple:
    """The query tensors whose values ``check=True`` reads (finite): a NaN or Inf in any of
    them makes every output of its row NaN."""
    if isinstance(q, (tuple, list)):
        return tuple(zip(("q_nope", "q_rope", "q_scale", "q_lo"), q))
    return (("q", q),)


def table_stats(block_table, cache_seqlens, cache):
    """``check_values``' extra: the lengths' range and the first page id of the block table
    that a request uses and the cache does not hold, read in the check's one sync. An id
    outside the cache is read as zeros by the kernel (a key of score 0, not a masked one)."""
    b, width = block_table.shape
    ps, num_pages = cache.page_size, cache.kv.shape[0]
    lens = cache_seqlens.to(torch.int64)
    used = torch.arange(width, device=block_table.device)[None, :] < ((lens.clamp_min(0) + ps - 1) // ps)[:, None]
    bad = (used & ((block_table < 0) | (block_table >= num_pages))).reshape(-1)
    if bad.numel():
        first = bad.view(torch.uint8).argmax().view(1)  # the first bad entry (0 if none)
        # index_select, not [first]: a 0-dim index tensor would be read back (a sync)
        page = block_table.reshape(-1).index_select(0, first).to(torch.int64)
        table = torch.cat([bad.any().to(torch.int64).view(1), first, page])
    else:
        table = torch.zeros(3, dtype=torch.int64, device=lens.device)
    stats = torch.cat([torch.stack([lens.min(), lens.max()]), table])

    def check(vals):
        lo, hi, any_bad, at, page = vals
        if lo < 0:
            raise ValueError(f"cache_seqlens: expected values >= 0, got min {lo}")
        if hi > _scheduler.MAX_SEQLEN:
            raise ValueError(
                f"cache_seqlens: expected values <= {_scheduler.MAX_SEQLEN} (the longest request the plan counts), got max {hi}"
            )
        need = (hi + ps - 1) // ps
        if need > width:
            raise ValueError(f"block_table: a sequence of {hi} tokens needs {need} pages, table has {width} columns")
        if any_bad:
            raise ValueError(
                f"block_table: expected page ids in [0, {num_pages}) where a request has tokens, "
                f"got {page} at request {at // width}, column {at % width}"
            )

    return stats, check


def validate_query(q, cache, heads: tuple, max_s_q: int):
    """The query (bf16 tensor or quantized tuple) and cache checks shared by the dense and
    sparse decodes. Returns ``(b, s_q, h, device)``."""
    if isinstance(q, (tuple, list)):
        if len(q) not in (3, 4):
            raise ValueError(f"q: expected (q_nope, q_rope, q_scale) or, in the accurate mode, (q_nope, q_rope, "
                             f"q_scale, q_lo), got {len(q)} tensors")
        q_nope, q_rope, q_scale = q[:3]
        if len(q) == 4:
            _check_tensor("q_lo", q[3], torch.float8_e4m3fn, dim=4, last=CONTENT_DIM)
            if q[3].shape != q_nope.shape:
                raise ValueError(f"q_lo: expected the shape of q_nope {tuple(q_nope.shape)}, got {tuple(q[3].shape)}")
            _check_cuda(q_lo=q[3])
            _check_same_device(q_nope=q_nope, q_lo=q[3])
        _check_tensor("q_nope", q_nope, torch.float8_e4m3fn, dim=4, last=CONTENT_DIM)
        b, s_q, h, _ = q_nope.shape
        _check_tensor("q_rope", q_rope, torch.bfloat16, dim=4, last=ROPE_DIM)
        _check_tensor("q_scale", q_scale, torch.float32, dim=3)
        if q_rope.shape[:3] != q_nope.shape[:3] or q_scale.shape != q_nope.shape[:3]:
            raise ValueError(
                f"q: shapes disagree: q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)}, q_scale {tuple(q_scale.shape)}"
            )
        _check_cuda(q_nope=q_nope, q_rope=q_rope, q_scale=q_scale)
        _check_same_device(q_nope=q_nope, q_rope=q_rope, q_scale=q_scale)
        q_dev = q_nope.device
    else:
        _check_tensor("q", q, torch.bfloat16, dim=4, last=HEAD_DIM)
        _check_cuda(q=q)
        b, s_q, h, _ = q.shape
        q_dev = q.device
    if not isinstance(cache, FP8KVCache):
        raise TypeError(f"cache: expected FP8KVCache, got {type(cache).__name__}")
    if h not in heads:
        raise ValueError(f"q: expected heads in {heads}, got {h}")
    if not 1 <= s_q <= max_s_q:
        raise ValueError(f"q: expected s_q in [1, {max_s_q}], got {s_q}")
    return b, s_q, h, q_dev


def validate_outputs(out, lse, b, s_q, h, q_dev, read=None):
    """``out`` bf16 [b, s_q, h, 512] and ``lse`` fp32 [b, h, s_q] on q's device, if given, in
    memory of their own: not each other's, nor that of any tensor of ``read`` (name: tensor,
    what the call reads while it writes them)."""
    if out is not None:
        _check_tensor("out", out, torch.bfloat16, dim=4)
        if tuple(out.shape) != (b, s_q, h, CONTENT_DIM):
            raise ValueError(f"out: expected shape {(b, s_q, h, CONTENT_DIM)}, got {tuple(out.shape)}")
        _check_cuda(out=out)
        _check_same_device(q=q_dev, out=out)
    if lse is not None:
        _check_tensor("lse", lse, torch.float32, dim=3)
        if tuple(lse.shape) != (b, h, s_q):
            raise ValueError(f"lse: expected shape {(b, h, s_q)}, got {tuple(lse.shape)}")
        _check_cuda(lse=lse)
        _check_same_device(q=q_dev, lse=lse)
    if out is not None or lse is not None:
        _check_disjoint({"out": out, "lse": lse}, read or {})


def decode_reads(q, cache) -> dict:
    """What a decode reads while it writes ``out`` and ``lse``: the query and the cache."""
    return dict(query_values(q), kv=cache.kv, kv_scale=cache.kv_scale)


def validate_decode(q, cache, block_table, cache_seqlens, softmax_scale, metadata, out, lse, causal=False,
                     visible=None):
    """Every structural check of a decode call (no host sync); raises with what was expected
    and what came. Returns ``(b, s_q, h, device)``."""
    b, s_q, h, q_dev = validate_query(q, cache, HEADS, MAX_S_Q)
    _check_softmax_scale(softmax_scale)
    _check_tensor("block_table", block_table, torch.int32, dim=2, rows_strided=True)
    _check_tensor("cache_seqlens", cache_seqlens, torch.int32, dim=1)
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(
            f"block_table/cache_seqlens: expected batch {b}, got {block_table.shape[0]} and {cache_seqlens.shape[0]}"
        )
    _check_cuda(block_table=block_table, cache_seqlens=cache_seqlens, cache=cache.kv)
    _check_same_device(q=q_dev, cache=cache.kv, block_table=block_table, cache_seqlens=cache_seqlens)
    validate_outputs(out, lse, b, s_q, h, q_dev, decode_reads(q, cache))
    if visible is not None:
        if not causal:
            raise ValueError("visible: given with causal=False (it sets the causal limit of each query token)")
        _check_tensor("visible", visible, torch.int32, dim=2)
        if tuple(visible.shape) != (b, s_q):
            raise ValueError(f"visible: expected shape {(b, s_q)}, got {tuple(visible.shape)}")
        _check_cuda(visible=visible)
        _check_same_device(q=q_dev, visible=visible)
    if metadata is not None:
        if not isinstance(metadata, DecodeMetadata):
            raise TypeError(f"metadata: expected DecodeMetadata (from decode_metadata), got {type(metadata).__name__}")
        if (metadata.batch, metadata.s_q, metadata.heads) != (b, s_q, h):
            raise ValueError(
                f"metadata: made for (batch, s_q, heads) = {(metadata.batch, metadata.s_q, metadata.heads)}, got {(b, s_q, h)}"
            )
        if visible is not None and metadata.head_groups > 1:
            raise ValueError(f"metadata: made with head_groups={metadata.head_groups}; a call with visible counts takes "
                             "a plain plan (decode_metadata(..., head_groups=1))")
        _check_same_device(q=q_dev, metadata=metadata.sched)
    return b, s_q, h, q_dev
