"""Public torch API: validate inputs, fetch the compiled kernel, launch.

Every check runs before any launch, so a bad call raises and writes nothing. Checks that
need the tensors' values (finite inputs, slot ranges) read them back to the host; they are
skipped while a CUDA graph is being captured (no host sync is allowed there) and can be
switched off with ``check=False`` on hot paths. The kernels themselves never write outside
the cache, whatever the slot values.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import capturing as _capturing
from snapmla_cute.checks import check_capture_ready as _check_capture_ready
from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_disjoint as _check_disjoint
from snapmla_cute.checks import check_plan_buffers as _check_plan_buffers
from snapmla_cute.checks import check_same_device as _check_same_device
from snapmla_cute.checks import check_softmax_scale as _check_softmax_scale
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.checks import check_values as _check_values
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kernels import append_kv as _append_kv
from snapmla_cute.kernels import decode_scheduler as _scheduler
from snapmla_cute.kernels import dequant_kv as _dequant_kv
from snapmla_cute.kernels import quant_q as _quant_q
from snapmla_cute.kv_cache import FP8KVCache


_launchers: dict = {}
_hot_quant: dict = {}  # q.shape -> quantize_q's compiled call (shapes already run once)


def _launcher(compile_fn, key: tuple = (), make_config=None):
    """The compiled TVM-FFI callable of a kernel module's ``compile``, looked up once per
    ``key``; ``make_config`` builds its config on the first call (default config without it)."""
    fn = _launchers.get((compile_fn, key))
    if fn is None:
        compiled = compile_fn(make_config()) if make_config is not None else compile_fn()
        fn = _launchers[(compile_fn, key)] = compiled.fn
    return fn


def _explained(validate, get):
    """``get()``, whose attribute reads fail on a non-tensor argument (``check=False`` skips
    the checks): then ``validate`` says what was expected and what came."""
    try:
        return get()
    except AttributeError:
        validate()
        raise


def _run(compile_fn, key, make_config, args, validate):
    """One compiled call with the tensors as they are; the argument decoder (in C) checks
    dtypes, shapes, strides and devices, and a rejected call is explained by ``validate``
    (the Python checks, which raise what was expected and what came; nothing is written)."""
    try:
        fn = _launcher(compile_fn, key, make_config)
        fn(*args)
    except Exception:
        validate()
        raise  # the Python checks found nothing: the compiled call's own error stands


def _validate_quantize_q(q, out):
    _check_tensor("q", q, torch.bfloat16, dim=4, last=HEAD_DIM)
    _check_cuda(q=q)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise TypeError(f"out: expected (q_nope, q_rope, q_scale), got {type(out).__name__}"
                            + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
        lead = q.shape[:-1]
        q_nope, q_rope, q_scale = out
        _check_tensor("out[0]", q_nope, torch.float8_e4m3fn, last=CONTENT_DIM)
        _check_tensor("out[1]", q_rope, torch.bfloat16, last=ROPE_DIM)
        _check_tensor("out[2]", q_scale, torch.float32)
        if q_nope.shape[:-1] != lead or q_rope.shape[:-1] != lead or q_scale.shape != lead:
            raise ValueError(
                f"out: expected shapes {(*lead, CONTENT_DIM)}, {(*lead, ROPE_DIM)}, {tuple(lead)}, "
                f"got {tuple(q_nope.shape)}, {tuple(q_rope.shape)}, {tuple(q_scale.shape)}"
            )
        _check_cuda(q_nope=q_nope, q_rope=q_rope, q_scale=q_scale)
        _check_same_device(q=q, q_nope=q_nope, q_rope=q_rope, q_scale=q_scale)


def quantize_q(
    q: torch.Tensor, *, check: bool = True, out: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused-Q-Quant: bf16 ``q [b, s_q, h, 576]`` → the FP8 decode query, in one launch.

    Returns ``q_nope`` float8_e4m3fn ``[b, s_q, h, 512]`` (content / σ_q), ``q_rope`` bf16
    ``[b, s_q, h, 64]`` (RoPE / σ_q, Eq. 6) and ``q_scale`` fp32 ``[b, s_q, h]`` with
    σ_q = max(amax|q_content|, 1e-6) / 448 per (token, head). Bit-exact with
    ``reference.quantize_rows``. ``out`` may give the three output tensors (no allocation).
    With ``check=False`` and ``out`` given a call is one compiled call (its argument decoder
    checks every tensor; a rejection is explained by the Python checks); ``check`` also
    looks for NaN/Inf in ``q`` (one host sync).
    """
    if not check and out is not None:
        fn = _hot_quant.get(getattr(q, "shape", None))
        if fn is not None:  # a shape seen before: one compiled call, nothing else
            try:
                fn(q, *out)
            except Exception:
                _validate_quantize_q(q, out)
                raise
            return tuple(out)
    if check or out is None:
        _validate_quantize_q(q, out)
        if check:
            _check_values(finite=(("q", q),))
        if out is None:
            lead = q.shape[:-1]
            out = (
                torch.empty(*lead, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=q.device),
                torch.empty(*lead, ROPE_DIM, dtype=torch.bfloat16, device=q.device),
                torch.empty(*lead, dtype=torch.float32, device=q.device),
            )
    validate = lambda: _validate_quantize_q(q, out)  # noqa: E731
    if _explained(validate, lambda: q.numel()):
        _run(
            _quant_q.compile_call, q.shape[1:3], lambda: _quant_q.QuantQCallConfig(q.shape[1], q.shape[2]),
            (q, *out), validate,
        )
        _hot_quant[q.shape] = _launchers[(_quant_q.compile_call, q.shape[1:3])]
    return tuple(out)


