"""Role: a consumer warpgroup's 256 output dims of a request, normalized, out to global memory.

o/ℓ per row, as bf16 into ``out`` (a request the part holds whole) or into its split's
partial row (a split request, merged later by ``merge``: f16 with a power-of-two scale per
row up to ``MERGE_FEW`` splits, ``partial_views``; fp32 past them), with the LSE; or, in the
cluster plan, exchanged with the cluster's other CTAs through distributed shared memory and
merged there (``cluster_epilogue``). Each warp stages its rows through a 1 KB shared buffer
so the stores leave as 16-byte accesses covering whole 128-byte lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32

import cutlass.pipeline as pipeline

from snapmla_cute import ptx
from snapmla_cute.kernels.decode.args import DecodeOutputs, RequestEnd
from snapmla_cute.kernels.decode.config import (
    EPI_BYTES, EPI_ROW_BYTES, EPI_ROWS, MERGE_FEW, MERGE_WAIT_LIMIT_NS, PV_SPLITS, DecodeConfig,
)
from snapmla_cute.kernels.decode.merge import Merger
from snapmla_cute.kernels.decode.softmax import tree
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.layouts import mma as M
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles
from snapmla_cute.pipelines.handshakes import ClusterExchange


@dataclass(frozen=True)
class StoreSpot:
    """Where a thread's rows of a tile leave from (``Epilogue.store_tile``): the m-tile, its
    consumer WG and index in it, and its warp's staging buffer (shared address)."""

    m_tile: Int32
    wg: Int32
    wg_tidx: Int32
    buf: Int32


