"""torch.library custom ops (namespace ``snapmla``) with fake implementations.

They let ``torch.compile(fullgraph=True)`` trace a decode step (quantize, append, decode)
without graph breaks and keep CUDA-graph capture simple: every argument is a tensor or a
plain scalar, the metadata travels as its five buffers, and no value check reads device
memory back. ``append_kv`` mutates the cache tensors; ``mla_decode`` mutates the metadata
buffers (the decode kernel rewrites the plan from ``cache_seqlens``; the split counters
return to zero). Pass the buffers of one ``decode_metadata`` / ``sparse_decode_metadata``:
their shapes are checked against each other per call, their values are not (the counters
must be zero, as those functions make them and every call leaves them). The ops run the
plain plans: a ``decode_metadata`` made with ``max_seqlen`` may take the head-group plan,
whose buffers (16 rows a kernel request) they refuse; make theirs with ``head_groups=1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snapmla_cute import decode, fused, planning
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kv_cache import FP8KVCache


@torch.library.custom_op("snapmla::quantize_q", mutates_args=())
def quantize_q(q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return fused.quantize_q(q, check=False)


def _query_like(q: Tensor, split: bool = False) -> tuple:
    """The quantized query of ``q`` as empty tensors (the fake kernels)."""
    lead = q.shape[:-1]
    return (
        q.new_empty(*lead, CONTENT_DIM, dtype=torch.float8_e4m3fn),
        q.new_empty(*lead, ROPE_DIM, dtype=torch.bfloat16),
        q.new_empty(*lead, dtype=torch.float32),
    ) + ((q.new_empty(*lead, CONTENT_DIM, dtype=torch.float8_e4m3fn),) if split else ())


@quantize_q.register_fake
def _(q):
    return _query_like(q)


@torch.library.custom_op("snapmla::quantize_q_x2", mutates_args=())
def quantize_q_x2(q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The accurate mode's query: ``quantize_q``'s three tensors and ``q_lo`` (hi + lo)."""
    return fused.quantize_q(q, check=False, precision="e4m3x2")


@quantize_q_x2.register_fake
def _(q):
    return _query_like(q, split=True)


@torch.library.custom_op("snapmla::append_kv", mutates_args=("kv", "kv_scale"))
def append_kv(kv: Tensor, kv_scale: Tensor, new_kv: Tensor, slot_mapping: Tensor) -> None:
    fused.append_kv(FP8KVCache(kv, kv_scale), new_kv, slot_mapping, check=False)


@append_kv.register_fake
def _(kv, kv_scale, new_kv, slot_mapping):
    return None


@torch.library.custom_op("snapmla::dequantize_kv", mutates_args=())
def dequantize_kv(kv: Tensor, kv_scale: Tensor, slots: Tensor) -> Tensor:
    return fused.dequantize_kv(FP8KVCache(kv, kv_scale), slots, check=False)


@dequantize_kv.register_fake
def _(kv, kv_scale, slots):
    return slots.new_empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16)


def _decode_outputs_like(q_nope: Tensor) -> tuple[Tensor, Tensor]:
    """The (out, lse) a decode of this query returns, as empty tensors (the fake kernels)."""
    b, s_q, h, _ = q_nope.shape
    return (
        q_nope.new_empty(b, s_q, h, CONTENT_DIM, dtype=torch.bfloat16),
        q_nope.new_empty(b, h, s_q, dtype=torch.float32),
    )


@torch.library.custom_op(
    "snapmla::mla_decode", mutates_args=("sched", "split_offsets", "o_partial", "lse_partial", "counters")
)
def mla_decode(
    q_nope: Tensor,
    q_rope: Tensor,
    q_scale: Tensor,
    kv: Tensor,
    kv_scale: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    sched: Tensor,
    split_offsets: Tensor,
    o_partial: Tensor,
    lse_partial: Tensor,
    counters: Tensor,
    softmax_scale: float,
    causal: bool,
    q_lo: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``decode.mla_decode`` on a metadata's buffers; ``q_lo`` (``quantize_q_x2``'s fourth
    tensor) runs the accurate mode."""
    b, s_q, h, _ = q_nope.shape
    md = planning.DecodeMetadata.from_buffers(sched, split_offsets, o_partial, lse_partial, counters, s_q=s_q, heads=h)
    return decode.mla_decode(
        (q_nope, q_rope, q_scale) + (() if q_lo is None else (q_lo,)), FP8KVCache(kv, kv_scale), block_table,
        cache_seqlens, softmax_scale=softmax_scale, causal=causal, metadata=md, check=False,
    )


@mla_decode.register_fake
def _(q_nope, q_rope, q_scale, kv, kv_scale, block_table, cache_seqlens, sched, split_offsets, o_partial, lse_partial, counters, softmax_scale, causal, q_lo=None):
    return _decode_outputs_like(q_nope)


@torch.library.custom_op(
    "snapmla::mla_decode_sparse", mutates_args=("sched", "split_offsets", "o_partial", "lse_partial", "counters")
)
def mla_decode_sparse(
    q_nope: Tensor,
    q_rope: Tensor,
    q_scale: Tensor,
    kv: Tensor,
    kv_scale: Tensor,
    indices: Tensor,
    topk_length: Tensor,
    sched: Tensor,
    split_offsets: Tensor,
    o_partial: Tensor,
    lse_partial: Tensor,
    counters: Tensor,
    softmax_scale: float,
    q_lo: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``sparse.mla_decode_sparse`` on the buffers of a ``SparseDecodeMetadata`` (its
    ``sched``, ``split_offsets``, ``o_partial``, ``lse_partial``, ``counters``); pass the
    metadata's ``full_lengths`` as ``topk_length`` for whole lists; ``q_lo``: the accurate
    mode."""
    from snapmla_cute import sparse

    md = sparse.SparseDecodeMetadata.from_buffers(
        sched, split_offsets, o_partial, lse_partial, counters, topk_length,
        s_q=q_nope.shape[1], heads=q_nope.shape[2], topk=indices.shape[-1],
    )
    return sparse.mla_decode_sparse(
        (q_nope, q_rope, q_scale) + (() if q_lo is None else (q_lo,)), FP8KVCache(kv, kv_scale), indices,
        topk_length=topk_length, softmax_scale=softmax_scale, metadata=md, check=False,
    )


@mla_decode_sparse.register_fake
def _(q_nope, q_rope, q_scale, kv, kv_scale, indices, topk_length, sched, split_offsets, o_partial, lse_partial, counters, softmax_scale, q_lo=None):
    return _decode_outputs_like(q_nope)
