"""The sparse (top-k) FP8 decode: each query token attends to its own list of cache slots.

DeepSeek-V3.2's indexed attention (DSA) picks, per query token, ``topk`` tokens of the
request's cache; the decode reads them from the FP8 cache by slot id and runs SnapMLA's math
over them (FP8 QK content + BF16 RoPE on one accumulator, V scale fused into P, block-wise
P quantization). The kernel is the dense decode's (``kernels.decode``, ``sparse=True``):
every (request, query token) is one kernel request whose list is its "block table" of
one-token pages, gathered with cp.async into the Swizzle-128B tiles; split-KV over the lists and the merge are
the dense decode's, in the same launch.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import check_capture_ready as _check_capture_ready
from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_plan_buffers as _check_plan_buffers
from snapmla_cute.checks import check_same_device as _check_same_device
from snapmla_cute.checks import check_softmax_scale as _check_softmax_scale
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.checks import check_values as _check_values
from snapmla_cute.fused import quantize_q
from snapmla_cute.format import CONTENT_DIM, ROPE_DIM
from snapmla_cute.kernels.decode_scheduler import MAX_BATCH as _MAX_BATCH
from snapmla_cute.kernels.decode_scheduler import MAX_SEQLEN as _MAX_SEQLEN
from snapmla_cute.heads import SPARSE_HEADS, SPARSE_MAX_S_Q
from snapmla_cute.heads import m_tiles as query_tiles
from snapmla_cute.kv_cache import FP8KVCache
from snapmla_cute.planning import (
    check_cluster_parts,
    merge_max_splits,
    device_sms,
    default_cluster,
    default_num_parts,
    plan_config,
)
from snapmla_cute.steps import (
    HOT_SPARSE,
    check_query_precision,
    check_split_capture,
    hot_precision,
    is_split,
    sparse_step,
    step_args,
)
from snapmla_cute.validation import decode_reads, query_values, validate_outputs, validate_query



class SparseDecodeMetadata:
    """The split-KV plan buffers of a sparse decode shape (batch, s_q, heads), and the
    lengths ``topk`` used when a call gives no ``topk_length``. Made once, outside any CUDA
    graph, by :func:`sparse_decode_metadata`; every call re-plans into the same buffers
    inside the kernel, so a captured call replays with new indices and lengths."""

    def __init__(self, batch: int, s_q: int, heads: int, topk: int, num_parts: int, device):
        n = batch * s_q
        m_tiles = query_tiles(heads)
        self.batch, self.s_q, self.heads, self.topk, self.num_parts = batch, s_q, heads, topk, num_parts
        self.cluster = 1  # parts per cluster of the launch (``sparse_decode_metadata`` may choose 2)
        self.sched = torch.zeros(num_parts, 8, dtype=torch.int32, device=device)
        self.split_offsets = torch.zeros(n + 1, dtype=torch.int32, device=device)
        max_splits = n + num_parts
        self.o_partial = torch.empty(max_splits, heads, CONTENT_DIM, dtype=torch.float32, device=device)
        self.lse_partial = torch.empty(max_splits, heads, dtype=torch.float32, device=device)
        self.counters = torch.zeros(batch, s_q, 2 * m_tiles, dtype=torch.int32, device=device)
        self.full_lengths = torch.full((batch,), topk, dtype=torch.int32, device=device)
        self.q_args = (
            torch.empty(batch, s_q, heads, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(batch, s_q, heads, ROPE_DIM, dtype=torch.bfloat16, device=device),
            torch.empty(batch, s_q, heads, dtype=torch.float32, device=device),
        )
        self._set_step_args()

    def _set_step_args(self):
        # the step's metadata arguments: split_offsets' first b·s_q entries as [b, s_q], so
        # the compiled call ties the plan to the call's batch
        n = self.batch * self.s_q
        self.step_args = (self.sched, self.split_offsets[:n].view(self.batch, self.s_q), self.o_partial,
                          self.lse_partial, self.counters)

    @classmethod
    def from_buffers(cls, sched, split_offsets, o_partial, lse_partial, counters, full_lengths, *, s_q: int,
                     heads: int, topk: int) -> "SparseDecodeMetadata":
        """Wraps buffers made by an earlier ``sparse_decode_metadata`` (the custom-op path);
        ``full_lengths`` stands for the lengths of a call without ``topk_length``. Checks the
        buffers' shapes against each other (the kernel writes by them)."""
        if not 1 <= s_q <= SPARSE_MAX_S_Q:
            raise ValueError(f"s_q: expected an int in [1, {SPARSE_MAX_S_Q}], got {s_q!r}")
        lists = split_offsets.shape[0] - 1 if isinstance(split_offsets, torch.Tensor) and split_offsets.dim() == 1 else -1
        batch = lists // s_q if lists % s_q == 0 else -1
        _check_plan_buffers(sched, split_offsets, o_partial, lse_partial, counters, lists=batch * s_q, rows=heads,
                            counters_shape=(batch, s_q, 2 * query_tiles(heads)), max_lists=_MAX_BATCH,
                            max_parts=merge_max_splits())
        md = cls.__new__(cls)
        md.batch, md.s_q, md.heads, md.topk = batch, s_q, heads, topk
        md.num_parts = sched.shape[0]
        md.cluster = 1  # the custom op's metadata: plain launches
        md.sched, md.split_offsets, md.o_partial, md.lse_partial = sched, split_offsets, o_partial, lse_partial
        md.counters, md.full_lengths, md.q_args = counters, full_lengths, None
        md._set_step_args()
        return md


