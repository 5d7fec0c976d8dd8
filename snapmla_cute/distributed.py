"""Decode context parallelism: one request's KV cache sharded across the GPUs of a group.

Each rank holds some of every request's tokens in its own FP8 cache (the engine decides
which; two placements are described here), decodes them alone (``mla_decode``, out and
LSE), and the partials are exchanged with ``torch.distributed.all_gather_into_tensor`` over
the engine's process group (NCCL) and merged LSE-weighted by a CuTe DSL kernel
(``kernels.lse_merge``). Every rank ends with the whole decode's ``out`` and ``lse``.

Placements (a rank's tokens are in its cache in increasing global position):

- :class:`RoundRobin` ``(rank, world)``: global token ``g`` lives on rank ``g % world`` as
  that rank's token ``g // world`` (vLLM's interleaved DCP with interleave size 1).
- :class:`Contiguous` ``(starts)``: this rank holds global tokens ``starts[i] ..
  starts[i] + cache_seqlens[i] - 1`` of request i (chunks; a rank may hold none).

With ``causal`` and s_q > 1, query token t sees global positions ``< L - s_q + t + 1``
(``L`` = ``global_seqlens``): each rank masks by its keys' global positions, not by their
index in its shard (``mla_decode``'s ``visible``). The merge is exact: the decode of a
shard is the whole decode restricted to its keys, so the LSE-weighted sum of the shards'
results is the whole decode's, up to the bf16 rounding of each shard's ``out`` and the
regrouping of keys into P blocks.

Everything a call needs is allocated by :func:`cp_decode_metadata` (before any CUDA-graph
capture): a captured call, exchange included, replays with new lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapmla_cute.checks import capturing as _capturing
from snapmla_cute.checks import check_capture_ready as _check_capture_ready
from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_same_device as _check_same_device
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.format import CONTENT_DIM
from snapmla_cute.decode import mla_decode
from snapmla_cute.heads import HEADS, MAX_S_Q
from snapmla_cute.planning import DecodeMetadata, decode_metadata
from snapmla_cute.tuning import launcher
from snapmla_cute.validation import validate_outputs


@dataclass(frozen=True)
class RoundRobin:
    """Global token ``g`` on rank ``g % world``, at index ``g // world`` of that rank's cache;
    ``mla_decode_cp`` requires ``rank`` to be this process's rank in its group."""

    rank: int
    world: int

    def __post_init__(self):
        for name, v in (("rank", self.rank), ("world", self.world)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"RoundRobin.{name}: expected an int, got {type(v).__name__}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"RoundRobin: expected 0 <= rank < world, got rank {self.rank}, world {self.world}")


@dataclass(frozen=True)
class Contiguous:
    """This rank's tokens of request i are global tokens ``starts[i] ..`` (int32 ``[b]``, on
    the decode's device; may change between graph replays, in place)."""

    starts: torch.Tensor


class CPDecodeMetadata:
    """The buffers of a context-parallel decode of shape (batch, s_q, heads) over ``world``
    ranks: the local decode's plan (``DecodeMetadata``), its out / LSE, the gathered partials,
    and the visible-key counts of a causal s_q > 1 call."""

    def __init__(self, local: DecodeMetadata, world: int, device):
        b, s_q, h = local.batch, local.s_q, local.heads
        self.batch, self.s_q, self.heads, self.world, self.local = b, s_q, h, world, local
        self.local_out, self.local_lse, self.outs, self.lses, self.send, self.gathered = partial_buffers(
            b, s_q, h, world, device)
        self.visible = torch.empty(b, s_q, dtype=torch.int32, device=device)


def partial_buffers(b: int, s_q: int, h: int, world: int, device):
    """This rank's decode ``out`` bf16 ``[b, s_q, h, 512]`` and ``lse`` fp32 ``[b, h, s_q]``,
    the group's gathered ones ``[world, ...]`` (what :func:`exchange_and_merge` reads), and
    the two byte buffers under them: ``(local_out, local_lse, outs, lses, send, gathered)``.
    A rank's out and LSE sit in one ``send`` row so that the exchange is one all-gather
    (each NCCL call costs ~15-25 µs at these sizes); ``outs`` / ``lses`` are views of the
    gathered rows (a rank's slab contiguous, rows 256-byte aligned)."""
    out_bytes = b * s_q * h * CONTENT_DIM * 2
    row = max(256, -(-(out_bytes + b * h * s_q * 4) // 256) * 256)
    send = torch.zeros(row, dtype=torch.uint8, device=device)
    gathered = torch.zeros(world, row, dtype=torch.uint8, device=device)

    def views(buf, lead: tuple, lead_stride: tuple):
        out = buf.view(torch.bfloat16).as_strided(
            (*lead, b, s_q, h, CONTENT_DIM), (*(x // 2 for x in lead_stride), s_q * h * CONTENT_DIM, h * CONTENT_DIM,
                                              CONTENT_DIM, 1))
        lse = buf.view(torch.float32).as_strided(
            (*lead, b, h, s_q), (*(x // 4 for x in lead_stride), h * s_q, s_q, 1), out_bytes // 4)
        return out, lse

    local_out, local_lse = views(send, (), ())
    outs, lses = views(gathered, (world,), (row,))
    return local_out, local_lse, outs, lses, send, gathered


def cp_decode_metadata(
    cache_seqlens: torch.Tensor, *, s_q: int, heads: int, world: int, num_parts: int | None = None
) -> CPDecodeMetadata:
    """The buffers for :func:`mla_decode_cp` at this rank's batch (``cache_seqlens``: this
    rank's lengths, only their count and device are used) over ``world`` ranks."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")
    local = decode_metadata(cache_seqlens, s_q=s_q, heads=heads, num_parts=num_parts, head_groups=1)  # visible step: plain
    return CPDecodeMetadata(local, world, cache_seqlens.device)


def visible_counts(cache_seqlens, global_seqlens, s_q: int, placement, out: torch.Tensor | None = None):
    """Keys of this rank's shard that query token t of each request sees under the causal
    mask by global position: ``[b, s_q]`` int32, computed on the device (no sync). Query t
    sits at global position ``L - s_q + t``; the shard's token i at ``rank + i·world``
    (round robin) or ``starts + i`` (contiguous)."""
    b = cache_seqlens.shape[0]
    t = torch.arange(s_q, dtype=torch.int64, device=cache_seqlens.device)
    limit = global_seqlens.long().view(b, 1) - s_q + t.view(1, s_q)  # last visible global position
    if isinstance(placement, RoundRobin):
        n = torch.div(limit - placement.rank, placement.world, rounding_mode="floor") + 1
    else:
        n = limit - placement.starts.long().view(b, 1) + 1
    n = torch.minimum(n.clamp_(min=0), cache_seqlens.long().view(b, 1))
    if out is None:
        return n.to(torch.int32)
    out.copy_(n)
    return out


def _merge_launcher(s_q: int, heads: int):
    from snapmla_cute.kernels import lse_merge

    return launcher(lse_merge.compile, (s_q, heads), lambda: lse_merge.LseMergeConfig(s_q, heads))


def _check_stacked(name, t, dtype, dim, last=None):
    """A stack of W partials: each one contiguous, any row stride between them that keeps
    them apart and 16-byte aligned (the gathered rows of :func:`partial_buffers`)."""
    _check_tensor(name, t, dtype, dim=dim, last=last, rows_strided=True)
    if t.shape[0] == 0 or t[0].numel() == 0:
        return
    if not t[0].is_contiguous():
        raise ValueError(f"{name}: expected each partial contiguous, got strides {t.stride()}")
    step = 16 // t.element_size()
    if t.shape[0] > 1 and (t.stride(0) < t[0].numel() or t.stride(0) % step):
        raise ValueError(f"{name}: expected a stride between partials of at least {t[0].numel()} elements "
                         f"and a multiple of {step}, got {t.stride(0)}")


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, *, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of W partial decodes of the same queries (``kernels.lse_merge``): ``outs``
    bf16 ``[W, b, s_q, h, 512]``, ``lses`` fp32 ``[W, b, h, s_q]`` (each partial contiguous;
    any 16-byte-multiple stride between them, as in ``CPDecodeMetadata.outs``) → ``out``
    bf16 ``[b, s_q, h, 512]``, ``lse`` fp32 ``[b, h, s_q]``. A row with every ``lse_w`` =
    -inf gives zeros and -inf."""
    _check_stacked("outs", outs, torch.bfloat16, 5, CONTENT_DIM)
    _check_stacked("lses", lses, torch.float32, 4)
    W, b, s_q, h, _ = outs.shape
    if tuple(lses.shape) != (W, b, h, s_q):
        raise ValueError(f"lses: expected shape {(W, b, h, s_q)} (from outs {tuple(outs.shape)}), got {tuple(lses.shape)}")
    if h not in HEADS or not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"outs: expected heads in {HEADS} and s_q in [1, {MAX_S_Q}], got {h} and {s_q}")
    _check_cuda(outs=outs, lses=lses)
    _check_same_device(outs=outs, lses=lses)
    validate_outputs(out, lse, b, s_q, h, outs.device, {"outs": outs, "lses": lses})
    if _capturing() and (out is None or lse is None):
        raise ValueError("merge_partials under CUDA-graph capture needs out and lse (made before capture)")
    return _merge_into(outs, lses, out, lse)


def _merge_into(outs, lses, out, lse):
    """The merge on checked tensors; ``out`` / ``lse`` allocated if None."""
    W, b, s_q, h, _ = outs.shape
    if out is None:
        out = torch.empty(b, s_q, h, CONTENT_DIM, dtype=torch.bfloat16, device=outs.device)
    if lse is None:
        lse = torch.empty(b, h, s_q, dtype=torch.float32, device=outs.device)
    if b and W:
        _merge_launcher(s_q, h)(outs, lses, out, lse)
    elif b:
        out.zero_()
        lse.fill_(-float("inf"))
    return out, lse


def mla_decode_cp(
    q,
    cache,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    placement,
    group=None,
    global_seqlens: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    metadata: CPDecodeMetadata | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode of requests whose KV cache is sharded over the ranks of ``group`` (default:
    the default process group; NCCL for GPUs). Every rank calls it with the same ``q``
    (bf16 ``[b, s_q, h, 576]`` or the ``quantize_q`` tuple), its own ``cache``,
    ``block_table`` and ``cache_seqlens`` (its shard: 0 where it holds no token of a
    request) and its ``placement`` (:class:`RoundRobin` or :class:`Contiguous`); each gets
    the whole decode's ``out`` bf16 ``[b, s_q, h, 512]`` and ``lse`` fp32 ``[b, h, s_q]``.

    ``global_seqlens`` int32 ``[b]`` (every rank's tokens of the request together) is needed
    with ``causal`` and s_q > 1. ``metadata`` from :func:`cp_decode_metadata` (needed under
    CUDA-graph capture, with ``out`` and ``lse``). ``check`` as in ``mla_decode`` (a sync).
    """
    world = group_world(placement, group)
    qt = q[0] if isinstance(q, (tuple, list)) and q else q
    if not isinstance(qt, torch.Tensor) or qt.dim() != 4:
        got = f"shape {tuple(qt.shape)}" if isinstance(qt, torch.Tensor) else type(qt).__name__
        raise ValueError(f"q: expected a [b, s_q, h, 576] bf16 tensor or the quantize_q tuple, got {got}")
    b, s_q, h = qt.shape[:3]
    _check_capture_ready("mla_decode_cp", "cp_decode_metadata", metadata, out, lse)
    if metadata is None:
        metadata = cp_decode_metadata(cache_seqlens, s_q=s_q, heads=h, world=world)
    elif not isinstance(metadata, CPDecodeMetadata):
        raise TypeError(f"metadata: expected CPDecodeMetadata (from cp_decode_metadata), got {type(metadata).__name__}")
    if (metadata.batch, metadata.s_q, metadata.heads, metadata.world) != (b, s_q, h, world):
        raise ValueError(
            f"metadata: made for (batch, s_q, heads, world) = {(metadata.batch, metadata.s_q, metadata.heads, metadata.world)}, "
            f"got {(b, s_q, h, world)}"
        )
    # before anything runs: nothing written on error; with check, not inside what the merge reads
    validate_outputs(out, lse, b, s_q, h, qt.device, merge_reads(metadata) if check else None)
    decode_shard(
        q, cache, block_table, cache_seqlens, placement=placement, global_seqlens=global_seqlens, causal=causal,
        softmax_scale=softmax_scale, metadata=metadata, check=check,
    )
    return exchange_and_merge(metadata, group, out, lse)


def group_world(placement, group) -> int:
    """The size of ``group`` (1 without an initialized process group), after checking that
    ``placement`` fits it: a :class:`RoundRobin` over that many ranks at this process's rank,
    or a :class:`Contiguous`."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if isinstance(placement, RoundRobin):
        if placement.world != world:
            raise ValueError(f"placement: RoundRobin over {placement.world} ranks, the group has {world}")
        rank = dist.get_rank(group) if world > 1 else 0
        if placement.rank != rank:  # a wrong rank would take other ranks' global positions for its own
            raise ValueError(f"placement: expected RoundRobin.rank {rank} (this process's rank in the group), got {placement.rank}")
    elif not isinstance(placement, Contiguous):
        raise TypeError(f"placement: expected RoundRobin or Contiguous, got {type(placement).__name__}")
    return world


def merge_reads(metadata) -> dict:
    """The buffers :func:`exchange_and_merge` reads, by name (``out`` / ``lse`` may not overlap them)."""
    return {"metadata.local_out": metadata.local_out, "metadata.local_lse": metadata.local_lse,
            "metadata.outs": metadata.outs, "metadata.lses": metadata.lses}


def exchange_partials(metadata, group=None) -> None:
    """This rank's partial (``metadata.local_out`` / ``local_lse``) all-gathered over
    ``group`` into ``metadata.outs`` / ``lses``: one NCCL all-gather of the byte rows they
    share (``metadata.send`` → ``metadata.gathered``)."""
    import torch.distributed as dist

    dist.all_gather_into_tensor(metadata.gathered, metadata.send, group=group)


def exchange_and_merge(metadata, group, out, lse):
    """The tail of a context-parallel call on checked tensors: this rank's partial
    exchanged (:func:`exchange_partials`; world 1: used as is) and LSE-merged into ``out`` /
    ``lse`` (allocated if None)."""
    if metadata.world > 1:
        exchange_partials(metadata, group)
        outs, lses = metadata.outs, metadata.lses
    else:
        outs, lses = metadata.local_out.unsqueeze(0), metadata.local_lse.unsqueeze(0)
    return _merge_into(outs, lses, out, lse)


def decode_shard(q, cache, block_table, cache_seqlens, *, placement, metadata: CPDecodeMetadata,
                 global_seqlens=None, causal=False, softmax_scale=None, check=True):
    """This rank's part of :func:`mla_decode_cp` (no exchange): the decode of its shard,
    masked by global positions with ``causal`` and s_q > 1, into ``metadata.local_out`` /
    ``metadata.local_lse`` (returned)."""
    b, s_q = metadata.batch, metadata.s_q
    visible = None
    if causal and s_q > 1:
        if global_seqlens is None:
            raise ValueError("global_seqlens: needed with causal and s_q > 1 (the query tokens' global positions)")
        _check_tensor("global_seqlens", global_seqlens, torch.int32, dim=1)
        if global_seqlens.shape[0] != b:
            raise ValueError(f"global_seqlens: expected shape ({b},), got {tuple(global_seqlens.shape)}")
        check_starts(placement, b, cache_seqlens)
        _check_same_device(cache_seqlens=cache_seqlens, global_seqlens=global_seqlens)
        visible = visible_counts(cache_seqlens, global_seqlens, s_q, placement, out=metadata.visible)
    # causal with s_q 1: every key of every shard precedes the query, nothing to mask
    return mla_decode(
        q, cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=bool(causal and s_q > 1),
        visible=visible, metadata=metadata.local, out=metadata.local_out, lse=metadata.local_lse, check=check,
    )


def check_starts(placement, b: int, cache_seqlens) -> None:
    """A :class:`Contiguous` placement's ``starts``: int32 ``[b]`` beside ``cache_seqlens``."""
    if isinstance(placement, Contiguous):
        _check_tensor("placement.starts", placement.starts, torch.int32, dim=1)
        if placement.starts.shape[0] != b:
            raise ValueError(f"placement.starts: expected shape ({b},), got {tuple(placement.starts.shape)}")
        _check_same_device(cache_seqlens=cache_seqlens, starts=placement.starts)


def shard_cache(cache, block_table: torch.Tensor, cache_seqlens: torch.Tensor, world: int, rank: int,
                placement: str = "round_robin", page_size: int | None = None):
    """One rank's shard of a whole cache, for tests and benchmarks (an engine places tokens
    itself): ``(cache, block_table, cache_seqlens, placement)`` with the rank's tokens copied
    into a new cache (``page_size`` default the source's; fresh pages, unused slots NaN).
    ``placement`` "round_robin" or "contiguous" (request i's tokens cut into ``world``
    near-equal chunks)."""
    from snapmla_cute.kv_cache import FP8KVCache

    dev = cache.kv.device
    ps_src = cache.page_size
    ps = ps_src if page_size is None else page_size
    lens = [int(x) for x in cache_seqlens.tolist()]
    local_lens, starts, src_slots = [], [], []
    for i, L in enumerate(lens):
        if placement == "round_robin":
            g = torch.arange(rank, max(L, rank), world, device=dev)
            start = rank
        elif placement == "contiguous":
            lo, hi = L * rank // world, L * (rank + 1) // world
            g = torch.arange(lo, hi, device=dev)
            start = lo
        else:
            raise ValueError(f"placement: expected 'round_robin' or 'contiguous', got {placement!r}")
        pages = block_table[i].long()[g // ps_src]
        src_slots.append(pages * ps_src + g % ps_src)
        local_lens.append(g.numel())
        starts.append(start)
    n_pages = [(n + ps - 1) // ps for n in local_lens]
    total = max(1, sum(n_pages))
    shard = FP8KVCache.allocate(total, ps, device=dev, fill_nan=True)  # NaN in every slot no token fills
    width = max(1, max(n_pages))
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
    perm = torch.randperm(total, device=dev).int()  # pages in no particular order
    used = 0
    for i, n in enumerate(local_lens):
        table[i, : n_pages[i]] = perm[used : used + n_pages[i]]
        if n:
            dst = table[i].long()[torch.arange(n, device=dev) // ps] * ps + torch.arange(n, device=dev) % ps
            shard.kv.view(-1, shard.kv.shape[-1])[dst] = cache.kv.view(-1, cache.kv.shape[-1])[src_slots[i]]
            shard.kv_scale.view(-1)[dst] = cache.kv_scale.view(-1)[src_slots[i]]
        used += n_pages[i]
    lens_t = torch.tensor(local_lens, dtype=torch.int32, device=dev)
    where = RoundRobin(rank, world) if placement == "round_robin" else Contiguous(
        torch.tensor(starts, dtype=torch.int32, device=dev))
    return shard, table, lens_t, where
