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
from snapmla_cute.fused import _check_precision, quantize_q
from snapmla_cute.kernels import append_kv as _append_kv
from snapmla_cute.kernels import decode_scheduler as _scheduler
from snapmla_cute.kernels import dequant_kv as _dequant_kv
from snapmla_cute.kernels import quant_q as _quant_q
from snapmla_cute.kv_cache import FP8KVCache
from snapmla_cute.planning import (
    HEAD_GROUP_HEADS,
    HEAD_GROUP_MIN_HEADS,
    HEADS,
    DecodeMetadata,
    _check_cluster_parts,
    decode_metadata,
)
from snapmla_cute.tuning import DECODE_TUNING, _hot_table, _launcher
from snapmla_cute.validation import _query_values, _table_stats, _validate_decode

_hot_steps = _hot_table()  # (heads, s_q, page_size, causal, bf16 q, visible, cluster, q_split, head groups) -> step
_LOG2E = 1.4426950408889634
_DEFAULT_SCALE_LOG2 = (576**-0.5) * _LOG2E


def _step_launcher(heads: int, s_q: int, page_size: int, causal: bool, bf16_q: bool = False, visible: bool = False,
                   cluster: int = 1, q_split: bool = False, head_groups: int = 1):
    """The compiled step (``decode_step``, or ``decode_step_q`` which quantizes a bf16 query
    first; ``visible``: causal by given visible-key counts, quantized query only), registered
    for the hot path. ``heads`` are the call's; with ``head_groups`` g the kernel's requests
    have heads / g."""
    tuning = tuple(sorted(DECODE_TUNING.items())) if DECODE_TUNING else ()

    from snapmla_cute.kernels.decode import compile as decode_compile

    def make():
        from snapmla_cute.kernels.decode import DecodeConfig
        from snapmla_cute.kernels.decode.step import DecodeStepConfig

        extra = {"visible": True} if visible else {}
        if q_split:  # the residual's Q tile takes one KV stage's shared memory
            from snapmla_cute.kernels.decode.config import Q_SPLIT_KV_STAGES

            extra.update(q_split=True, kv_stages=Q_SPLIT_KV_STAGES)
        kw = {"cluster": cluster, **DECODE_TUNING}
        if visible:
            kw["cluster"] = 1  # the context-parallel step: plain launches
        # the tuning may set kv_stages over the accurate mode's default
        return DecodeStepConfig(DecodeConfig(heads=heads // head_groups, s_q=s_q, page_size=page_size, causal=causal,
                                             **{**extra, **kw}), head_groups)

    step = decode_compile.compile_step_q if bf16_q else decode_compile.compile_step
    key = (heads, s_q, page_size, causal, tuning, cluster) + (("visible",) if visible else ()) + (
        ("q_split",) if q_split else ()) + ((("head_groups", head_groups),) if head_groups > 1 else ())
    fn = _launcher(step, key, make)
    _hot_steps[(heads, s_q, page_size, causal, bf16_q, visible, cluster, q_split, head_groups)] = fn
    return fn


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
    if not check and metadata is not None and out is not None and lse is not None and _hot_precision(q, q_precision):
        try:
            bf16_q, args = _step_args(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, visible)
            fn = _hot_steps[(metadata.heads, metadata.s_q, cache.page_size, causal, bf16_q, visible is not None,
                             _launch_cluster(metadata, visible, _is_split(q)), _is_split(q), metadata.head_groups)]
        except (KeyError, AttributeError, TypeError):
            fn = None  # first call of this shape, or bad arguments: the full path below
        if fn is not None:
            try:
                fn(*args)
            except Exception:
                _validate_decode(q, cache, block_table, cache_seqlens, softmax_scale, metadata, out, lse, causal,
                                 visible)
                raise  # the Python checks found nothing: the compiled call's own error stands
            return out, lse
    b, s_q, h, q_dev = _validate_decode(
        q, cache, block_table, cache_seqlens, softmax_scale, metadata, out, lse, causal, visible
    )
    _check_query_precision(q, q_precision)
    if check and b and not _capturing():
        _check_values(finite=_query_values(q), extra=_table_stats(block_table, cache_seqlens, cache))
    _check_capture_ready("mla_decode", "decode_metadata", metadata, out, lse)
    if metadata is None:
        # the cluster choice reads the lengths: only where check already syncs
        metadata = decode_metadata(cache_seqlens, s_q=s_q, heads=h, cluster=None if check else 1)
    bf16_q = not isinstance(q, (tuple, list))
    if bf16_q and q_precision == "e4m3x2":  # the accurate mode quantizes apart (hi + lo)
        _check_split_capture("mla_decode")
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
    fn, args = _step_call(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, causal, visible)
    fn(*args)
    return out, lse


