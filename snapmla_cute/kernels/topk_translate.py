"""Sparse context parallel's list translation (``distributed_sparse.local_topk``) in one launch.

Input  ``topk_pos``      int32 [b, s_q, topk]  the indexer's global positions (-1: none)
       ``block_table``   int32 [b, width]      this rank's pages (any row stride)
       ``cache_seqlens`` int32 [b]             this rank's tokens of each request
       ``starts``        int32 [b]             a contiguous placement's first global position
       ``topk_length``   int32 [b]             the global lists' lengths (``global_length``)
Output ``indices``       int32 [b, s_q, topk]  this rank's slot ids, owned entries first, then -1
       ``lengths``       int32 [b]             the most owned entries of a request's query tokens

One CTA per request walks its query tokens' lists 256 entries at a time: each thread decides
ownership and the slot of one entry, a block-wide prefix sum of the owned flags gives each
owned id its place, and the rest of the row is filled with -1. The torch version (two dozen
launches) cost ~58 µs at b8 topk 2048 on an H200; this is one. A page column past the table
is clamped (in bounds, as the torch version); positions of any value are safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from snapmla_cute import jit_cache
from snapmla_cute.kernels import fake
from snapmla_cute.kernels.decode_scheduler import DecodeSchedulerKernel

NAME = "topk_translate"
THREADS = 256


@dataclass(frozen=True)
class TopkTranslateConfig:
    page_size: int
    round_robin: bool  # owned: pos % world == rank (else starts[b] <= pos < starts[b] + cache_seqlens[b])
    global_length: bool  # a global topk_length keeps each list's first entries


class TopkTranslateKernel:
    def __init__(self, cfg: TopkTranslateConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_pos: cute.Tensor,  # int32 [b, s_q, topk]
        m_block_table: cute.Tensor,  # int32 [b, width]
        m_seqlens: cute.Tensor,  # int32 [b]
        m_starts: cute.Tensor,  # int32 [b] (round robin: any [b] int32, unread)
        m_global_length: cute.Tensor,  # int32 [b] (without ``global_length``: any [b] int32, unread)
        m_indices: cute.Tensor,  # int32 [b, s_q, topk]
        m_lengths: cute.Tensor,  # int32 [b]
        rank: Int32,
        world: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            warp_sums: cute.struct.MemRange[Int32, THREADS // 32]

        self.shared_storage = SharedStorage
        self.kernel(m_pos, m_block_table, m_seqlens, m_starts, m_global_length, m_indices, m_lengths, rank,
                    world).launch(grid=[m_pos.shape[0], 1, 1], block=[THREADS, 1, 1],
                                  smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.jit
    def slot_of(self, pos: Int32, table_row: cute.Tensor, width: Int32, seqlen: Int32, start: Int32, rank: Int32,
                world: Int32):
        """(owned, slot id in this rank's cache) of one global position."""
        local = Int64(0)
        owned = pos >= 0
        if cutlass.const_expr(self.cfg.round_robin):
            local = Int64(pos // world)
            owned = owned and pos % world == rank
        else:
            local = Int64(pos) - Int64(start)
        owned = owned and local >= 0 and local < Int64(seqlen) and width > 0
        slot = Int32(-1)
        if owned:
            ps = self.cfg.page_size
            col = cutlass.min(Int32(local // ps), width - 1)  # in bounds, as the torch version
            slot = table_row[col] * ps + Int32(local % ps)
        return owned, slot

    @cute.kernel
    def kernel(self, m_pos: cute.Tensor, m_block_table: cute.Tensor, m_seqlens: cute.Tensor, m_starts: cute.Tensor,
               m_global_length: cute.Tensor, m_indices: cute.Tensor, m_lengths: cute.Tensor, rank: Int32,
               world: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        req, _, _ = cute.arch.block_idx()
        s_q, topk = m_pos.shape[1], m_pos.shape[2]
        width = m_block_table.shape[1]
        storage = SmemAllocator().allocate(self.shared_storage)
        s_warp = storage.warp_sums.get_tensor(cute.make_layout((THREADS // 32,)))
        seqlen = m_seqlens[req]
        start = Int32(0)
        if cutlass.const_expr(not self.cfg.round_robin):
            start = m_starts[req]
        listed = topk
        if cutlass.const_expr(self.cfg.global_length):
            listed = cutlass.max(cutlass.min(m_global_length[req], topk), 0)
        table_row = m_block_table[req, None]
        most = Int32(0)
        for t in cutlass.range(s_q, unroll=1):
            found = Int32(0)
            for c in cutlass.range(0, topk, THREADS, unroll=1):
                j = c + tidx
                owned = False
                slot = Int32(-1)
                if j < listed:
                    owned, slot = self.slot_of(m_pos[req, t, j], table_row, width, seqlen, start, rank, world)
                before, total = DecodeSchedulerKernel.exclusive_scan(Int32(owned), s_warp, tidx, THREADS)
                if owned:
                    m_indices[req, t, found + before] = slot
                found += total
            for j in cutlass.range(found + tidx, topk, THREADS, unroll=1):
                m_indices[req, t, j] = Int32(-1)
            most = cutlass.max(most, found)
        if tidx == 0:
            m_lengths[req] = most


def fake_args(config: TopkTranslateConfig):
    b, s_q, topk, width, row = fake.sym(), fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    lists = lambda: t(Int32, (b, s_q, topk), (fake.sym(), fake.sym(), 1), 4)  # noqa: E731
    per_request = lambda: t(Int32, (b,), (1,), 4)  # noqa: E731
    return (lists(), t(Int32, (b, width), (row, 1), 4), per_request(), per_request(), per_request(), lists(),
            per_request(), Int32(0), Int32(1), fake.stream())


def compile(config: TopkTranslateConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The compiled kernel for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, TopkTranslateKernel, fake_args, arch=arch, keep_sass=keep_sass)