def _validate_append_kv(cache, kv, slot_mapping):
    if not isinstance(cache, FP8KVCache):
        raise TypeError(f"cache: expected FP8KVCache, got {type(cache).__name__}")
    _check_tensor("kv", kv, torch.bfloat16, dim=2, last=HEAD_DIM)
    _check_tensor("slot_mapping", slot_mapping, torch.int64, dim=1)
    if slot_mapping.shape[0] != kv.shape[0]:
        raise ValueError(
            f"slot_mapping: expected {kv.shape[0]} entries (one per kv row), got {slot_mapping.shape[0]}"
        )
    _check_cuda(kv=kv, slot_mapping=slot_mapping, cache=cache.kv)
    _check_same_device(kv=kv, slot_mapping=slot_mapping, cache=cache.kv)


def append_kv(
    cache: FP8KVCache, kv: torch.Tensor, slot_mapping: torch.Tensor, *, check: bool = True
) -> None:
    """Fused-K-Append: quantize bf16 ``kv [n, 576]`` and write it to ``cache`` at ``slot_mapping``.

    ``slot_mapping`` int64 ``[n]``: slot = page * page_size + offset, ``-1`` skips the row.
    One launch writes e4m3 content, pre-divided bf16 RoPE and the fp32 scale of each token,
    bit-exact with ``reference.quantize_rows``. Two rows with the same slot race (as in
    every paged-append kernel); callers give distinct slots. ``check`` also checks the
    values (finite ``kv``, slots in range) with one host sync; with ``check=False`` a call is
    one compiled call, and a slot outside the cache is skipped by the kernel.
    """
    if check:
        _validate_append_kv(cache, kv, slot_mapping)
        _check_values(finite=(("kv", kv),), slots=(("slot_mapping", slot_mapping, cache.num_slots),))
    validate = lambda: _validate_append_kv(cache, kv, slot_mapping)  # noqa: E731
    n, ps = _explained(validate, lambda: (kv.shape[0], cache.page_size))
    if n:
        _run(
            _append_kv.compile_call, ps, lambda: _append_kv.AppendKVCallConfig(ps),
            (kv, slot_mapping, *cache.step_args), validate,
        )


def _validate_dequantize_kv(cache, slots, out):
    if not isinstance(cache, FP8KVCache):
        raise TypeError(f"cache: expected FP8KVCache, got {type(cache).__name__}")
    _check_tensor("slots", slots, torch.int64, dim=1)
    _check_cuda(slots=slots, cache=cache.kv)
    _check_same_device(slots=slots, cache=cache.kv)
    if out is not None:
        n = slots.shape[0]
        _check_tensor("out", out, torch.bfloat16, dim=2, last=HEAD_DIM)
        _check_cuda(out=out)
        if out.shape[0] != n:
            raise ValueError(f"out: expected shape ({n}, {HEAD_DIM}), got {tuple(out.shape)}")
        _check_same_device(out=out, slots=slots)