def sparse_decode_metadata(
    batch: int, s_q: int, heads: int, topk: int, *, device=None, num_parts: int | None = None
) -> SparseDecodeMetadata:
    """The plan buffers for ``mla_decode_sparse`` at (batch, s_q, heads) with index lists of
    ``topk`` entries. ``num_parts`` CTAs per 64-head tile share the lists' blocks (default:
    the dense decode's rule over batch·s_q lists; at most SMs / tiles, the launch is
    cooperative)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    for name, v, lo, hi in (("batch", batch, 1, _MAX_BATCH // max(1, s_q)), ("s_q", s_q, 1, SPARSE_MAX_S_Q),
                            ("topk", topk, 1, _MAX_SEQLEN)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v!r}")
    if heads not in SPARSE_HEADS:
        raise ValueError(f"heads: expected one of {SPARSE_HEADS}, got {heads!r}")
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    m_tiles = query_tiles(heads)
    slots = max(1, min(device_sms(device) // m_tiles, merge_max_splits()))
    if num_parts is None:
        num_parts = default_num_parts(batch * s_q, m_tiles, slots * m_tiles)
    elif isinstance(num_parts, bool) or not isinstance(num_parts, int) or not 1 <= num_parts <= slots:
        raise ValueError(f"num_parts: expected an int in [1, {slots}] (SMs / query tiles), got {num_parts!r}")
    md = SparseDecodeMetadata(batch, s_q, heads, topk, num_parts, device)
    md.cluster = default_cluster([topk] * (batch * s_q), num_parts, plan_config(1, heads, sparse=True, cluster=2),
                                 device_sms(device))
    return md


def mla_decode_sparse(
    q,
    cache: FP8KVCache,
    indices: torch.Tensor,
    *,
    topk_length: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    metadata: SparseDecodeMetadata | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check: bool = True,
    q_precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapMLA FP8 sparse decode: query token t of request b attends to the cache slots
    ``indices[b, t, :topk_length[b]]`` (all ``topk`` of them without ``topk_length``).

    ``q``: bf16 ``[b, s_q, h, 576]`` or the ``quantize_q`` tuple (four tensors, or
    ``q_precision="e4m3x2"`` for a bf16 query: the accurate mode, as ``mla_decode``); h in ``SPARSE_HEADS``,
    s_q 1..``SPARSE_MAX_S_Q``. ``indices`` int32 ``[b, s_q, topk]`` (contiguous) of slot ids
    ``page * page_size + offset``; -1 is no token; a slot listed twice counts twice.
    ``topk_length`` int32 ``[b]``. Returns ``out`` bf16 ``[b, s_q, h, 512]`` and ``lse`` fp32
    ``[b, h, s_q]`` (natural log); a list with no token gives zeros and -inf.

    ``check`` also reads the values back once (a sync): ids in [-1, num_slots),
    ``topk_length`` in [0, topk], the query finite. With ``check=False`` nothing is read
    back: an id outside the cache (or < -1) is no token, a length past ``topk`` counts
    ``topk`` (its masked blocks still cost time); no access leaves the cache or the lists. A
    negative length is an empty list (the kernel clamps lengths to ``[0, MAX_SEQLEN]``). With
    ``check=False``, ``metadata``, ``out`` and ``lse`` given, a call is one compiled call
    (its argument decoder checks every tensor).
    """
    if not check and metadata is not None and out is not None and lse is not None and hot_precision(q, q_precision):
        try:
            lengths = metadata.full_lengths if topk_length is None else topk_length
            bf16_q, args = step_args(q, indices, lengths, out, lse, cache.slot_args, metadata, softmax_scale)
            fn = HOT_SPARSE[(metadata.heads, metadata.s_q, bf16_q, metadata.cluster, is_split(q))]
            if topk_length is None and metadata.topk != indices.shape[-1]:
                fn = None  # the metadata's full lengths are another topk's: the checks below say so
        except (KeyError, AttributeError, TypeError, IndexError):
            fn = None
        if fn is not None:
            try:
                fn(*args)
            except Exception:
                _validate_sparse(q, cache, indices, topk_length, softmax_scale, metadata, out, lse)
                raise
            return out, lse
    b, s_q, h, topk, q_dev = _validate_sparse(q, cache, indices, topk_length, softmax_scale, metadata, out, lse)
    check_query_precision(q, q_precision)
    bf16_q = not isinstance(q, (tuple, list))
    if check:
        checks = {"slots": (("indices", indices, cache.num_slots),)}
        if topk_length is not None:
            checks["ranges"] = (("topk_length", topk_length, 0, topk),)
        checks["finite"] = query_values(q)
        _check_values(**checks)
    _check_capture_ready("mla_decode_sparse", "sparse_decode_metadata", metadata, out, lse)
    if metadata is None:
        metadata = sparse_decode_metadata(b, s_q, h, topk, device=q_dev)
    lengths = topk_length
    if lengths is None:
        if metadata.topk != topk:
            raise ValueError(
                f"metadata: made for topk {metadata.topk} (its lengths when topk_length is None), got indices with topk {topk}"
            )
        lengths = metadata.full_lengths
    if out is None:
        out = torch.empty(b, s_q, h, CONTENT_DIM, dtype=torch.bfloat16, device=q_dev)
    if lse is None:
        lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q_dev)
    if bf16_q and q_precision == "e4m3x2":  # the accurate mode quantizes apart (hi + lo), checks done
        check_split_capture("mla_decode_sparse")
        q, bf16_q = quantize_q(q, check=False, precision=q_precision), False
    _, args = step_args(q, indices, lengths, out, lse, cache.slot_args, metadata, softmax_scale)
    check_cluster_parts(metadata)
    sparse_step(h, s_q, bf16_q, metadata.cluster, is_split(q))(*args)
    return out, lse


