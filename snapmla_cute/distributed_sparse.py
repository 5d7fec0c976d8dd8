"""Sparse (top-k) decode context parallelism: the indexer's global top-k lists over a cache
sharded across the GPUs of a group.

Each rank holds its shard of every request's cache, placed as in :mod:`snapmla_cute.distributed`
(:class:`~snapmla_cute.distributed.RoundRobin` or :class:`~snapmla_cute.distributed.Contiguous`).
The indexer gives every rank the same lists of global token positions, ``topk_pos`` int32
``[b, s_q, topk]`` (0 .. L-1 in the request; -1 is no token; a position >= L, or one no rank
holds, is no token too). Each rank keeps the entries it owns:

- round robin over ``world`` ranks: position ``g`` is this rank's iff ``g % world == rank``, as
  its token ``g // world``;
- contiguous: iff ``starts[b] <= g < starts[b] + cache_seqlens[b]``, as its token ``g - starts[b]``;

and a local token below ``cache_seqlens[b]`` becomes the slot id
``block_table[b, local // page_size] * page_size + local % page_size`` of its own cache
(:func:`local_topk`; the page column is clamped before the gather, so no position reads
outside ``block_table``). Every other entry becomes -1.

The kernel's time follows the list length it is given, not the number of real tokens in it
(-1 entries inside the length are masked but still cost time), so each list is
compacted: the owned ids first, in their global order, then -1, with ``topk_length[b]`` =
the most owned entries of any of request b's query tokens, about ``topk / world``. The
compaction is a cumulative sum of the owned mask (an owned entry's rank among the owned is
its destination) and one scatter: O(topk) elementwise torch ops with no host sync and no
sort, so a captured call replays with new positions, and the same code runs on CPU tensors
(the tests compare it there with a plain loop). Then ``mla_decode_sparse`` decodes the
compacted lists, and the partials are all-gathered and LSE-merged as the dense path does
(``distributed.exchange_and_merge``): every rank ends with the whole decode's ``out`` bf16
``[b, s_q, h, 512]`` and ``lse`` fp32 ``[b, h, s_q]``.

The buffers a call keeps (the lists, their lengths, the local plan, the partials) are
allocated by :func:`cp_sparse_decode_metadata`, before any CUDA-graph capture; the
translation's torch ops make their temporaries per call (inside a capture they come from the
graph's memory pool). ``check=True`` reads values back on each rank alone: a bad value on one
rank raises there while the others wait in the exchange (NCCL's timeout), as in the dense path.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import check_capture_ready as _check_capture_ready
from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_same_device as _check_same_device
from snapmla_cute.checks import check_softmax_scale as _check_softmax_scale
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.checks import check_values as _check_values
from snapmla_cute.distributed import (
    Contiguous,
    RoundRobin,
    check_starts,
    exchange_and_merge,
    group_world,
    merge_reads,
    partial_buffers,
)
from snapmla_cute.heads import SPARSE_HEADS, SPARSE_MAX_S_Q
from snapmla_cute.kernels.decode_scheduler import MAX_SEQLEN as _MAX_SEQLEN
from snapmla_cute.sparse import SparseDecodeMetadata, mla_decode_sparse, sparse_decode_metadata
from snapmla_cute.tuning import launcher
from snapmla_cute.validation import query_values, table_stats, validate_outputs, validate_query

_INT32_MAX = 2**31 - 1


class CPSparseDecodeMetadata:
    """The buffers of a context-parallel sparse decode of shape (batch, s_q, heads, topk) over
    ``world`` ranks: the rank-local lists (``indices`` int32 ``[b, s_q, topk]``,
    ``topk_length`` int32 ``[b]``), the local sparse decode's plan (``local``, a
    ``SparseDecodeMetadata``), its out / LSE and the gathered partials."""

    def __init__(self, local: SparseDecodeMetadata, topk: int, world: int, device):
        b, s_q, h = local.batch, local.s_q, local.heads
        self.batch, self.s_q, self.heads, self.topk, self.world, self.local = b, s_q, h, topk, world, local
        self.indices = torch.empty(b, s_q, topk, dtype=torch.int32, device=device)
        self.topk_length = torch.empty(b, dtype=torch.int32, device=device)
        self.local_out, self.local_lse, self.outs, self.lses, self.send, self.gathered = partial_buffers(
            b, s_q, h, world, device)


def cp_sparse_decode_metadata(batch: int, s_q: int, heads: int, topk: int, *, world: int, device=None,
                              num_parts: int | None = None) -> CPSparseDecodeMetadata:
    """The buffers for :func:`mla_decode_sparse_cp` at (batch, s_q, heads) with global lists of
    ``topk`` positions over ``world`` ranks. The local plan's cluster choice is made for
    lists of ``ceil(topk / world)`` entries (a rank's share when the picks spread evenly; the
    kernel re-plans every call, so any lengths replay correctly)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= _MAX_SEQLEN:
        raise ValueError(f"topk: expected an int in [1, {_MAX_SEQLEN}], got {topk!r}")
    local = sparse_decode_metadata(batch, s_q, heads, -(-topk // world), device=device, num_parts=num_parts)
    return CPSparseDecodeMetadata(local, topk, world, local.sched.device)


def local_topk(topk_pos: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, *, placement,
               page_size: int, topk_length: torch.Tensor | None = None, out: torch.Tensor | None = None,
               out_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's compacted slot lists from the global ``topk_pos`` int32 ``[b, s_q, topk]``:
    ``(indices`` int32 ``[b, s_q, topk]``, ``topk_length`` int32 ``[b])`` for
    ``mla_decode_sparse`` on this rank's cache (``block_table`` int32 ``[b, pages]`` and
    ``cache_seqlens`` int32 ``[b]`` of its shard, ``page_size`` its cache's). Per query
    token the ids of the positions this rank owns come first, in list order, then -1;
    ``topk_length[b]`` is the most owned entries of request b's query tokens. A global
    ``topk_length`` int32 ``[b]`` keeps only each list's first entries (past ``topk``: all;
    negative: none). Any position is safe: one that is negative, >= the request's length or
    another rank's is -1. Written into ``out`` / ``out_length`` if given. Plain torch ops on
    any device, no host sync (capturable)."""
    b, s_q, topk = _check_lists(topk_pos, block_table, cache_seqlens, placement, topk_length)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    dev = topk_pos.device
    if out is not None:
        _check_tensor("out", out, torch.int32, dim=3)
        if tuple(out.shape) != (b, s_q, topk):
            raise ValueError(f"out: expected shape {(b, s_q, topk)}, got {tuple(out.shape)}")
        _check_same_device(topk_pos=topk_pos, out=out)
    if out_length is not None:
        _check_tensor("out_length", out_length, torch.int32, dim=1)
        if out_length.shape[0] != b:
            raise ValueError(f"out_length: expected shape ({b},), got {tuple(out_length.shape)}")
        _check_same_device(topk_pos=topk_pos, out_length=out_length)
    if out is None:
        out = torch.empty(b, s_q, topk, dtype=torch.int32, device=dev)
    if out_length is None:
        out_length = torch.empty(b, dtype=torch.int32, device=dev)
    _translate(topk_pos, block_table, cache_seqlens, placement, page_size, topk_length, out, out_length)
    return out, out_length


def _translate(topk_pos, block_table, cache_seqlens, placement, page_size, topk_length, out, out_length):
    """:func:`local_topk` on checked tensors: one kernel on the GPU (``kernels.topk_translate``),
    torch ops elsewhere (the same values)."""
    if topk_pos.is_cuda:
        _translate_kernel(topk_pos, block_table, cache_seqlens, placement, page_size, topk_length, out, out_length)
    else:
        _translate_torch(topk_pos, block_table, cache_seqlens, placement, page_size, topk_length, out, out_length)


def _translate_kernel(topk_pos, block_table, cache_seqlens, placement, page_size, topk_length, out, out_length):
    from snapmla_cute.kernels import topk_translate

    if topk_pos.shape[0] == 0:
        return
    rr = isinstance(placement, RoundRobin)
    key = (page_size, rr, topk_length is not None)
    fn = launcher(topk_translate.compile, key, lambda: topk_translate.TopkTranslateConfig(*key))
    starts = cache_seqlens if rr else placement.starts  # unread with round robin
    rank, world = (placement.rank, placement.world) if rr else (0, 1)
    fn(topk_pos, block_table, cache_seqlens, starts, cache_seqlens if topk_length is None else topk_length, out,
       out_length, rank, world)


def _translate_torch(topk_pos, block_table, cache_seqlens, placement, page_size, topk_length, out, out_length):
    b, s_q, topk = topk_pos.shape
    pos = topk_pos.long()  # int64: no overflow whatever the positions and starts
    if isinstance(placement, RoundRobin):
        local = torch.div(pos, placement.world, rounding_mode="floor")
        owned = pos.remainder(placement.world) == placement.rank
    else:
        local = pos - placement.starts.long().view(b, 1, 1)
        owned = pos >= 0  # starts are not trusted to be >= 0 here
    owned &= (local >= 0) & (local < cache_seqlens.view(b, 1, 1))
    if topk_length is not None:
        owned &= torch.arange(topk, device=pos.device) < topk_length.view(b, 1, 1)
    width = block_table.shape[1]
    if width:
        col = torch.div(local, page_size, rounding_mode="floor").clamp_(0, width - 1)  # in bounds, then masked
        page = torch.gather(block_table, 1, col.view(b, s_q * topk)).view(b, s_q, topk)
        slot = torch.add(local, page - col, alpha=page_size)  # page * page_size + local % page_size where owned
    else:
        owned.zero_()  # no page: no token (check=True refuses lengths past the table)
        slot = local
    slot = torch.where(owned, slot, -1).to(torch.int32)
    # an owned entry goes to its rank among the owned; every other one writes -1 into the
    # last column, which is in the -1 tail unless all topk entries are owned (then none is not)
    before = owned.cumsum(-1)
    dest = torch.where(owned, before - 1, topk - 1)
    out.fill_(-1)
    out.scatter_(-1, dest, slot)
    out_length.copy_(before[..., -1].amax(dim=1))


def _check_lists(topk_pos, block_table, cache_seqlens, placement, topk_length, b=None, s_q=None):
    """The structural checks of the global lists and this rank's table (any device). Returns
    ``(b, s_q, topk)``."""
    if not isinstance(placement, (RoundRobin, Contiguous)):
        raise TypeError(f"placement: expected RoundRobin or Contiguous, got {type(placement).__name__}")
    _check_tensor("topk_pos", topk_pos, torch.int32, dim=3)
    b = topk_pos.shape[0] if b is None else b
    s_q = topk_pos.shape[1] if s_q is None else s_q
    if tuple(topk_pos.shape[:2]) != (b, s_q) or b < 1 or not 1 <= topk_pos.shape[2] <= _MAX_SEQLEN:
        raise ValueError(
            f"topk_pos: expected shape ({b}, {s_q}, 1 <= topk <= {_MAX_SEQLEN}) with batch >= 1, got {tuple(topk_pos.shape)}"
        )
    _check_tensor("block_table", block_table, torch.int32, dim=2, rows_strided=True)
    _check_tensor("cache_seqlens", cache_seqlens, torch.int32, dim=1)
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(
            f"block_table/cache_seqlens: expected batch {b}, got {block_table.shape[0]} and {cache_seqlens.shape[0]}"
        )
    _check_same_device(topk_pos=topk_pos, block_table=block_table, cache_seqlens=cache_seqlens)
    if topk_length is not None:
        _check_tensor("topk_length", topk_length, torch.int32, dim=1)
        if topk_length.shape[0] != b:
            raise ValueError(f"topk_length: expected shape ({b},), got {tuple(topk_length.shape)}")
        _check_same_device(topk_pos=topk_pos, topk_length=topk_length)
    check_starts(placement, b, cache_seqlens)
    return b, s_q, topk_pos.shape[2]


def _validate_shard(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, softmax_scale):
    """Every structural check of a rank's part (no host sync). Returns ``(b, s_q, h, topk, device)``."""
    b, s_q, h, q_dev = validate_query(q, cache, SPARSE_HEADS, SPARSE_MAX_S_Q)
    if b < 1:
        raise ValueError(f"q: expected a batch of at least 1, got {b}")
    _check_softmax_scale(softmax_scale)
    _, _, topk = _check_lists(topk_pos, block_table, cache_seqlens, placement, topk_length, b, s_q)
    _check_cuda(topk_pos=topk_pos, block_table=block_table, cache_seqlens=cache_seqlens, cache=cache.kv)
    _check_same_device(q=q_dev, cache=cache.kv, topk_pos=topk_pos)
    return b, s_q, h, topk, q_dev


def _check_metadata(metadata, b, s_q, h, topk, world, q_dev):
    if not isinstance(metadata, CPSparseDecodeMetadata):
        raise TypeError(
            f"metadata: expected CPSparseDecodeMetadata (from cp_sparse_decode_metadata), got {type(metadata).__name__}"
        )
    made = (metadata.batch, metadata.s_q, metadata.heads, metadata.topk)
    if made != (b, s_q, h, topk) or (world is not None and metadata.world != world):
        raise ValueError(
            f"metadata: made for (batch, s_q, heads, topk, world) = {(*made, metadata.world)}, "
            f"got {(b, s_q, h, topk, metadata.world if world is None else world)}"
        )
    _check_same_device(q=q_dev, metadata=metadata.indices)


def _check_shard_values(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, topk):
    """``check=True``'s one host sync: the query finite, positions >= -1, the global lengths
    in [0, topk], contiguous starts >= 0, this rank's lengths and the page ids they use."""
    ranges = [("topk_pos", topk_pos, -1, _INT32_MAX)]
    if topk_length is not None:
        ranges.append(("topk_length", topk_length, 0, topk))
    if isinstance(placement, Contiguous):
        ranges.append(("placement.starts", placement.starts, 0, _INT32_MAX))
    _check_values(finite=query_values(q), ranges=ranges, extra=table_stats(block_table, cache_seqlens, cache))


def _run_shard(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, softmax_scale, metadata):
    _translate(topk_pos, block_table, cache_seqlens, placement, cache.page_size, topk_length, metadata.indices,
               metadata.topk_length)
    # the lists are ids of checked pages (or -1): the decode's own read-back would add nothing
    return mla_decode_sparse(q, cache, metadata.indices, topk_length=metadata.topk_length,
                             softmax_scale=softmax_scale, metadata=metadata.local, out=metadata.local_out,
                             lse=metadata.local_lse, check=False)


def decode_sparse_shard(q, cache, topk_pos, block_table, cache_seqlens, *, placement,
                        metadata: CPSparseDecodeMetadata, topk_length=None, softmax_scale=None, check=True):
    """This rank's part of :func:`mla_decode_sparse_cp` (no exchange): :func:`local_topk` into
    ``metadata.indices`` / ``metadata.topk_length`` and ``mla_decode_sparse`` over them into
    ``metadata.local_out`` / ``metadata.local_lse`` (returned). The placement is not checked
    against a process group (a rank simulated in one process may call it)."""
    b, s_q, h, topk, q_dev = _validate_shard(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length,
                                             softmax_scale)
    _check_metadata(metadata, b, s_q, h, topk, None, q_dev)
    if check:
        _check_shard_values(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, topk)
    return _run_shard(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, softmax_scale, metadata)


def mla_decode_sparse_cp(
    q,
    cache,
    topk_pos: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    placement,
    group=None,
    topk_length: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    metadata: CPSparseDecodeMetadata | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse decode of requests whose cache is sharded over the ranks of ``group``
    (default: the default process group; NCCL for GPUs). Every rank calls it with the same
    ``q`` (bf16 ``[b, s_q, h, 576]`` or the ``quantize_q`` tuple; h in ``SPARSE_HEADS``, s_q
    <= 8), the same global lists ``topk_pos`` int32 ``[b, s_q, topk]`` (positions in the
    request, -1 no token; a position >= the request's length is no token) and optional
    ``topk_length`` int32 ``[b]`` (each list's valid entries), and its own ``cache``,
    ``block_table`` and ``cache_seqlens`` (its shard) and ``placement``; each gets the whole
    decode's ``out`` bf16 ``[b, s_q, h, 512]`` and ``lse`` fp32 ``[b, h, s_q]`` (a list with
    no token: zeros and -inf).

    ``metadata`` from :func:`cp_sparse_decode_metadata` (needed under CUDA-graph capture,
    with ``out`` and ``lse``). ``check`` reads values back once (a sync): the query finite,
    positions >= -1, ``topk_length`` in [0, topk], starts >= 0, and this rank's lengths and
    page ids as ``mla_decode`` checks them. Without it no value is read: any position and
    length are safe (see :func:`local_topk`), page ids are trusted.
    """
    world = group_world(placement, group)
    b, s_q, h, topk, q_dev = _validate_shard(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length,
                                             softmax_scale)
    _check_capture_ready("mla_decode_sparse_cp", "cp_sparse_decode_metadata", metadata, out, lse)
    if metadata is None:
        metadata = cp_sparse_decode_metadata(b, s_q, h, topk, world=world, device=q_dev)
    _check_metadata(metadata, b, s_q, h, topk, world, q_dev)
    # before anything runs: nothing written on error; with check, not inside what the merge reads
    validate_outputs(out, lse, b, s_q, h, q_dev, merge_reads(metadata) if check else None)
    if check:
        _check_shard_values(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, topk)
    _run_shard(q, cache, topk_pos, block_table, cache_seqlens, placement, topk_length, softmax_scale, metadata)
    return exchange_and_merge(metadata, group, out, lse)