def dequantize_kv(
    cache: FP8KVCache, slots: torch.Tensor, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Fused-Fetch-Dequant: gather ``slots`` (int64 ``[n]``) and return bf16 ``[n, 576]``.

    Content: bf16(e4m3 · σ); RoPE: bf16(rope · σ) — the tokens' values back in their own
    domain, for chunked prefill or prefix caching. A slot of ``-1`` gives a zero row (so does
    any slot outside the cache with ``check=False``; ``check`` rejects it, one host sync).
    With ``check=False`` and ``out`` given a call is one compiled call.
    """
    if check or out is None:
        _validate_dequantize_kv(cache, slots, out)
        if check:
            _check_values(slots=(("slots", slots, cache.num_slots),))
        if out is None:
            out = torch.empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=slots.device)
    validate = lambda: _validate_dequantize_kv(cache, slots, out)  # noqa: E731
    n, ps = _explained(validate, lambda: (slots.shape[0], cache.page_size))
    if n:
        _run(
            _dequant_kv.compile_call, ps, lambda: _dequant_kv.DequantKVCallConfig(ps),
            (*cache.step_args, slots, out), validate,
        )
    return out


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------

HEADS = (8, 16, 32, 64, 128)  # 8: 128 heads at TP16, 64 at TP8
MAX_S_Q = 8  # speculative decoding windows up to 7 draft tokens


class DecodeMetadata:
    """Device-side split-KV work plan plus the partial-result buffers it indexes.

    Made once per (batch, s_q, heads) shape by :func:`decode_metadata`; every
    :func:`mla_decode` call that gets it re-plans into these same buffers from the current
    ``cache_seqlens`` (inside the decode kernel: no allocation, no host sync), so it is safe
    to capture in a CUDA graph and replay with new lengths.
    """

    def __init__(self, batch: int, s_q: int, heads: int, num_parts: int, device):
        rows = s_q * heads
        self.batch, self.s_q, self.heads, self.num_parts = batch, s_q, heads, num_parts
        self.cluster = 1  # parts per cluster of the launch (``decode_metadata`` may choose 2)
        self.sched = torch.zeros(num_parts, 8, dtype=torch.int32, device=device)
        self.split_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        max_splits = batch + num_parts  # each part boundary adds at most one split
        self.o_partial = torch.empty(max_splits, rows, CONTENT_DIM, dtype=torch.float32, device=device)
        self.lse_partial = torch.empty(max_splits, rows, dtype=torch.float32, device=device)
        # per (request, m-tile): splits counted, mergers done; the last merger zeroes both
        self.counters = torch.zeros(batch, 2 * ((rows + 63) // 64), dtype=torch.int32, device=device)
        # the quantized query of a bf16 q, so a captured decode allocates nothing
        self.q_nope = torch.empty(batch, s_q, heads, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=device)
        self.q_rope = torch.empty(batch, s_q, heads, ROPE_DIM, dtype=torch.bfloat16, device=device)
        self.q_scale = torch.empty(batch, s_q, heads, dtype=torch.float32, device=device)
        self._set_step_args()

    def _set_step_args(self):
        # what the decode step takes, prebuilt; split_offsets goes as its first `batch`
        # entries so TVM-FFI ties the plan to the call's batch size (the step reads all b + 1)
        self.step_args = (self.sched, self.split_offsets[: self.batch], self.o_partial, self.lse_partial, self.counters)
        self.q_args = None if self.q_nope is None else (self.q_nope, self.q_rope, self.q_scale)

    @classmethod
    def from_buffers(cls, sched, split_offsets, o_partial, lse_partial, counters, *, s_q: int, heads: int) -> "DecodeMetadata":
        """Wraps buffers made by an earlier ``decode_metadata`` (the custom-op path); checks
        their shapes against each other (the kernel writes by them)."""
        rows = s_q * heads
        batch = split_offsets.shape[0] - 1 if isinstance(split_offsets, torch.Tensor) and split_offsets.dim() == 1 else -1
        _check_plan_buffers(sched, split_offsets, o_partial, lse_partial, counters, lists=batch, rows=rows,
                            counters_shape=(batch, 2 * ((rows + 63) // 64)), max_lists=_scheduler.MAX_BATCH,
                            max_parts=_merge_max_splits())
        md = cls.__new__(cls)
        md.batch, md.s_q, md.heads, md.num_parts = batch, s_q, heads, sched.shape[0]
        md.cluster = 1  # the custom op's metadata: plain launches
        md.sched, md.split_offsets, md.o_partial, md.lse_partial = sched, split_offsets, o_partial, lse_partial
        md.counters = counters
        md.q_nope = md.q_rope = md.q_scale = None
        md._set_step_args()
        return md

    def update(self, cache_seqlens: torch.Tensor) -> None:
        """Plans into ``sched`` / ``split_offsets`` as the decode kernel will (which re-plans
        at every call and writes back the plan it ran; the cluster plan is the kernel's only)."""
        c = plan_config(self.s_q, self.heads)
        _launcher(_scheduler.compile)(cache_seqlens, self.sched, self.split_offsets, c.split_units, c.stream_parts)


_MERGE_MAX_SPLITS = []


def _merge_max_splits() -> int:
    """Splits one request may have (the in-kernel merge's room); imported on first use."""
    if not _MERGE_MAX_SPLITS:
        from snapmla_cute.kernels.decode.config import MERGE_MAX_SPLITS

        _MERGE_MAX_SPLITS.append(MERGE_MAX_SPLITS)
    return _MERGE_MAX_SPLITS[0]


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_config(s_q: int, heads: int, *, sparse: bool = False, cluster: int = 1) -> "_scheduler.SchedulerConfig":
    """The split-KV plan's constants of a decode shape (``DecodeConfig.scheduler`` under
    ``DECODE_TUNING``; ``cluster``: the launch's parts per cluster, ``metadata.cluster``):
    ``decode_scheduler.schedule_reference(lengths, parts, plan_config(...))`` is the plan the
    decode kernel runs."""
    from snapmla_cute.kernels.decode.config import DecodeConfig

    tuning = {"cluster": cluster, **{k: v for k, v in DECODE_TUNING.items() if k in ("whole_plans", "cluster")}}
    return DecodeConfig(heads=heads, s_q=1 if sparse else s_q, page_size=1 if sparse else 64, causal=False,
                        sparse=sparse, **tuning).scheduler


def default_num_parts(batch: int, m_tiles: int, num_sms: int) -> int:
    """CTAs per query tile. Up to one wave (SMs / query tiles); with at least 90% of that
    many requests, the smallest count that keeps the same requests per part (b128 on 66
    slots → 64 parts of 2 requests; b128 on 132 → 128 parts of 1) if it leaves at most 10%
    of the slots idle: equal-length batches then run unsplit, with no split partials written
    and no combine work (sparse b128 h16 topk2048 on the H100: 81.9 µs on 128 parts, 94.7
    on 132). Fewer requests split over every slot (b64 on 128 parts, two even splits
    each, is no faster than on 132)."""
    slots = max(1, num_sms // m_tiles)
    if batch < slots:
        return batch if 10 * batch >= 9 * slots else slots
    per_part = -(-batch // slots)
    even = -(-batch // per_part)
    return even if 10 * even >= 9 * slots else slots  # idle SMs cost more than splits past 10%


def decode_metadata(
    cache_seqlens: torch.Tensor, *, s_q: int, heads: int, num_parts: int | None = None, cluster: int | None = None
) -> DecodeMetadata:
    """Allocates the split-KV plan for a decode shape and fills it from ``cache_seqlens``.

    ``num_parts`` (default: :func:`default_num_parts`, at most SMs / query tiles: the decode
    launch is cooperative) is how many CTAs share the KV work of one query tile; requests
    cut by a part boundary are split, and their splits merged inside the decode kernel.
    ``cluster`` (1 or 2; default: :func:`default_cluster` from these lengths, which reads
    them to the host once, or 1 under graph capture) launches the decode in clusters of that
    many parts, so the kernel may merge a request's halves on-chip.
    """
    _check_tensor("cache_seqlens", cache_seqlens, torch.int32, dim=1)
    if isinstance(s_q, bool) or not isinstance(s_q, int) or not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"s_q: expected an int in [1, {MAX_S_Q}], got {s_q!r}")
    if heads not in HEADS:
        raise ValueError(f"heads: expected one of {HEADS}, got {heads!r}")
    if not 1 <= cache_seqlens.shape[0] <= _scheduler.MAX_BATCH:
        raise ValueError(
            f"cache_seqlens: expected a batch of 1..{_scheduler.MAX_BATCH} requests, got {cache_seqlens.shape[0]}"
        )
    _check_cuda(cache_seqlens=cache_seqlens)
    m_tiles = (s_q * heads + 63) // 64
    # one wave (the launch is cooperative), and no more splits per request than the
    # in-kernel merge has room for
    slots = max(1, min(_num_sms(cache_seqlens.device) // m_tiles, _merge_max_splits()))
    if num_parts is None:
        num_parts = default_num_parts(cache_seqlens.shape[0], m_tiles, slots * m_tiles)
    elif isinstance(num_parts, bool) or not isinstance(num_parts, int) or not 1 <= num_parts <= slots:
        # the decode launch is cooperative (split requests merge in-kernel): one wave at most
        raise ValueError(f"num_parts: expected an int in [1, {slots}] (SMs / query tiles), got {num_parts!r}")
    if cluster is not None and (cluster not in (1, 2) or num_parts % cluster):
        raise ValueError(f"cluster: expected 1 or 2 (dividing num_parts {num_parts}), got {cluster!r}")
    md = DecodeMetadata(cache_seqlens.shape[0], s_q, heads, num_parts, cache_seqlens.device)
    if cluster is not None:
        md.cluster = cluster
    elif not torch.cuda.is_current_stream_capturing():  # reads the lengths (one sync); captured: plain launches
        md.cluster = default_cluster(cache_seqlens.tolist(), num_parts, plan_config(s_q, heads, cluster=2),
                                     _num_sms(cache_seqlens.device))
    md.update(cache_seqlens)
    return md


# devices whose one wave of 2-CTA clusters was measured to fit every part (the launch is
# cooperative: a cluster that does not fit fails it). The H100 SXM and the H200 (132 SMs) take
# 66 clusters of two but not 32 of four at 128 parts (28 do).
CLUSTER_SM_COUNTS = (132,)


def default_cluster(lengths, num_parts: int, cfg, num_sms: int = 132) -> int:
    """Parts per cluster for a decode launch: 2 where the plan's rule, at these lengths (a
    graph replays the launch with others; the kernel re-plans each call and may then take
    the split or whole-request plan in the same clusters), takes the cluster plan: each
    request's halves on the two CTAs of a cluster, merged through distributed shared memory.
    Clusters of 4 and 8 are correct but gained at most 3% on the H100 and do not all fit one
    wave at 128 parts (``profiles/NOTES.md``)."""
    if num_parts % 2 or "cluster" in DECODE_TUNING or num_sms not in CLUSTER_SM_COUNTS:
        return 1
    return 2 if _scheduler.plan_of(lengths, num_parts, cfg) == _scheduler.PLAN_CLUSTER else 1


class _Tuning(dict):
    """DecodeConfig fields beyond the shape (tile/schedule choices, profiling skips). Any
    change drops the hot paths' tables of compiled steps (dense and sparse), so the next
    call recompiles."""

    def _changed(self):
        _hot_steps.clear()
        _hot_sparse.clear()

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._changed()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._changed()

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self._changed()

    def clear(self):
        super().clear()
        self._changed()

    def pop(self, *a):
        r = super().pop(*a)
        self._changed()
        return r

    def popitem(self):
        r = super().popitem()
        self._changed()
        return r

    def setdefault(self, k, default=None):
        r = super().setdefault(k, default)
        self._changed()
        return r

    def __ior__(self, other):
        self.update(other)
        return self


_hot_steps: dict = {}  # (heads, s_q, page_size, causal, bf16 q, visible, cluster) -> compiled decode step
_hot_sparse: dict = {}  # (heads, s_q, bf16 q, cluster) -> compiled sparse step (``sparse.mla_decode_sparse``)
DECODE_TUNING = _Tuning()
_LOG2E = 1.4426950408889634
_DEFAULT_SCALE_LOG2 = (576**-0.5) * _LOG2E


def _step_launcher(heads: int, s_q: int, page_size: int, causal: bool, bf16_q: bool = False, visible: bool = False,
                   cluster: int = 1):
    """The compiled step (``decode_step``, or ``decode_step_q`` which quantizes a bf16 query
    first; ``visible``: causal by given visible-key counts, quantized query only), registered
    for the hot path."""
    tuning = tuple(sorted(DECODE_TUNING.items())) if DECODE_TUNING else ()

    from snapmla_cute.kernels.decode import compile as decode_compile

    def make():
        from snapmla_cute.kernels.decode import DecodeConfig
        from snapmla_cute.kernels.decode.step import DecodeStepConfig

        extra = {"visible": True} if visible else {}
        kw = {"cluster": cluster, **DECODE_TUNING}
        if visible:
            kw["cluster"] = 1  # the context-parallel step: plain launches
        return DecodeStepConfig(DecodeConfig(heads=heads, s_q=s_q, page_size=page_size, causal=causal, **extra, **kw))

    step = decode_compile.compile_step_q if bf16_q else decode_compile.compile_step
    fn = _launcher(step, (heads, s_q, page_size, causal, tuning, cluster) + (("visible",) if visible else ()), make)
    _hot_steps[(heads, s_q, page_size, causal, bf16_q, visible, cluster)] = fn
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapMLA FP8 paged decode.

    ``q``: bf16 ``[b, s_q, h, 576]`` (quantized here by the fused kernel) or the tuple
    ``(q_nope, q_rope, q_scale)`` returned by :func:`quantize_q`. ``block_table`` int32
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
    if not check and metadata is not None and out is not None and lse is not None:
        try:
            bf16_q, args = _step_args(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, visible)
            fn = _hot_steps[(metadata.heads, metadata.s_q, cache.page_size, causal, bf16_q, visible is not None,
                             _launch_cluster(metadata, visible))]
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
    if check and b and not _capturing():
        _check_values(finite=_query_values(q), extra=_table_stats(block_table, cache_seqlens, cache))
    _check_capture_ready("mla_decode", "decode_metadata", metadata, out, lse)
    if metadata is None:
        # the cluster choice reads the lengths: only where check already syncs
        metadata = decode_metadata(cache_seqlens, s_q=s_q, heads=h, cluster=None if check else 1)
    bf16_q = not isinstance(q, (tuple, list))
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


def _query_values(q) -> tuple:
    """The query tensors whose values ``check=True`` reads (finite): a NaN or Inf in any of
    them makes every output of its row NaN."""
    if isinstance(q, (tuple, list)):
        return tuple(zip(("q_nope", "q_rope", "q_scale"), q))
    return (("q", q),)


def _table_stats(block_table, cache_seqlens, cache):
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


def _validate_query(q, cache, heads: tuple, max_s_q: int):
    """The query (bf16 tensor or quantized tuple) and cache checks shared by the dense and
    sparse decodes. Returns ``(b, s_q, h, device)``."""
    if isinstance(q, (tuple, list)):
        if len(q) != 3:
            raise ValueError(f"q: expected (q_nope, q_rope, q_scale), got {len(q)} tensors")
        q_nope, q_rope, q_scale = q
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


def _validate_outputs(out, lse, b, s_q, h, q_dev, read=None):
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


def _decode_reads(q, cache) -> dict:
    """What a decode reads while it writes ``out`` and ``lse``: the query and the cache."""
    return dict(_query_values(q), kv=cache.kv, kv_scale=cache.kv_scale)


def _validate_decode(q, cache, block_table, cache_seqlens, softmax_scale, metadata, out, lse, causal=False,
                     visible=None):
    """Every structural check of a decode call (no host sync); raises with what was expected
    and what came. Returns ``(b, s_q, h, device)``."""
    b, s_q, h, q_dev = _validate_query(q, cache, HEADS, MAX_S_Q)
    _check_softmax_scale(softmax_scale)
    _check_tensor("block_table", block_table, torch.int32, dim=2, rows_strided=True)
    _check_tensor("cache_seqlens", cache_seqlens, torch.int32, dim=1)
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(
            f"block_table/cache_seqlens: expected batch {b}, got {block_table.shape[0]} and {cache_seqlens.shape[0]}"
        )
    _check_cuda(block_table=block_table, cache_seqlens=cache_seqlens, cache=cache.kv)
    _check_same_device(q=q_dev, cache=cache.kv, block_table=block_table, cache_seqlens=cache_seqlens)
    _validate_outputs(out, lse, b, s_q, h, q_dev, _decode_reads(q, cache))
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
        _check_same_device(q=q_dev, metadata=metadata.sched)
    return b, s_q, h, q_dev


def _step_args(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, visible=None):
    """``(bf16 q?, the compiled step's arguments)``, no checks (the hot path and
    ``_step_call``). ``q`` is the quantized tuple, or a bf16 tensor that the step quantizes
    into the metadata's query buffers. Every tensor goes in its own layout: the step builds
    its views."""
    if isinstance(q, (tuple, list)):
        bf16_q, head, q_bf16 = False, tuple(q), None
    else:  # a bf16 query goes last: the step quantizes it into the metadata's buffers
        bf16_q, head, q_bf16 = True, metadata.q_args, q
    scale = _DEFAULT_SCALE_LOG2 if softmax_scale is None else softmax_scale * _LOG2E
    return bf16_q, (*head, block_table, cache_seqlens, out, lse, *cache.step_args, *metadata.step_args, scale,
                    visible, q_bf16)


def _launch_cluster(metadata, visible) -> int:
    """The step's parts per cluster, as the hot path looks it up and ``_step_call`` registers
    it: the metadata's, but plain for the context-parallel step."""
    return 1 if visible is not None else metadata.cluster


def _check_cluster_parts(metadata) -> None:
    """A clustered launch needs a part count the cluster divides (``DECODE_TUNING`` may set
    clusters of 4 or 8; the metadata's own choice always fits)."""
    k = DECODE_TUNING.get("cluster", metadata.cluster)
    if metadata.num_parts % k:
        raise ValueError(f"metadata: {metadata.num_parts} parts do not divide into clusters of {k}")


def _step_call(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, causal, visible=None):
    """The compiled decode step and its argument tuple (no checks; the bench times the bare
    call with it)."""
    bf16_q, args = _step_args(q, cache, block_table, cache_seqlens, metadata, out, lse, softmax_scale, visible)
    _, s_q, h, _ = args[0].shape
    _check_cluster_parts(metadata)
    cluster = _launch_cluster(metadata, visible)
    return _step_launcher(h, s_q, cache.page_size, bool(causal), bf16_q, visible is not None, cluster), args


def warmup(
    heads=HEADS, s_q=(1,), page_sizes=(64,), causal=(False, True), *, clusters=(1, 2), arch: str | None = None,
    progress: bool = True,
) -> int:
    """Compiles (or loads from the disk cache) every kernel a serving config needs, ahead of
    traffic: each decode step plain and in clusters of two (``clusters``; ``default_cluster``
    picks per metadata). Returns how many kernel variants are ready. ``arch="sm_90a"`` works
    without a GPU."""
    import itertools

    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode import compile as decode_compile
    from snapmla_cute.kernels.decode.step import DecodeStepConfig

    work = [(_scheduler.compile, None)]
    work += [(_quant_q.compile_call, _quant_q.QuantQCallConfig(s, h)) for h, s in itertools.product(heads, s_q)]
    for p in page_sizes:
        work += [(_append_kv.compile_call, _append_kv.AppendKVCallConfig(p)),
                 (_dequant_kv.compile_call, _dequant_kv.DequantKVCallConfig(p))]
    for h, s, p, c, k in itertools.product(heads, s_q, page_sizes, causal, clusters):
        cfg = DecodeStepConfig(DecodeConfig(heads=h, s_q=s, page_size=p, causal=c, **{"cluster": k, **DECODE_TUNING}))
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
