"""The compiled decode steps a call runs, and the one bundle of arguments it passes them.

``step_args`` builds a dense or sparse call's ``kernels.decode.launch.StepArgs`` from its
tensors: the one place the API lists a step's arguments (``mla_decode``, ``mla_decode_sparse``
and the context-parallel decodes through them; the bench times the bare call with it).
``dense_step`` / ``sparse_step`` fetch the compiled step of a shape (compiled, or loaded from
the disk cache, on first use) and register it in the hot paths' tables (``HOT_DENSE``,
``HOT_SPARSE``), which the ``check=False`` paths look up by shape alone. The query's
precision: ``is_split``, ``hot_precision``, ``check_query_precision``, ``check_split_capture``.
"""

from __future__ import annotations

from snapmla_cute.checks import capturing
from snapmla_cute.kernels.decode.launch import StepArgs
from snapmla_cute.tuning import DECODE_TUNING, hot_table, launcher
from snapmla_cute.validation import check_precision

LOG2E = 1.4426950408889634
DEFAULT_SCALE_LOG2 = (576**-0.5) * LOG2E

# (heads, s_q, page_size, causal, bf16 q, visible, cluster, q_split, head groups) -> compiled step
HOT_DENSE = hot_table()
# (heads, s_q, bf16 q, cluster, q_split) -> compiled sparse step
HOT_SPARSE = hot_table()


def is_split(q) -> bool:
    """A quantized query in the accurate mode: ``quantize_q``'s four tensors (with q_lo)."""
    return isinstance(q, (tuple, list)) and len(q) == 4


def hot_precision(q, q_precision) -> bool:
    """Whether the hot path may take this call: no precision named, or one that agrees with
    the query's tensors (a bf16 query in the accurate mode is quantized apart, on the full
    path; anything else is explained there)."""
    if q_precision is None:
        return True
    if isinstance(q, (tuple, list)):
        return q_precision == ("e4m3x2" if len(q) == 4 else "e4m3")
    return q_precision == "e4m3"


def check_split_capture(op: str) -> None:
    """A bf16 query in the accurate mode is quantized into new tensors: not under capture."""
    if capturing():
        raise ValueError(
            f"{op}: q_precision='e4m3x2' with a bf16 query under CUDA-graph capture: pass quantize_q(q, "
            "precision='e4m3x2', out=...)'s four tensors (made before capture); nothing may be allocated inside "
            "the captured region"
        )


def check_query_precision(q, q_precision) -> None:
    """``q_precision`` names one of ``format.Q_PRECISIONS`` and, for a quantized query, the
    one its tensors are (four: e4m3x2)."""
    if q_precision is None:
        return
    split = check_precision(q_precision)
    if isinstance(q, (tuple, list)) and split != (len(q) == 4):
        raise ValueError(f"q_precision: expected {'e4m3x2' if len(q) == 4 else 'e4m3'} for a quantized query of "
                         f"{len(q)} tensors, got {q_precision!r}")


def step_args(q, table, lengths, out, lse, cache_args, metadata, softmax_scale, visible=None) -> tuple[bool, StepArgs]:
    """``(bf16 q?, the compiled step's arguments)``, no checks (the hot paths and the full
    ones). ``q``: the quantized tuple (three tensors, or four with the accurate mode's q_lo),
    or a bf16 tensor, which the step quantizes into the metadata's query buffers
    (``metadata.q_args``), which take the quantized query's place. ``table``, ``lengths``:
    the block table and lengths (dense) or the index lists and their lengths (sparse);
    ``cache_args``: the cache as the step reads it (``FP8KVCache.step_args`` or ``slot_args``);
    ``metadata.step_args``: the plan's buffers. Every tensor goes in its own layout: the step
    builds its views. The softmax scale arrives in the log2 domain."""
    scale = DEFAULT_SCALE_LOG2 if softmax_scale is None else softmax_scale * LOG2E
    if isinstance(q, (tuple, list)):
        if len(q) not in (3, 4):  # the hot path then takes the full one, whose checks say what is wrong
            raise TypeError(f"q: expected (q_nope, q_rope, q_scale[, q_lo]), got {len(q)} tensors")
        return False, StepArgs(q[0], q[1], q[2], table, lengths, out, lse, *cache_args, *metadata.step_args, scale,
                               visible, None, q[3] if len(q) > 3 else None)
    q_nope, q_rope, q_scale = metadata.q_args
    return True, StepArgs(q_nope, q_rope, q_scale, table, lengths, out, lse, *cache_args, *metadata.step_args, scale,
                          visible, q, None)