def _validate_sparse(q, cache, indices, topk_length, softmax_scale, metadata, out, lse):
    """Every structural check of a sparse call (no host sync). Returns ``(b, s_q, h, topk, device)``."""
    b, s_q, h, q_dev = validate_query(q, cache, SPARSE_HEADS, SPARSE_MAX_S_Q)
    if b < 1:
        raise ValueError(f"q: expected a batch of at least 1, got {b}")
    _check_softmax_scale(softmax_scale)
    _check_tensor("indices", indices, torch.int32, dim=3)
    if tuple(indices.shape[:2]) != (b, s_q) or not 1 <= indices.shape[2] <= _MAX_SEQLEN:
        raise ValueError(f"indices: expected shape ({b}, {s_q}, 1 <= topk <= {_MAX_SEQLEN}), got {tuple(indices.shape)}")
    topk = indices.shape[2]
    _check_cuda(indices=indices, cache=cache.kv)
    _check_same_device(q=q_dev, cache=cache.kv, indices=indices)
    if topk_length is not None:
        _check_tensor("topk_length", topk_length, torch.int32, dim=1)
        if topk_length.shape[0] != b:
            raise ValueError(f"topk_length: expected shape ({b},), got {tuple(topk_length.shape)}")
        _check_same_device(q=q_dev, topk_length=topk_length)
    validate_outputs(out, lse, b, s_q, h, q_dev, decode_reads(q, cache))
    if metadata is not None:
        if not isinstance(metadata, SparseDecodeMetadata):
            raise TypeError(
                f"metadata: expected SparseDecodeMetadata (from sparse_decode_metadata), got {type(metadata).__name__}"
            )
        if (metadata.batch, metadata.s_q, metadata.heads) != (b, s_q, h):
            raise ValueError(
                f"metadata: made for (batch, s_q, heads) = {(metadata.batch, metadata.s_q, metadata.heads)}, got {(b, s_q, h)}"
            )
        _check_same_device(q=q_dev, metadata=metadata.sched)
    return b, s_q, h, topk, q_dev
