"""Role: the producer warp's TMA loads (Q once per request, then the KV ring) and page lookup.

Per request segment of the part: Q's 64-row tile (e4m3 content and bf16 RoPE) into one
stage, then per 64-token KV block, into the next free KV stage, boxes of ``box_rows``
tokens (a page may hold fewer than 64) of the e4m3 content (Swizzle-128B), the bf16 RoPE
and the fp32 scales. Pages come from the block table, 32 entries per warp load (one per
lane, shuffled to the box that needs them); a box past the sequence reads page
``OOB_PAGE``, which TMA zero-fills, so no table entry past the sequence is ever used.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from snapmla_cute.format import CONTENT_DIM, ROPE_DIM
from snapmla_cute.kernels.decode.config import OOB_PAGE
from snapmla_cute.layouts import smem as L


@dataclass(frozen=True)
class TmaLoads:
    """The TMA atoms and the global tensors they partition, as (atom, tensor) pairs: Q's
    content and RoPE (64-row tiles), the KV content, RoPE and scales (``box_rows`` tokens)."""

    q_nope: tuple
    q_rope: tuple
    kv: tuple
    kr: tuple
    ks: tuple

    def atoms(self):
        return (self.q_nope[0], self.q_rope[0], self.kv[0], self.kr[0], self.ks[0])


class Producer:
    """The producer role (warp 0 of warpgroup 0); a mixin of ``DecodeKernel``."""

    @cute.jit
    def load(self, tma: TmaLoads, smem, m_block_table, m_seqlens, q_prod, kv_prod, m_tile, work):
        """Q and the KV blocks of every request segment of ``work`` (a ``PartWork``), in order,
        through the one-stage Q pipeline ``q_prod`` and the KV ring's ``kv_prod``."""
        cfg = self.cfg
        br = cfg.box_rows
        tma_q_nope, g_q_nope = tma.q_nope
        tma_q_rope, g_q_rope = tma.q_rope
        tma_kv, g_kv = tma.kv
        tma_kr, g_kr = tma.kr
        tma_ks, g_ks = tma.ks
        # Q tiles (64 rows x dims) per request
        tq_s, tq_g = cpasync.tma_partition(
            tma_q_nope, 0, cute.make_layout(1), cute.group_modes(smem.q_nope, 0, 2),
            cute.group_modes(cute.flat_divide(g_q_nope, (L.M_TILE, CONTENT_DIM)), 0, 2),
        )
        tqr_s, tqr_g = cpasync.tma_partition(
            tma_q_rope, 0, cute.make_layout(1), cute.group_modes(smem.q_rope, 0, 2),
            cute.group_modes(cute.flat_divide(g_q_rope, (L.M_TILE, ROPE_DIM)), 0, 2),
        )
        # KV boxes of `br` tokens: smem (box, sub, stage), gmem (box, tile in page, page)
        tkv_s, tkv_g = cpasync.tma_partition(
            tma_kv, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(smem.kv, (br, CONTENT_DIM)), 0, 2),
            cute.group_modes(cute.flat_divide(g_kv, (br, CONTENT_DIM)), 0, 2),
        )
        tkr_s, tkr_g = cpasync.tma_partition(
            tma_kr, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(smem.kr, (br, ROPE_DIM)), 0, 2),
            cute.group_modes(cute.flat_divide(g_kr, (br, ROPE_DIM)), 0, 2),
        )
        tks_s, tks_g = cpasync.tma_partition(
            tma_ks, 0, cute.make_layout(1),
            cute.group_modes(smem.ks, 0, 1),
            cute.group_modes(cute.flat_divide(g_ks, (br,)), 0, 1),
        )
        lane = cute.arch.lane_idx()
        table_width = m_block_table.shape[1]
        for r in cutlass.range(work.n_reqs, unroll=1):
            req = work.begin_req + r
            seqlen, blk_lo, blk_hi = work.block_range(r, req)
            n_entries = (seqlen + cfg.page_size - 1) // cfg.page_size
            hq = q_prod.acquire_and_advance()
            cute.copy(tma_q_nope, tq_g[(None, m_tile, 0, req)], tq_s[(None, hq.index)], tma_bar_ptr=hq.barrier)
            cute.copy(tma_q_rope, tqr_g[(None, m_tile, 0, req)], tqr_s[(None, hq.index)], tma_bar_ptr=hq.barrier)
            if r == 0 and lane == 0:
                self.tracer.stamp("q_issued")
            # block-table entries 32 at a time, one per lane: one load latency per 32 pages
            # instead of one per KV block on the producer's critical path
            base = Int32(-64)
            cached = Int32(OOB_PAGE)
            for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                hk = kv_prod.acquire_and_advance()
                self.tracer.producer_acquired(r, blk - blk_lo, lane)
                for sub in cutlass.range_constexpr(self.n_sub):
                    tok = blk * L.BLOCK_N + sub * br
                    entry = tok // cfg.page_size
                    if entry >= base + 32:
                        base = entry
                        cached = Int32(OOB_PAGE)
                        if base + lane < n_entries and base + lane < table_width:
                            cached = m_block_table[req, base + lane]
                    page = cute.arch.shuffle_sync(cached, entry - base)
                    if tok >= seqlen:
                        page = Int32(OOB_PAGE)
                    tile = (tok % cfg.page_size) // br
                    cute.copy(tma_kv, tkv_g[(None, tile, 0, page)], tkv_s[(None, sub, 0, hk.index)], tma_bar_ptr=hk.barrier)
                    cute.copy(tma_kr, tkr_g[(None, tile, 0, page)], tkr_s[(None, sub, 0, hk.index)], tma_bar_ptr=hk.barrier)
                    cute.copy(tma_ks, tks_g[(None, tile, page)], tks_s[(None, sub, hk.index)], tma_bar_ptr=hk.barrier)
                if r == 0 and blk == blk_lo and lane == 0:
                    self.tracer.stamp("kv_issued")
