"""Public torch API of the paged FP8 decode: ``mla_decode`` (validate, plan, fetch the
compiled step, launch) and ``warmup`` (compile ahead of traffic).

Every check runs before any launch, so a bad call raises and writes nothing. Checks that
need the tensors' values (finite inputs, block-table ids, lengths) read them back to the
host; they are skipped while a CUDA graph is being captured (no host sync is allowed there)
and can be switched off with ``check=False`` on hot paths. The kernels themselves never
write outside the cache, whatever the values.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import capturing as _capturing
from snapmla_cute.checks import check_capture_ready as _check_capture_ready
from snapmla_cute.checks import check_values as _check_values
from snapmla_cute.format import CONTENT_DIM
from snapmla_cute.fused import quantize_q
from snapmla_cute.kernels import append_kv as _append_kv
from snapmla_cute.kernels import decode_scheduler as _scheduler
from snapmla_cute.kernels import dequant_kv as _dequant_kv
from snapmla_cute.kernels import quant_q as _quant_q
from snapmla_cute.kv_cache import FP8KVCache
from snapmla_cute.heads import HEAD_GROUP_HEADS, HEAD_GROUP_MIN_HEADS, HEADS
from snapmla_cute.planning import DecodeMetadata, decode_metadata
from snapmla_cute.steps import (
    HOT_DENSE,
    check_query_precision,
    check_split_capture,
    dense_call,
    hot_precision,
    is_split,
    launch_cluster,
    step_args,
)
from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute.validation import query_values, table_stats, validate_decode


def mla_decode(
    q,
    cache: FP8KVCache,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    visible: torch.Tensor | None = None,
    metadata: DecodeMetadata | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check: bool = True,
    q_precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapMLA FP8 paged decode.

    ``q``: bf16 ``[b, s_q, h, 576]`` (quantized here by the fused kernel) or the tuple
    ``(q_nope, q_rope, q_scale)`` returned by :func:`quantize_q`; in the accurate mode
    (``q_precision="e4m3x2"``, or :func:`quantize_q`'s four tensors with ``q_lo``) Q's
    content runs as hi + lo, two QK content chains on one scale, with three KV stages. ``block_table`` int32
    ``[b, max_pages]``, ``cache_seqlens`` int32 ``[b]`` (0 allowed: zero output, -inf LSE).
    With ``causal``, query token ``i`` of ``s_q`` sees keys ``< L - s_q + i + 1``, or, with
    ``visible`` (int32 ``[b, s_q]``, contiguous), keys ``< visible[b, i]``: a cache holding
    only some of a request's tokens (a context-parallel shard) whose causal limit is set by
    global positions (``snapmla_cute.distributed``). Each count is clamped to
    ``[L - s_q + i + 1, L]``: token ``i`` may hide only keys among the cache's last
    ``s_q - 1 - i`` (true of any shard of a causal window), so no value reads outside it.
    ``softmax_scale`` defaults to 576^-0.5. Returns ``out`` bf16 ``[b, s_q, h, 512]`` and
    ``lse`` fp32 ``[b, h, s_q]`` (natural log).

    ``check`` reads values back to the host in one sync: ``cache_seqlens`` in
    ``[0, decode_scheduler.MAX_SEQLEN]`` and within the block table, the table's page ids in
    the cache where a request has tokens, the query finite (skipped under CUDA-graph
    capture). ``out``/``lse`` must not share memory with each other, the query or the cache.
    Without the check the kernel clamps each length to ``[0, MAX_SEQLEN]`` (a negative one is
    an empty request). With ``check=False``, a quantized ``q`` tuple and
    ``metadata``/``out``/``lse`` given, a call is one TVM-FFI call and nothing else: the
    compiled step's argument decoder checks every tensor's dtype, shape, strides, alignment
    and device (batch sizes tied across arguments) before anything launches, and a rejected
    call is explained by the same Python checks as the other paths (same errors, nothing
    written).
    """
    if not check and metadata is not None and out is not None and lse is not None and hot_precision(q, q_precision):
        try:
            bf16_q, args = step_args(q, block_table, cache_seqlens, out, lse, cache.step_args, metadata, softmax_scale,
                                     visible)
            fn = HOT_DENSE[(metadata.heads, metadata.s_q, cache.page_size, causal, bf16_q, visible is not None,
                            launch_cluster(metadata, visible, is_split(q)), is_split(q), metadata.head_groups)]
        except (KeyError, AttributeError, TypeError):
            fn = None  # first call of this shape, or bad arguments: the full path below
        if fn is not None:
            try:
                fn(*args)
            except Exception:
                validate_decode(q, cache, block_table, cache_seqlens, softmax_scale, metadata, out, lse, causal,
                                visible)
                raise  # the Python checks found nothing: the compiled call's own error stands
            return out, lse
    b, s_q, h, q_dev = validate_decode(
        q, cache, block_table, cache_seqlens, softmax_scale, metadata, out, lse, causal, visible
    )
    check_query_precision(q, q_precision)
    if check and b and not _capturing():
        _check_values(finite=query_values(q), extra=table_stats(block_table, cache_seqlens, cache))
    _check_capture_ready("mla_decode", "decode_metadata", metadata, out, lse)
    if metadata is None:
        # the cluster choice reads the lengths: only where check already syncs
        metadata = decode_metadata(cache_seqlens, s_q=s_q, heads=h, cluster=None if check else 1)
    bf16_q = not isinstance(q, (tuple, list))
    if bf16_q and q_precision == "e4m3x2":  # the accurate mode quantizes apart (hi + lo)
        check_split_capture("mla_decode")
        q, bf16_q = quantize_q(q, check=False, precision=q_precision), False
    if bf16_q:
        if metadata.q_args is None:  # custom-op metadata has no query buffers: quantize apart
            q, bf16_q = quantize_q(q, check=False), False
        elif visible is not None:  # the visible step takes a quantized query
            q, bf16_q = quantize_q(q, check=False, out=metadata.q_args), False
    if out is None:
        out = torch.empty(b, s_q, h, CONTENT_DIM, dtype=torch.bfloat16, device=q_dev)
    if lse is None:
        lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q_dev)
    if b == 0:
        return out, lse
    fn, args = dense_call(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, causal, visible)
    fn(*args)
    return out, lse