@dataclass(frozen=True)
class Epilogue:
    """The consumers' epilogue: ``io`` receives the results; ``pv_mma`` is the PV MMA whose
    accumulator layout the output tiles have; the per-warp staging buffers follow the KV
    stages' ``kv_smem_bytes`` (``storage.shared_storage``); ``tracer`` stamps the cluster
    merge's steps (profiling only); ``merger`` holds the final LSE and the cluster merges."""

    cfg: DecodeConfig
    io: DecodeOutputs
    pv_mma: cute.TiledMma
    kv_smem_bytes: int
    tracer: Tracer
    merger: Merger

    @cute.jit
    def epilogue(self, end: RequestEnd, split_row: Int32, n_splits: Int32, amax_addr: Int32):
        """This WG's 256 output columns, normalized by ℓ: bf16 into ``out`` (an unsplit
        request) or into its split's partial row ``split_row`` of ``n_splits`` (f16 and a
        scale, or fp32); and the LSE. ``amax_addr``: the two WGs' row maxima (shared)."""
        cfg = self.cfg
        io, pv_mma_rs = self.io, self.pv_mma
        acc_o_mn, m_tile, req, wg, wg_tidx, kv_addr = end.acc_o_mn, end.m_tile, end.req, end.wg, end.wg_tidx, end.kv_addr
        row_max, sigma_p, row_sum = end.state
        # this thread's coordinates from a laundered index: derived from the thread index
        # before the block loop, ptxas kept (and, in causal variants, spilled) them
        wg_tidx = ptx.launder(wg_tidx, req)
        pv_n = cfg.pv_n
        c_o = pv_mma_rs.get_slice(wg_tidx).partition_C(cute.make_identity_tensor((L.M_TILE, pv_n)))
        c_o_mn = cute.make_tensor(c_o.iterator, M.acc_mn_layout(pv_mma_rs, c_o.layout))
        rows_per_thr = cute.size(c_o_mn, mode=[0])
        inv = cute.make_rmem_tensor((rows_per_thr,), Float32)
        for i in cutlass.range_constexpr(rows_per_thr):
            row = m_tile * L.M_TILE + c_o_mn[i, 0][0]
            lse = self.merger.row_lse(inv, i, row_max[i], sigma_p[i], row_sum[i], end.any_blocks)
            # a split's LSE is written by both WGs (the same value); the CTA counts its
            # split only after both WGs' writes (finish_split)
            if row < cfg.rows and wg_tidx % 4 == 0:
                if n_splits == 1:
                    if wg == 0:
                        io.lse[req, row % cfg.heads, row // cfg.heads] = lse
                else:
                    io.lse_partial[row, split_row] = lse
        warp = wg * (roles.THREADS_PER_WG // 32) + wg_tidx // 32
        buf = kv_addr + self.kv_smem_bytes + warp * EPI_BYTES  # storage.epi (checked at launch)
        spot = StoreSpot(m_tile, wg, wg_tidx, buf)
        if n_splits == 1:
            self.store_tile(acc_o_mn, c_o_mn, inv, io.out, req, BFloat16, spot)
        elif n_splits <= MERGE_FEW:
            # few splits (many requests: the partials' traffic counts) as f16, each row
            # normalized by a power of two (its largest |value| to [2^14, 2^15)) with 1/f
            # kept beside it: half fp32's bytes, f16's 11 bits against e4m3's 4 in V, and
            # no range limit for row maxima over 2^-112 (a bf16 partial's 8 bits, rounded
            # twice, failed the emulation's tolerance). Both WGs' maxima meet in shared
            # memory, so the merge keeps one weight per split. More splits (small batches,
            # where a partial's latency counts, not its bytes; one-block splits were slower
            # as f16) stay fp32.
            o16, scales = io.partial_views(req)
            post = cute.make_rmem_tensor((rows_per_thr,), Float32)
            s_amax = cute.make_tensor(cute.make_ptr(Float32, amax_addr, cute.AddressSpace.smem, assumed_align=16),
                                      cute.make_layout((L.M_TILE, 2), stride=(1, L.M_TILE)))
            # no barrier before the writes: the other WG's reads of s_amax (its previous split)
            # precede its arrival at that split's finish_split pair barrier
            pair = pipeline.NamedBarrier(barrier_id=int(roles.Barrier.PAIR_SYNC), num_threads=roles.PAIR_THREADS)
            for i in cutlass.range_constexpr(rows_per_thr):
                amax = tree([cute.arch.fmax(acc_o_mn[h][i, j], -acc_o_mn[h][i, j]) for h in range(PV_SPLITS)
                             for j in range(cute.size(c_o_mn, mode=[1]))], cute.arch.fmax) * inv[i]
                for off in (1, 2):  # the quad holding the row
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
                post[i] = amax
                if wg_tidx % 4 == 0:
                    s_amax[c_o_mn[i, 0][0], wg] = amax
            pair.arrive_and_wait()
            for i in cutlass.range_constexpr(rows_per_thr):
                f, inv_f = ptx.pow2_normalizer(cute.arch.fmax(post[i], s_amax[c_o_mn[i, 0][0], 1 - wg]))
                post[i] = f
                row = m_tile * L.M_TILE + c_o_mn[i, 0][0]
                if row < cfg.rows and wg == 0 and wg_tidx % 4 == 0:
                    scales[row, split_row] = inv_f
            self.store_tile(acc_o_mn, c_o_mn, inv, o16, split_row, Float16, spot, post=post)
        else:
            self.store_tile(acc_o_mn, c_o_mn, inv, io.o_partial, split_row, Float32, spot)

    @cute.jit
    def cluster_epilogue(self, end: RequestEnd, mbar_addr: Int32):
        """The cluster plan's end: this CTA (rank q of k) holds o/ℓ and the LSE of a k-th of
        the request's blocks. Rank d owns rows [Rd, R(d+1)), R = ``cluster_rows_per_rank``:
        every CTA sends the rows it does not own (only those below ``cfg.rows``: none past
        them is ever written) to their owners' idle KV stages (distributed shared memory,
        each thread its own accumulator values, so sender and receiver share one layout),
        then merges the rows it owns (lse = log Σ exp(lse_q), o = Σ exp(lse_q - lse)·o_q) and
        writes them as bf16: in the holders' registers, or with ``cluster_merge_spread`` by
        every consumer thread (``spread_merge``). Two mbarriers order it: ``free`` (the
        peers' stages are idle, one arrival per peer) and ``data`` (every sending thread's
        rows have arrived): ``pipelines.handshakes.ClusterExchange``."""
        cfg = self.cfg
        io, pv_mma_rs = self.io, self.pv_mma
        k = cfg.cluster
        acc_o_mn, m_tile, req, wg, wg_tidx, kv_addr = end.acc_o_mn, end.m_tile, end.req, end.wg, end.wg_tidx, end.kv_addr
        row_max, sigma_p, row_sum = end.state
        wg_tidx = ptx.launder(wg_tidx, req)
        c_o = pv_mma_rs.get_slice(wg_tidx).partition_C(cute.make_identity_tensor((L.M_TILE, cfg.pv_n)))
        c_o_mn = cute.make_tensor(c_o.iterator, M.acc_mn_layout(pv_mma_rs, c_o.layout))
        rows_per_thr = cute.size(c_o_mn, mode=[0])
        vals = cute.size(c_o_mn, mode=[1])  # per row and PV split
        vecs = PV_SPLITS * vals // 4  # 16-byte vectors per row
        rows_per_rank = cfg.cluster_rows_per_rank
        span = rows_per_rank * k  # the rows owned: past them, dead rows none sends or merges
        blocks8 = max(rows_per_rank // 8, 1)  # 8-row slabs a rank owns (one: 1-4 rows of one slab)
        lse_off, _ = cfg.cluster_recv_bytes
        # the peers as a loop ptxas keeps (a one-trip loop unrolled for k = 2 let it hoist all
        # of a peer's 16 loads above the scaling, and spill)
        peers = ptx.launder(Int32(k - 1), req)
        inv = cute.make_rmem_tensor((rows_per_thr,), Float32)
        lse = cute.make_rmem_tensor((rows_per_thr,), Float32)
        for i in cutlass.range_constexpr(rows_per_thr):
            self.merger.row_lse_into(inv, lse, i, row_max[i], sigma_p[i], row_sum[i], end.any_blocks)
        # laundered like wg_tidx: values hoisted above the block loop were spilled there
        rank = ptx.launder(cute.arch.block_idx_in_cluster(), req)
        mbar_addr = ptx.launder(mbar_addr, req)
        lane = wg_tidx % 32
        ctid = wg * roles.THREADS_PER_WG + wg_tidx
        exchange = ClusterExchange.make(mbar_addr, k, MERGE_WAIT_LIMIT_NS)
        # both WGs are past their last PV: this CTA's stages are idle; tell every peer
        pair = pipeline.NamedBarrier(barrier_id=int(roles.Barrier.PAIR_SYNC), num_threads=roles.PAIR_THREADS)
        pair.arrive_and_wait()
        exchange.stages_idle(ctid, rank)
        exchange.wait_free()
        if cutlass.const_expr(cfg.trace):
            if wg_tidx == 0:
                self.tracer.stamp("count_seen", wg)  # here: every peer's stages free
        # send the rows other ranks own: slot = my index among the owner's peers
        for i in cutlass.range_constexpr(rows_per_thr):
            row = c_o_mn[i, 0][0]
            owner = self.merger.owner(row)
            if cutlass.const_expr(span < L.M_TILE):
                if row >= span:
                    owner = rank
            if owner != rank:
                slot = rank
                if rank > owner:
                    slot = rank - 1
                pidx = self.merger.owned_slab(row, owner)
                base = kv_addr + ((slot * 2 + wg) * blocks8 + pidx) * vecs * 512 + lane * 16
                rbase = ptx.mapa(base, owner)
                # fewer rows than the tile (8-32 heads, one tile): the rows past them are
                # never written, so they are not sent (at h8 that is 56 of 64); the owner
                # merges whatever its stage holds there and drops it
                send = True
                if cutlass.const_expr(cfg.rows < L.M_TILE):
                    send = row < cfg.rows
                if send:
                    for v in cutlass.range_constexpr(vecs):
                        h = 4 * v // vals
                        j = 4 * v % vals
                        ptx.st_cluster_v4(
                            rbase + v * 512, acc_o_mn[h][i, j] * inv[i], acc_o_mn[h][i, j + 1] * inv[i],
                            acc_o_mn[h][i, j + 2] * inv[i], acc_o_mn[h][i, j + 3] * inv[i],
                        )
                    if wg == 0 and lane % 4 == 0:
                        ptx.st_cluster_f32(ptx.mapa(kv_addr + lse_off + (slot * L.M_TILE + row) * 4, owner),
                                           lse[i])
                exchange.rows_sent(owner)
        exchange.wait_rows()
        if cutlass.const_expr(cfg.trace):
            if wg_tidx == 0:
                self.tracer.stamp("merged", wg)  # here: every peer's rows arrived
        if cutlass.const_expr(cfg.cluster_merge_spread):
            # this rank's own rows into the last slot, once the peers' have arrived (with the
            # accumulator dead before the wait, ptxas spilled it in finish_blocks)
            recv = cute.make_tensor(cute.make_ptr(Float32, kv_addr, cute.AddressSpace.smem, assumed_align=16),
                                    cute.make_layout((cfg.cluster_recv_bytes[1] // 4,)))
            for i in cutlass.range_constexpr(rows_per_thr):
                row = c_o_mn[i, 0][0]
                if self.merger.owner(row) == rank:
                    pidx = self.merger.owned_slab(row, rank)
                    base = (((k - 1) * 2 + wg) * blocks8 + pidx) * vecs * 512 + lane * 16
                    for v in cutlass.range_constexpr(vecs):
                        h = 4 * v // vals
                        j = 4 * v % vals
                        x = cute.make_rmem_tensor((4,), Float32)
                        for e in cutlass.range_constexpr(4):
                            x[e] = acc_o_mn[h][i, j + e] * inv[i]
                        cute.autovec_copy(x, cute.local_tile(recv, (4,), ((base + v * 512) // 16,)))
                    if wg == 0 and lane % 4 == 0:
                        recv[lse_off // 4 + (k - 1) * L.M_TILE + row] = lse[i]
            self.merger.spread_merge(recv, pv_mma_rs, vals, rank, m_tile, req, wg * roles.THREADS_PER_WG + wg_tidx)
        else:
            one = self.merger.cluster_rows(acc_o_mn, c_o_mn, lse, inv, end, rank, peers, lane)
            warp = wg * (roles.THREADS_PER_WG // 32) + wg_tidx // 32
            buf = kv_addr + self.kv_smem_bytes + warp * EPI_BYTES
            self.store_tile(acc_o_mn, c_o_mn, one, io.out, req, BFloat16, StoreSpot(m_tile, wg, wg_tidx, buf),
                            owner_rank=rank)

    @cute.jit
    def store_tile(self, acc_o_mn: list, c_o_mn: cute.Tensor, inv: cute.Tensor, m_dst: cute.Tensor, idx: Int32,
                   dtype: cutlass.Constexpr, spot: StoreSpot, owner_rank=None, post: cute.Tensor = None):
        """o·inv (per row; then ·post, per row, where given) as ``dtype`` into ``m_dst[row,
        wg's columns, idx]`` through a 1 KB shared buffer per warp (8 rows x 128 bytes;
        ``owner_rank``: only the rows that cluster rank owns): a warp's accumulator holds 16
        rows, 8 per pass (lane // 4, plus 8 in the second). Pairs of columns go to shared
        memory (16-byte units XOR-swizzled by row: no bank conflicts either way) and leave
        as 16-byte stores covering whole 128-byte lines. Stored straight from the
        accumulator, a warp's store touches 8 rows' lines for 8 (4) bytes a lane, and the
        per-line cost of the store path made the tile's writes the tail of a short split."""
        cfg = self.cfg
        m_tile, wg, wg_tidx, buf = spot.m_tile, spot.wg, spot.wg_tidx, spot.buf
        pv_n = cfg.pv_n
        ebytes = dtype.width // 8
        chunk_cols = EPI_ROW_BYTES // ebytes  # columns per pass
        per_unit = 16 // ebytes
        units = EPI_ROW_BYTES // 16
        vals = chunk_cols // 4  # this thread's accumulator values per row per pass
        lane = wg_tidx % 32
        s_buf = cute.make_tensor(
            cute.make_ptr(dtype, buf, cute.AddressSpace.smem, assumed_align=16),
            cute.make_layout((EPI_ROWS, chunk_cols), stride=(chunk_cols, 1)),
        )
        for h in cutlass.range_constexpr(PV_SPLITS):
            for ch in cutlass.range_constexpr(pv_n // chunk_cols):
                col0 = (wg * PV_SPLITS + h) * pv_n + ch * chunk_cols
                for i in cutlass.range_constexpr(cute.size(c_o_mn, mode=[0])):
                    for j in cutlass.range_constexpr(ch * vals, (ch + 1) * vals, 2):
                        lr = c_o_mn[i, j][0] % EPI_ROWS
                        lc = c_o_mn[i, j][1] - ch * chunk_cols
                        sc = ((lc // per_unit) ^ lr) * per_unit + lc % per_unit
                        pair = cute.make_rmem_tensor((2,), dtype)
                        if cutlass.const_expr(post is None):
                            pair[0] = (acc_o_mn[h][i, j] * inv[i]).to(dtype)
                            pair[1] = (acc_o_mn[h][i, j + 1] * inv[i]).to(dtype)
                        else:
                            pair[0] = (acc_o_mn[h][i, j] * inv[i] * post[i]).to(dtype)
                            pair[1] = (acc_o_mn[h][i, j + 1] * inv[i] * post[i]).to(dtype)
                        cute.autovec_copy(pair, cute.local_tile(s_buf[lr, None], (2,), (sc // 2,)))
                    cute.arch.sync_warp()
                    # the first row of this pass: the warp's 16-row slab, then 8 more
                    row0 = m_tile * L.M_TILE + c_o_mn[i, 0][0] - lane // 4
                    for k in cutlass.range_constexpr(EPI_ROWS * units // 32):
                        item = lane + 32 * k
                        lr = item // units
                        u = item % units
                        v = cute.make_rmem_tensor((per_unit,), dtype)
                        cute.autovec_copy(cute.local_tile(s_buf[lr, None], (per_unit,), (u ^ lr,)), v)
                        if cutlass.const_expr(owner_rank is None):
                            if row0 + lr < cfg.rows and not cutlass.const_expr("store" in cfg.skip):
                                cute.autovec_copy(
                                    v, cute.local_tile(m_dst[row0 + lr, None, idx], (per_unit,), (col0 // per_unit + u,))
                                )
                        else:
                            # the cluster merge: only the rows this rank owns (with 64/k rows a
                            # rank, a pass's 8 rows share one owner; with the live rows spread,
                            # they may have several)
                            owned = row0
                            if cutlass.const_expr(cfg.cluster_rows_per_rank != L.M_TILE // cfg.cluster):
                                owned = row0 + lr
                            if (row0 + lr < cfg.rows and self.merger.owner(owned % L.M_TILE) == owner_rank
                                    and not cutlass.const_expr("store" in cfg.skip)):
                                cute.autovec_copy(
                                    v, cute.local_tile(m_dst[row0 + lr, None, idx], (per_unit,), (col0 // per_unit + u,))
                                )
                    cute.arch.sync_warp()
