"""Views built at trace time inside a compiled host function: a call from Python passes its
tensors as they are (no torch view objects per call, ~3 µs each on the serving hosts) and
the kernels get the shapes they index."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def view(t: cute.Tensor, shape, stride, dtype=None, byte_offset: int = 0) -> cute.Tensor:
    """``t``'s memory as ``shape`` / ``stride`` (elements of ``dtype``, default ``t``'s),
    starting ``byte_offset`` bytes in."""
    it = t.iterator
    if byte_offset:
        it = cute.recast_ptr(it, dtype=cutlass.Uint8) + byte_offset
    if dtype is not None:
        it = cute.recast_ptr(it, dtype=dtype)
    return cute.make_tensor(it, cute.make_layout(shape, stride=stride))


def cache_views(m_kv: cute.Tensor, m_kv_scale: cute.Tensor, page_size: int):
    """The cache (``kv`` uint8 ``[pages, page_size, 640]``, ``kv_scale`` fp32 ``[pages,
    page_size]``) slot-major: content bytes ``[S, 512]``, bf16 RoPE ``[S, 64]`` and the
    scales ``[S]``, S = pages · page_size."""
    from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM

    slots = m_kv.shape[0] * page_size
    return (
        view(m_kv, (slots, CONTENT_DIM), (KV_ROW_BYTES, 1)),
        view(m_kv, (slots, ROPE_DIM), (KV_ROW_BYTES // 2, 1), cutlass.BFloat16, CONTENT_DIM),
        view(m_kv_scale, (slots,), (1,)),
    )