def warmup(
    heads=HEADS, s_q=(1,), page_sizes=(64,), causal=(False, True), *, clusters=(1, 2), head_groups: bool = True,
    arch: str | None = None, progress: bool = True,
) -> int:
    """Compiles (or loads from the disk cache) every kernel a serving config needs, ahead of
    traffic: each decode step plain and in clusters of two (``clusters``; ``default_cluster``
    picks per metadata), and with ``head_groups`` at s_q 1 the head-group steps
    ``default_head_groups`` may pick (clusters of 2, 4 and 8). Returns how many kernel
    variants are ready. ``arch="sm_90a"`` works without a GPU."""
    import itertools

    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode import compile as decode_compile
    from snapmla_cute.kernels.decode.step import DecodeStepConfig

    work = [(_scheduler.compile, None)]
    work += [(_quant_q.compile_call, _quant_q.QuantQCallConfig(s, h)) for h, s in itertools.product(heads, s_q)]
    for p in page_sizes:
        work += [(_append_kv.compile_call, _append_kv.AppendKVCallConfig(p)),
                 (_dequant_kv.compile_call, _dequant_kv.DequantKVCallConfig(p))]
    steps = [(h, s, p, c, k, 1) for h, s, p, c, k in itertools.product(heads, s_q, page_sizes, causal, clusters)]
    if head_groups and 1 in s_q and "cluster" not in DECODE_TUNING:
        steps += [(h, 1, p, c, k, h // HEAD_GROUP_HEADS) for h, p, c, k in itertools.product(heads, page_sizes, causal,
                                                                                              (2, 4, 8))
                  if h >= HEAD_GROUP_MIN_HEADS]
    for h, s, p, c, k, g in steps:
        cfg = DecodeStepConfig(DecodeConfig(heads=h // g, s_q=s, page_size=p, causal=c,
                                            **{"cluster": k, **DECODE_TUNING}), g)
        work += [(decode_compile.compile_step, cfg), (decode_compile.compile_step_q, cfg)]  # quantized / bf16 query
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(work), desc="snapmla_cute warm-up", unit="kernel")
        except ImportError:
            bar = None
    for compile_fn, cfg in work:
        if cfg is None:
            compile_fn(arch=arch)
        else:
            compile_fn(cfg, arch=arch)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return len(work)
