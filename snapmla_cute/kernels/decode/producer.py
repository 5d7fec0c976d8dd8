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
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM
from snapmla_cute import ptx
from snapmla_cute.kernels.decode.args import TmaLoads
from snapmla_cute.kernels.decode.config import L2_EVICT_FIRST, OOB_PAGE, DecodeConfig
from snapmla_cute.kernels.decode.plan import PartWork
from snapmla_cute.kernels.decode.storage import SmemTensors
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.kernels.decode_scheduler import clamp_len
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles
from snapmla_cute.pipelines.kv_ring import KVRing


@dataclass(frozen=True)
class Producer:
    """The producer role: warp 0 of warpgroup 0 loads by TMA (``load``); the sparse decode's
    whole warpgroup gathers with cp.async (``load_sparse``). ``tma``: the atoms and the
    global tensors they read; ``smem``: the destination views."""

    cfg: DecodeConfig
    tracer: Tracer
    tma: TmaLoads
    smem: SmemTensors
    q_lo: tuple = None  # ``DecodeConfig.q_split``: (atom, tensor) of Q's residual codes

    @property
    def n_sub(self) -> int:
        """TMA boxes per 64-token block (a page may hold fewer than 64 tokens)."""
        return L.BLOCK_N // self.cfg.box_rows

    def q_partitions(self):
        """The TMA partitions of a request's Q tile (64 rows x dims: content, RoPE, and with
        ``q_split`` the residual's codes): ``(atom, smem, gmem)`` triples, built once per
        part at trace time."""
        tma, smem = self.tma, self.smem
        # (atom and tensor, smem tile, dims, the tile's stage past the Q stage's index)
        tiles = [(tma.q_nope, smem.q_nope, CONTENT_DIM, 0), (tma.q_rope, smem.q_rope, ROPE_DIM, 0)]
        if cutlass.const_expr(self.cfg.q_split):
            tiles.append((self.q_lo, smem.q_nope, CONTENT_DIM, 1))  # the residual: q_nope's second stage
        parts = []
        for (atom, g), s_tile, dims, at in tiles:
            t_s, t_g = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2),
                cute.group_modes(cute.flat_divide(g, (L.M_TILE, dims)), 0, 2),
            )
            parts.append((atom, t_s, t_g, at))
        return parts

    @cute.jit
    def copy_q(self, parts: list, hq, m_tile: Int32, req: Int32):
        """Request ``req``'s Q tile ``m_tile`` into the Q stage ``hq`` (``q_partitions``)."""
        for atom, t_s, t_g, at in parts:
            dst = t_s[(None, hq.index)] if cutlass.const_expr(at == 0) else t_s[(None, at)]
            cute.copy(atom, t_g[(None, m_tile, 0, req)], dst, tma_bar_ptr=hq.barrier)

    @cute.jit
    def load(self, m_block_table: cute.Tensor, q_prod, kv_prod, m_tile: Int32, work: PartWork):
        """Q and the KV blocks of every request segment of ``work``, in order, through the
        one-stage Q pipeline's and the KV ring's producer participants ``q_prod``, ``kv_prod``."""
        cfg = self.cfg
        tma, smem = self.tma, self.smem
        br = cfg.box_rows
        tma_kv, g_kv = tma.kv
        tma_kr, g_kr = tma.kr
        tma_ks, g_ks = tma.ks
        q_parts = self.q_partitions()
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
        policy = None
        if cutlass.const_expr(cfg.l2_evict_first):
            policy = Int64(L2_EVICT_FIRST)
        for r in cutlass.range(work.n_reqs, unroll=1):
            req = work.begin_req + r
            seqlen, blk_lo, blk_hi = work.block_range(r, req)
            n_entries = (seqlen + cfg.page_size - 1) // cfg.page_size
            hq = q_prod.acquire_and_advance()
            self.copy_q(q_parts, hq, m_tile, req)
            if r == 0 and lane == 0:
                self.tracer.stamp("q_issued")
            # block-table entries 32 at a time, one per lane: one load latency per 32 pages
            # instead of one per KV block on the producer's critical path
            base = Int32(-64)
            cached = Int32(OOB_PAGE)
            for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                hk = kv_prod.acquire_and_advance()
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
                    cute.copy(tma_kv, tkv_g[(None, tile, 0, page)], tkv_s[(None, sub, 0, hk.index)], tma_bar_ptr=hk.barrier,
                              cache_policy=policy)
                    cute.copy(tma_kr, tkr_g[(None, tile, 0, page)], tkr_s[(None, sub, 0, hk.index)], tma_bar_ptr=hk.barrier,
                              cache_policy=policy)
                    cute.copy(tma_ks, tks_g[(None, tile, page)], tks_s[(None, sub, hk.index)], tma_bar_ptr=hk.barrier,
                              cache_policy=policy)
                if r == 0 and blk == blk_lo and lane == 0:
                    self.tracer.stamp("kv_issued")

    @cute.jit
    def load_sparse(self, m_indices: cute.Tensor, ring: KVRing, q_prod, m_tile: Int32, work: PartWork, warp: Int32):
        """The sparse decode's producer, the whole warpgroup: gather warp ``warp`` loads tokens
        ``16·warp .. 16·warp + 15`` of every KV block with cp.async, which writes each
        16-byte chunk where the block's Swizzle-128B tile puts it (a one-row TMA box lands
        in the swizzle phase of an 8-row box, so 7 rows of 8 come out permuted: measured).
        Per token: the slot id from the request's index list, its 512 content bytes and 128
        RoPE bytes (8 lanes, ``gather_block``) and its 4 scale bytes. A list position past the
        list's length, -1, or an id outside the cache reads nothing: zero-filled, so its
        scale is 0, the consumers' mark of a masked key (a written slot's scale is > 0).
        Each thread's copies arrive on the stage's full barrier when they land
        (``cp.async.mbarrier.arrive.noinc``, 128 arrivals: ``KVRing.full_addr``); warp 0
        also loads Q by TMA.
        A block's ids are loaded two blocks ahead, so their latency overlaps the stage waits."""
        tma, smem = self.tma, self.smem
        per_warp = L.BLOCK_N // (roles.THREADS_PER_WG // 32)
        q_parts = self.q_partitions()
        g_kv = tma.kv[1]  # e4m3 (1, 512, slots): the cache rows, read by cp.async
        g_ks = tma.ks[1]  # fp32 (1, slots)
        lane = cute.arch.lane_idx()
        topk = m_indices.shape[1]
        num_slots = g_ks.shape[1]
        g = Int32(0)  # the part's KV blocks so far (stage and phase)
        plan = smem.plan
        for r in cutlass.range(work.n_reqs, unroll=1):
            # the plan's words re-read per request (24 registers: kept live, they spilled)
            req = plan[0] + r
            seqlen = clamp_len(work.m_seqlens[req])
            blk_lo = Int32(0)
            if r == 0:
                blk_lo = plan[1]
            blk_hi = (seqlen + L.BLOCK_N - 1) // L.BLOCK_N
            if req == plan[2]:
                blk_hi = plan[3]
            seqlen = min(seqlen, topk)
            if warp == 0:
                hq = q_prod.acquire_and_advance()
                self.copy_q(q_parts, hq, m_tile, req)
            # ids two blocks ahead (one ahead: 2-4% slower where the gather binds, the ids'
            # load latency then on the producer's path; three: no better than two)
            own = warp * per_warp + lane
            nxt = self.gather_id(m_indices, req, blk_lo * L.BLOCK_N + own, seqlen, num_slots, lane < per_warp)
            nxt2 = self.gather_id(m_indices, req, (blk_lo + 1) * L.BLOCK_N + own, seqlen, num_slots, lane < per_warp)
            for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                slot = nxt
                nxt = nxt2
                # no bound test: ids past the part's end (inside the list) are loaded and
                # unused; past the list gather_id loads nothing (OOB_PAGE)
                nxt2 = self.gather_id(m_indices, req, (blk + 2) * L.BLOCK_N + own, seqlen, num_slots, lane < per_warp)
                stage = ring.wait_free(g)
                self.gather_block(g_kv, g_ks, slot, stage, warp, lane, per_warp)
                ptx.cp_async_arrive_noinc(ring.full_addr(stage))
                g += 1

    @cute.jit
    def gather_block(self, g_kv: cute.Tensor, g_ks: cute.Tensor, slot: Int32, stage: Int32, warp: Int32, lane: Int32,
                     per_warp: cutlass.Constexpr):
        """This warp's tokens of one block into KV stage ``stage``; lane l holds token ``16·warp
        + l``'s slot (``OOB_PAGE``: no token). 8 lanes per token: lane l copies 16-byte column
        ``l % 8`` of token ``16·warp + 4k + l/8``'s five 128-byte lines (4 content, 1 RoPE)
        for k = 0..3, so a copy fills 4 whole lines, and a lane's 5 copies of a token share
        one source address (the lines as immediates) and one swizzled destination (content
        chunks 8 KB apart; the rows 4 apart by ``layouts.smem.sw128_row_step``): per token
        group a shuffle of the slot, an address multiply-add, the predicate and two XORs for
        5 copies; then lanes 0-15 copy their own token's scale. A missing token's copies ignore
        their source (zero fill). Against a warp per token row (a shuffle, a multiply-add
        and the copy per 16-byte chunk; 996ee9b's parent): 7% faster at b128 h128
        topk2048, 1-3% at most other rows."""
        smem = self.smem
        row_bytes = KV_ROW_BYTES
        lane = ptx.launder(lane, stage)
        c = lane % 8
        t0 = lane // 8
        row0 = warp * per_warp + t0  # row0 % 8 < 4: steps of 4 rows are row moves
        kv_lane = (smem.kv_addr() + stage * (L.BLOCK_N * CONTENT_DIM) + L.content_offset(row0, c * 16))
        kr_lane = (smem.storage.k_rope.data_ptr().toint() + stage * (L.BLOCK_N * ROPE_DIM * 2)
                   + L.rope_offset(row0, c * 8))
        g_lane = g_kv.iterator.toint() + Int64(c * 16)
        ks_base = g_ks.iterator.toint()
        policy = None
        if cutlass.const_expr(self.cfg.l2_evict_first):
            policy = ptx.l2_evict_first_policy()
        for k in cutlass.range_constexpr(per_warp // 4):
            s = cute.arch.shuffle_sync(slot, 4 * k + t0)
            read = Int32(s != OOB_PAGE)
            src = g_lane + Int64(s) * row_bytes
            dst = L.sw128_row_step(kv_lane, 4 * k)
            for seg in cutlass.range_constexpr(CONTENT_DIM // 128):
                ptx.cp_async_or_zero(dst + seg * L.CHUNK_BYTES, src + seg * 128, 16, read, policy)
            ptx.cp_async_or_zero(L.sw128_row_step(kr_lane, 4 * k), src + CONTENT_DIM, 16, read, policy)
        # the scales: lane l < 16 its own token's, one copy (4 lanes per group cost 4)
        if lane < per_warp:
            dst = smem.storage.k_scale.data_ptr().toint() + (stage * L.BLOCK_N + warp * per_warp + lane) * 4
            ptx.cp_async_or_zero(dst, ks_base + Int64(slot) * 4, 4, Int32(slot != OOB_PAGE), policy)

    @cute.jit
    def gather_id(self, m_indices: cute.Tensor, req: Int32, pos: Int32, seqlen: Int32, num_slots: Int32,
                  lane_used) -> Int32:
        """The slot id at list position ``pos`` of request ``req``, or ``OOB_PAGE``: past the
        list's length (at most its ``topk`` entries), -1, or outside the cache (never
        dereferenced)."""
        slot = Int32(OOB_PAGE)
        if lane_used and pos < seqlen:
            v = m_indices[req, pos]
            if v >= 0 and v < num_slots:
                slot = v
        return slot