def _is_split(q) -> bool:
    """A quantized query in the accurate mode: ``quantize_q``'s four tensors (with q_lo)."""
    return isinstance(q, (tuple, list)) and len(q) == 4


def _hot_precision(q, q_precision) -> bool:
    """Whether the hot path may take this call: no precision named, or one that agrees with
    the query's tensors (a bf16 query in the accurate mode is quantized apart, on the full
    path; anything else is explained there)."""
    if q_precision is None:
        return True
    if isinstance(q, (tuple, list)):
        return q_precision == ("e4m3x2" if len(q) == 4 else "e4m3")
    return q_precision == "e4m3"


def _check_split_capture(op: str) -> None:
    """A bf16 query in the accurate mode is quantized into new tensors: not under capture."""
    if _capturing():
        raise ValueError(
            f"{op}: q_precision='e4m3x2' with a bf16 query under CUDA-graph capture: pass quantize_q(q, "
            "precision='e4m3x2', out=...)'s four tensors (made before capture); nothing may be allocated inside "
            "the captured region"
        )


def _check_query_precision(q, q_precision) -> None:
    """``q_precision`` names one of ``format.Q_PRECISIONS`` and, for a quantized query, the
    one its tensors are (four: e4m3x2)."""
    if q_precision is None:
        return
    split = _check_precision(q_precision)
    if isinstance(q, (tuple, list)) and split != (len(q) == 4):
        raise ValueError(f"q_precision: expected {'e4m3x2' if len(q) == 4 else 'e4m3'} for a quantized query of "
                         f"{len(q)} tensors, got {q_precision!r}")


def _step_query(q, metadata, softmax_scale) -> tuple:
    """What a step call (dense or sparse) takes for its query: ``(bf16 q?, the quantized
    query's three tensors, the bf16 query or None, the softmax scale in the log2 domain)``.
    A bf16 query goes last: the step quantizes it into the metadata's query buffers, which
    take the quantized query's place."""
    scale = _DEFAULT_SCALE_LOG2 if softmax_scale is None else softmax_scale * _LOG2E
    if isinstance(q, (tuple, list)):
        return False, tuple(q), None, scale
    return True, metadata.q_args, q, scale


def _step_args(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, visible=None):
    """``(bf16 q?, the compiled step's arguments)``, no checks (the hot path and
    ``_step_call``). ``q`` is the quantized tuple, or a bf16 tensor (``_step_query``). Every
    tensor goes in its own layout: the step builds its views; the step's three optional
    tensors, ``visible``, the bf16 query and ``q_lo``, are always passed (None where absent)."""
    bf16_q, head, q_bf16, scale = _step_query(q, metadata, softmax_scale)
    args = (*head[:3], block_table, cache_seqlens, out, lse, *cache.step_args, *metadata.step_args, scale, visible, q_bf16)
    # the accurate mode's q_lo last, None otherwise: a compiled call takes every optional tensor
    return bf16_q, args + (head[3] if len(head) > 3 else None,)


def _launch_cluster(metadata, visible, q_split: bool = False) -> int:
    """The step's parts per cluster, as the hot path looks it up and ``_step_call`` registers
    it: the metadata's, but plain for the context-parallel step and at most
    ``Q_SPLIT_MAX_CLUSTER`` in the accurate mode (whose three KV stages hold no larger
    cluster merge; the kernel's plan then leaves the extra parts idle)."""
    if visible is not None:
        return 1
    if not q_split:
        return metadata.cluster
    from snapmla_cute.kernels.decode.config import Q_SPLIT_MAX_CLUSTER  # in sys.modules after the first call

    return min(metadata.cluster, Q_SPLIT_MAX_CLUSTER)


def _step_call(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, causal, visible=None):
    """The compiled decode step and its argument tuple (no checks; the bench times the bare
    call with it)."""
    bf16_q, args = _step_args(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, visible)
    _, s_q, h, _ = args[0].shape
    _check_cluster_parts(metadata)
    q_split = _is_split(q)
    cluster = _launch_cluster(metadata, visible, q_split)
    return _step_launcher(h, s_q, cache.page_size, bool(causal), bf16_q, visible is not None, cluster, q_split,
                          metadata.head_groups), args


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