def launch_cluster(metadata, visible, q_split: bool = False) -> int:
    """The dense step's parts per cluster, as the hot path looks it up and ``dense_step``
    registers it: the metadata's, but plain for the context-parallel step and at most
    ``Q_SPLIT_MAX_CLUSTER`` in the accurate mode (whose three KV stages hold no larger
    cluster merge; the kernel's plan then leaves the extra parts idle)."""
    if visible is not None:
        return 1
    if not q_split:
        return metadata.cluster
    from snapmla_cute.kernels.decode.config import Q_SPLIT_MAX_CLUSTER

    return min(metadata.cluster, Q_SPLIT_MAX_CLUSTER)


def dense_step(heads: int, s_q: int, page_size: int, causal: bool, bf16_q: bool = False, visible: bool = False,
               cluster: int = 1, q_split: bool = False, head_groups: int = 1):
    """The compiled dense step (``decode_step``, or ``decode_step_q`` which quantizes a bf16
    query first; ``visible``: causal by given visible-key counts, quantized query only),
    registered for the hot path. ``heads`` are the call's; with ``head_groups`` g the
    kernel's requests have heads / g."""
    tuning = tuple(sorted(DECODE_TUNING.items())) if DECODE_TUNING else ()

    from snapmla_cute.kernels.decode import compile as decode_compile

    def make():
        from snapmla_cute.kernels.decode import DecodeConfig
        from snapmla_cute.kernels.decode.config import Q_SPLIT_KV_STAGES
        from snapmla_cute.kernels.decode.step import DecodeStepConfig

        extra = {"visible": True} if visible else {}
        if q_split:  # the residual's Q tile takes one KV stage's shared memory
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
    fn = launcher(step, key, make)
    HOT_DENSE[(heads, s_q, page_size, causal, bf16_q, visible, cluster, q_split, head_groups)] = fn
    return fn


def dense_call(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, causal, visible=None):
    """The compiled dense step and its ``StepArgs`` (no checks; the bench times the bare call
    with them)."""
    from snapmla_cute.planning import check_cluster_parts

    bf16_q, args = step_args(q, block_table, cache_seqlens, out, lse, cache.step_args, metadata, softmax_scale,
                             visible)
    _, s_q, h, _ = args.q_nope.shape
    check_cluster_parts(metadata)
    split = is_split(q)
    cluster = launch_cluster(metadata, visible, split)
    return dense_step(h, s_q, cache.page_size, bool(causal), bf16_q, visible is not None, cluster, split,
                      metadata.head_groups), args


def sparse_step(heads: int, s_q: int, bf16_q: bool, cluster: int = 1, q_split: bool = False):
    """The compiled sparse step (``decode_sparse``, or ``decode_sparse_q`` from a bf16 query),
    registered for the hot path."""
    from snapmla_cute.kernels.decode import compile as decode_compile

    tuning = tuple(sorted(DECODE_TUNING.items())) if DECODE_TUNING else ()

    def make():
        from snapmla_cute.kernels.decode import DecodeConfig
        from snapmla_cute.kernels.decode.config import Q_SPLIT_KV_STAGES
        from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig

        split = {"q_split": True, "kv_stages": Q_SPLIT_KV_STAGES} if q_split else {}
        cfg = DecodeConfig(heads=heads, s_q=1, page_size=1, causal=False, sparse=True,
                           **{**split, "cluster": cluster, **DECODE_TUNING})
        return DecodeSparseStepConfig(cfg, s_q)

    step = decode_compile.compile_sparse_q if bf16_q else decode_compile.compile_sparse
    fn = launcher(step, ("sparse", heads, s_q, tuning, cluster) + (("q_split",) if q_split else ()), make)
    HOT_SPARSE[(heads, s_q, bf16_q, cluster, q_split)] = fn
    return fn
