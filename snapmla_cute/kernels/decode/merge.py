"""Role: every merge of a request's partial results, inside the decode launch (no combine
kernel), and the final LSE of a row (``row_lse``), computed here once for every path.

* The split merge (``finish_split``), through global memory. The launch is cooperative, so
  every part's CTA is resident and a CTA may wait for others. Each split of a request counts
  itself (``counters``) once its partial result is written. Splits 0..n-2 process their
  request last in their part; they, and the idle parts the plan sends to help, wait for the
  count and merge a share of its rows each: lse = max + log Σ exp(lse_s - max), out = Σ
  exp(lse_s - lse)·O_s, summed in fp32. A request of at most ``MERGE_FEW`` splits merges
  batched (a thread per row for the LSE, several 8-dim items per thread with all their
  splits' loads issued together) from f16 partials with a power-of-two scale per row
  (``DecodeOutputs.partial_views``; the scale folds into the split's weight); more splits
  merge fp32 partials, a warp per row and an item per thread at a time. The last split
  processes the request first in its part and goes on. The last merger resets the counters
  for the next call.
* The cluster merges (the cluster plan: a request's k-ths on the k CTAs of a cluster), of
  the rows each rank owns (``owner``) once ``Epilogue.cluster_epilogue`` has exchanged them
  through distributed shared memory: in the holders' registers (``cluster_rows``), or by
  every consumer thread where a rank owns only a few live rows (``spread_merge``).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float16, Float32, Int32

from snapmla_cute import ptx
from snapmla_cute.format import CONTENT_DIM
from snapmla_cute.kernels.decode.args import DecodeOutputs, RequestEnd
from snapmla_cute.kernels.decode.config import (
    LN2, MERGE_BATCH, MERGE_FEW, MERGE_MAX_SPLITS, MERGE_W_OFFSET, MERGE_WAIT_LIMIT_NS, PV_SPLITS, DecodeConfig,
)
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.layouts import mma as M
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles


@dataclass(frozen=True)
class SplitRows:
    """A split request's rows in the partial buffers, as a merge reads them: its m-tile and
    request, its first split row and its splits."""

    m_tile: Int32
    req: Int32
    first: Int32
    n_splits: Int32


@dataclass(frozen=True)
class Merger:
    """The merges of a request's partials into ``io``: the split merge, run by the consumer
    warpgroups of its last split, of its other splits and of parts the plan left idle; the
    cluster merges, run by the epilogue of every CTA of the request's cluster."""

    cfg: DecodeConfig
    tracer: Tracer
    io: DecodeOutputs

    @cute.jit
    def lse_of(self, row_max: Float32, sigma_p: Float32, ell: Float32) -> Float32:
        """A row's LSE from its softmax state (m in log2 units, σ_p, ℓ > 0): the natural log of
        Σ exp(s) = 2^m·σ_p·ℓ. Every path's final LSE is this one (``row_lse``,
        ``row_lse_into``)."""
        return (row_max + cute.math.log2(sigma_p * ell, fastmath=False)) * Float32(LN2)

    @cute.jit
    def row_lse(self, inv: cute.Tensor, i: int, row_max: Float32, sigma_p: Float32, row_sum: Float32, any_blocks):
        """Row ``i``'s 1/ℓ into ``inv[i]`` and its LSE returned; (0, -inf) for a row with no
        key (ℓ = 0, or no block)."""
        ell = row_sum
        if not any_blocks:
            ell = 0.0
        inv[i] = Float32(0.0)
        lse = -Float32.inf
        if ell > 0.0:
            inv[i] = Float32(1.0) / ell
            lse = self.lse_of(row_max, sigma_p, ell)
        return lse

    @cute.jit
    def row_lse_into(self, inv: cute.Tensor, lse: cute.Tensor, i: int, row_max: Float32, sigma_p: Float32,
                     row_sum: Float32, any_blocks):
        """``row_lse`` with the LSE into ``lse[i]`` (the cluster epilogue keeps every row's)."""
        ell = row_sum
        if not any_blocks:
            ell = 0.0
        inv[i] = Float32(0.0)
        lse[i] = -Float32.inf
        if ell > 0.0:
            inv[i] = Float32(1.0) / ell
            lse[i] = self.lse_of(row_max, sigma_p, ell)

    @cute.jit
    def merger_count(self, n_splits: Int32, helpers: Int32, req: Int32, batch: Int32):
        """Mergers of a split request: its splits 0..n-2, plus the idle parts k < ``helpers``
        with k mod b = req (the plan's helper assignment)."""
        n = n_splits - 1
        if helpers > req:
            n += (helpers - 1 - req) // batch + 1
        return n

    @cute.jit
    def finish_split(
        self, kv_addr: Int32, m_tile: Int32, req: Int32, first: Int32, split: Int32, n_splits: Int32,
        n_mergers: Int32, ctid: Int32, is_split: cutlass.Constexpr,
    ):
        """A split's end (``is_split``: count this split, and merge unless it is the last) or
        an idle part's merge share (``split`` is then its merger index). ``first``: the
        request's first split row; ``n_mergers`` share the rows; ``ctid``: 0..255 over both
        consumer WGs."""
        cfg = self.cfg
        io = self.io
        m_out, m_lse, m_o_partial, m_lse_partial, m_counters = io.out, io.lse, io.o_partial, io.lse_partial, io.counters
        ctid = ptx.launder(ctid, req)  # its index math is not hoisted into the block loop (spills)
        pair = pipeline.NamedBarrier(barrier_id=int(roles.Barrier.PAIR_SYNC), num_threads=roles.PAIR_THREADS)
        cnt_ptr = m_counters.iterator + cute.crd2idx((req, 2 * m_tile), m_counters.layout)
        done_ptr = m_counters.iterator + cute.crd2idx((req, 2 * m_tile + 1), m_counters.layout)
        # the cooperative-groups grid-sync pattern: one thread fences for the CTA after a
        # barrier (the fence is cumulative over the writes the barrier ordered before it)
        if cutlass.const_expr(is_split):
            pair.arrive_and_wait()
            if ctid == 0:
                cute.arch.fence_acq_rel_gpu()  # the pair's partial writes, before the count
                cute.arch.atomic_add(cnt_ptr, Int32(1), sem="release", scope="gpu")
        if split < n_splits - 1 or not is_split:
            if ctid == 0:
                # bounded: a count that never arrives is a bug; fail the launch, never hang
                t0 = cute.arch.globaltimer()
                seen = cute.arch.load(cnt_ptr, Int32, sem="acquire", scope="gpu")
                while seen < n_splits:
                    if cute.arch.globaltimer() - t0 > MERGE_WAIT_LIMIT_NS:
                        ptx.trap()
                    seen = cute.arch.load(cnt_ptr, Int32, sem="acquire", scope="gpu")
                cute.arch.fence_acq_rel_gpu()  # every split's writes, after the count
                self.tracer.stamp("count_seen")
            pair.arrive_and_wait()
            n_p = n_mergers
            r0 = split * L.M_TILE // n_p
            r1 = (split + 1) * L.M_TILE // n_p
            r1 = cutlass.min(r1, cfg.rows - m_tile * L.M_TILE)
            nrows = r1 - r0
            # the KV stages are idle now (this is the part's last request): scratch
            s_lse = cute.make_tensor(cute.make_ptr(Float32, kv_addr, cute.AddressSpace.smem, assumed_align=16), cute.make_layout((L.M_TILE,)))
            # 1. final LSE of each row of the share, a warp per row and a lane per split (all
            # of a row's loads in flight at once; more than MERGE_FEW splits, else a thread
            # per row: few_split_lse); the splits' weights exp(lse_s - lse) go to
            # shared memory for step 2, so its loads do not wait on an exp
            s_w = cute.make_tensor(
                cute.make_ptr(Float32, kv_addr + MERGE_W_OFFSET, cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((L.M_TILE, MERGE_MAX_SPLITS), stride=(MERGE_MAX_SPLITS, 1)),
            )
            warp = ctid // 32
            lane = ctid % 32
            warp_rows = nrows  # rows merged a warp per row
            few = n_splits <= MERGE_FEW  # batched over rows and items
            if few:
                warp_rows = 0
                # a thread per row, its splits' loads issued together (rows <= 64 < threads)
                if ctid < nrows:
                    _, m_scales = io.partial_views(req)
                    self.few_split_lse(SplitRows(m_tile, req, first, n_splits), r0 + ctid, ctid, m_scales, s_w, s_lse)
            for lr in cutlass.range(warp, warp_rows, roles.PAIR_THREADS // 32, unroll=1):
                row = m_tile * L.M_TILE + r0 + lr
                lse_max = -Float32.inf
                for sp in cutlass.range(lane, n_splits, 32, unroll=1):
                    v = m_lse_partial[row, first + sp]
                    s_w[lr, sp] = v
                    lse_max = cute.arch.fmax(lse_max, v)
                lse_max = cute.arch.warp_reduction_max(lse_max)
                total = Float32(0.0)
                if lse_max != -Float32.inf:
                    for sp in cutlass.range(lane, n_splits, 32, unroll=1):
                        total += cute.math.exp(s_w[lr, sp] - lse_max)
                total = cute.arch.warp_reduction_sum(total)
                lse = -Float32.inf
                if lse_max != -Float32.inf:
                    lse = lse_max + cute.math.log(total)
                for sp in cutlass.range(lane, n_splits, 32, unroll=1):
                    w = Float32(0.0)
                    if lse != -Float32.inf:
                        w = cute.math.exp(s_w[lr, sp] - lse)
                    s_w[lr, sp] = w
                if lane == 0:
                    s_lse[lr] = lse
                    m_lse[req, row % cfg.heads, row // cfg.heads] = lse
            pair.arrive_and_wait()
            # 2. out rows: items (row, 8 dims); with few items the splits are shared out too
            # (G groups, summed through shared memory)
            n_items = nrows * (CONTENT_DIM // 8)
            G = Int32(1)
            g_items = n_items
            if few:
                g_items = Int32(roles.PAIR_THREADS)  # G = 1: the f16 partials are few_split_rows' only
            if g_items * 2 <= roles.PAIR_THREADS:
                G = 2
            if g_items * 4 <= roles.PAIR_THREADS:
                G = 4
            if g_items * 8 <= roles.PAIR_THREADS:
                G = 8
            per_g = roles.PAIR_THREADS // G
            g = ctid // per_g
            s_acc = cute.make_tensor(
                cute.make_ptr(Float32, kv_addr + 1024, cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((8, roles.PAIR_THREADS), stride=(1, 8)),
            )
            item_end = n_items  # items merged one per thread at a time
            if few:
                item_end = 0
                o16, _ = io.partial_views(req)
                # half as many splits: twice the items per thread at once
                split_rows = SplitRows(m_tile, req, first, n_splits)
                if n_splits <= MERGE_FEW // 2:
                    self.few_split_rows(split_rows, r0, n_items, ctid, o16, s_w, s_lse, MERGE_FEW // 2)
                else:
                    self.few_split_rows(split_rows, r0, n_items, ctid, o16, s_w, s_lse, MERGE_FEW)
            for it in cutlass.range(ctid % per_g, item_end, per_g, unroll=1):
                lr = it // (CONTENT_DIM // 8)
                d = (it % (CONTENT_DIM // 8)) * 8
                row = m_tile * L.M_TILE + r0 + lr
                lse = s_lse[lr]
                acc = cute.make_rmem_tensor((8,), Float32)
                acc.fill(0.0)
                if lse != -Float32.inf:
                    # MERGE_BATCH splits' loads issued together (predicated), then added in
                    # split order: as a plain loop, ptxas waited for each load in turn
                    for sp0 in cutlass.range(g, n_splits, G * MERGE_BATCH, unroll=1):
                        src = [cute.make_rmem_tensor((8,), Float32) for _ in range(MERGE_BATCH)]
                        ws = cute.make_rmem_tensor((MERGE_BATCH,), Float32)
                        for u in cutlass.range_constexpr(MERGE_BATCH):
                            sp = sp0 + u * G
                            src[u].fill(0.0)
                            ws[u] = 0.0
                            if sp < n_splits:
                                ws[u] = s_w[lr, sp]
                                cute.autovec_copy(cute.local_tile(m_o_partial[row, None, first + sp], (8,), (d // 8,)), src[u])
                        for u in cutlass.range_constexpr(MERGE_BATCH):
                            acc.store(acc.load() + src[u].load() * ws[u])
                if G == 1:
                    res = cute.make_rmem_tensor((8,), BFloat16)
                    res.store(acc.load().to(BFloat16))
                    cute.autovec_copy(res, cute.local_tile(m_out[row, None, req], (8,), (d // 8,)))
                else:
                    cute.autovec_copy(acc, s_acc[None, ctid])
            if G > 1:
                pair.arrive_and_wait()
                it = ctid
                if ctid < n_items:
                    lr = it // (CONTENT_DIM // 8)
                    d = (it % (CONTENT_DIM // 8)) * 8
                    row = m_tile * L.M_TILE + r0 + lr
                    acc = cute.make_rmem_tensor((8,), Float32)
                    acc.fill(0.0)
                    for gg in cutlass.range(G, unroll=1):
                        src = cute.make_rmem_tensor((8,), Float32)
                        cute.autovec_copy(s_acc[None, gg * per_g + it], src)
                        acc.store(acc.load() + src.load())
                    res = cute.make_rmem_tensor((8,), BFloat16)
                    res.store(acc.load().to(BFloat16))
                    cute.autovec_copy(res, cute.local_tile(m_out[row, None, req], (8,), (d // 8,)))
            # the last merger resets the counters for the next call
            pair.arrive_and_wait()
            if ctid == 0:
                self.tracer.stamp("merged")
                old = cute.arch.atomic_add(done_ptr, Int32(1), sem="acq_rel", scope="gpu")
                if old == n_p - 1:
                    m_counters[req, 2 * m_tile] = 0
                    m_counters[req, 2 * m_tile + 1] = 0

    @cute.jit
    def few_split_lse(self, split_rows: SplitRows, share_row: Int32, lr: Int32, m_scales: cute.Tensor,
                      s_w: cute.Tensor, s_lse: cute.Tensor):
        """The final LSE of one row of a request of at most ``MERGE_FEW`` splits and its
        splits' weights exp(lse_s - lse) times their f16 partials' 1/f, by one thread."""
        cfg = self.cfg
        m_tile, req, first, n_splits = split_rows.m_tile, split_rows.req, split_rows.first, split_rows.n_splits
        m_lse, m_lse_partial = self.io.lse, self.io.lse_partial
        F = MERGE_FEW
        row = m_tile * L.M_TILE + share_row
        v = cute.make_rmem_tensor((F,), Float32)
        sc = cute.make_rmem_tensor((F,), Float32)
        for u in cutlass.range_constexpr(F):
            v[u] = -Float32.inf
            sc[u] = Float32(0.0)
            if u < n_splits:
                v[u] = m_lse_partial[row, first + u]
                sc[u] = m_scales[row, first + u]
        lse_max = v[0]
        for u in cutlass.range_constexpr(1, F):
            lse_max = cute.arch.fmax(lse_max, v[u])
        lse = -Float32.inf
        if lse_max != -Float32.inf:
            total = Float32(0.0)
            for u in cutlass.range_constexpr(F):
                total += cute.math.exp(v[u] - lse_max)  # exp(-inf) = 0 past n_splits
            lse = lse_max + cute.math.log(total)
        for u in cutlass.range_constexpr(F):
            w = Float32(0.0)
            if lse != -Float32.inf:
                w = cute.math.exp(v[u] - lse)
            s_w[lr, u] = w * sc[u]
        s_lse[lr] = lse
        m_lse[req, row % cfg.heads, row // cfg.heads] = lse

    @cute.jit
    def few_split_rows(self, split_rows: SplitRows, r0: Int32, n_items: Int32, ctid: Int32, m_o_partial: cute.Tensor,
                       s_w: cute.Tensor, s_lse: cute.Tensor, F: cutlass.Constexpr):
        """out rows of a request of at most ``F`` splits (``m_o_partial``: its f16 partials,
        the scales already in ``s_w``): items (row, 8 dims), ``MERGE_BATCH // F`` per thread
        with all their splits' loads issued together, then added in split order."""
        m_tile, req, first, n_splits = split_rows.m_tile, split_rows.req, split_rows.first, split_rows.n_splits
        m_out = self.io.out
        IB = MERGE_BATCH // F
        PER_ROW = CONTENT_DIM // 8
        T = roles.PAIR_THREADS
        for it0 in cutlass.range(ctid, n_items, T * IB, unroll=1):
            src = [cute.make_rmem_tensor((8,), Float16) for _ in range(MERGE_BATCH)]
            ws = cute.make_rmem_tensor((MERGE_BATCH,), Float32)
            for k in cutlass.range_constexpr(IB):
                it = it0 + k * T
                lr = it // PER_ROW
                d = (it % PER_ROW) * 8
                row = m_tile * L.M_TILE + r0 + lr
                for u in cutlass.range_constexpr(F):
                    src[k * F + u].fill(0.0)
                    ws[k * F + u] = 0.0
                    if it < n_items and u < n_splits:
                        if s_lse[lr] != -Float32.inf:
                            ws[k * F + u] = s_w[lr, u]
                            cute.autovec_copy(
                                cute.local_tile(m_o_partial[row, None, first + u], (8,), (d // 8,)),
                                src[k * F + u],
                            )
            for k in cutlass.range_constexpr(IB):
                it = it0 + k * T
                if it < n_items:
                    lr = it // PER_ROW
                    d = (it % PER_ROW) * 8
                    row = m_tile * L.M_TILE + r0 + lr
                    acc = cute.make_rmem_tensor((8,), Float32)
                    acc.fill(0.0)
                    for u in cutlass.range_constexpr(F):
                        acc.store(acc.load() + src[k * F + u].load().to(Float32) * ws[k * F + u])
                    res = cute.make_rmem_tensor((8,), BFloat16)
                    res.store(acc.load().to(BFloat16))
                    cute.autovec_copy(res, cute.local_tile(m_out[row, None, req], (8,), (d // 8,)))

    def owner(self, row):
        """The cluster rank that owns a tile row in the cluster merge: rank d owns rows [R·d,
        R·(d+1)), R = ``cluster_rows_per_rank`` (the rows past R·k none owns; the sender keeps
        them): the sender, both merges and ``Epilogue.store_tile`` ask it."""
        return row // self.cfg.cluster_rows_per_rank

    def owned_slab(self, row, owner):
        """Which of ``owner``'s 8-row slabs in the cluster merge's buffer holds ``row`` (one slab
        where a rank owns 1-4 rows)."""
        rows_per_rank = self.cfg.cluster_rows_per_rank
        if rows_per_rank < 8:
            return 0
        return row // 8 - owner * (rows_per_rank // 8)

    @cute.jit
    def cluster_rows(self, acc_o_mn: list, c_o_mn: cute.Tensor, lse: cute.Tensor, inv: cute.Tensor, end: RequestEnd,
                     rank: Int32, peers: Int32, lane: Int32):
        """The cluster merge of the rows this rank owns, in the holders' registers (whole
        tiles, and clusters of two): lse = log Σ exp(lse_q), o = Σ exp(lse_q - lse)·o_q over
        this rank's own o/ℓ (``acc_o_mn``·``inv``) and the peers' rows in its idle KV stages
        (``Epilogue.cluster_epilogue`` sent them); the final LSE into ``io.lse``. ``peers``:
        k - 1, laundered (a one-trip loop unrolled for k = 2 let ptxas hoist a peer's 16 loads
        above the scaling, and spill). Returns each row's factor for ``store_tile`` (1 where
        this rank owns the row, else 0)."""
        cfg = self.cfg
        io = self.io
        k = cfg.cluster
        m_tile, req, wg, kv_addr = end.m_tile, end.req, end.wg, end.kv_addr
        rows_per_thr = cute.size(c_o_mn, mode=[0])
        vals = cute.size(c_o_mn, mode=[1])  # per row and PV split
        vecs = PV_SPLITS * vals // 4  # 16-byte vectors per row
        blocks8 = max(cfg.cluster_rows_per_rank // 8, 1)  # 8-row slabs a rank owns (one: 1-4 rows of one slab)
        lse_off, _ = cfg.cluster_recv_bytes
        recv = cute.make_tensor(cute.make_ptr(Float32, kv_addr, cute.AddressSpace.smem, assumed_align=16),
                                cute.make_layout((lse_off // 4 + (k - 1) * L.M_TILE,)))
        one = cute.make_rmem_tensor((rows_per_thr,), Float32)
        for i in cutlass.range_constexpr(rows_per_thr):
            row = c_o_mn[i, 0][0]
            one[i] = Float32(0.0)
            if self.owner(row) == rank:
                one[i] = Float32(1.0)
                pidx = self.owned_slab(row, rank)
                m = lse[i]
                for q in cutlass.range(peers, unroll=1):
                    m = cutlass.max(m, recv[lse_off // 4 + q * L.M_TILE + row])
                total = Float32(0.0)
                if m > -Float32.inf:
                    total = cute.math.exp2((lse[i] - m) * Float32(1.0 / LN2), fastmath=False)
                    for q in cutlass.range(peers, unroll=1):
                        total += cute.math.exp2(
                            (recv[lse_off // 4 + q * L.M_TILE + row] - m) * Float32(1.0 / LN2), fastmath=False)
                lse_tot = -Float32.inf
                if total > 0.0:
                    lse_tot = m + cute.math.log2(total, fastmath=False) * Float32(LN2)
                w_self = Float32(0.0)
                if lse[i] > -Float32.inf:
                    w_self = cute.math.exp2((lse[i] - lse_tot) * Float32(1.0 / LN2), fastmath=False)
                f_self = w_self * inv[i]
                for h in cutlass.range_constexpr(PV_SPLITS):
                    for j in cutlass.range_constexpr(vals):
                        acc_o_mn[h][i, j] = acc_o_mn[h][i, j] * f_self
                for q in cutlass.range(peers, unroll=1):
                    lq = recv[lse_off // 4 + q * L.M_TILE + row]
                    w_q = Float32(0.0)
                    if lq > -Float32.inf:
                        w_q = cute.math.exp2((lq - lse_tot) * Float32(1.0 / LN2), fastmath=False)
                    base = (((q * 2 + wg) * blocks8 + pidx) * vecs * 512 + lane * 16) // 4
                    for v in cutlass.range_constexpr(vecs):
                        x = cute.make_rmem_tensor((4,), Float32)
                        cute.autovec_copy(cute.local_tile(recv, (4,), ((base + v * 128) // 4,)), x)
                        h = 4 * v // vals
                        j = 4 * v % vals
                        for e in cutlass.range_constexpr(4):
                            acc_o_mn[h][i, j + e] = acc_o_mn[h][i, j + e] + w_q * x[e]
                grow = m_tile * L.M_TILE + row
                if grow < cfg.rows and wg == 0 and lane % 4 == 0:
                    io.lse[req, grow % cfg.heads, grow // cfg.heads] = lse_tot
        return one

    @cute.jit
    def spread_merge(self, recv: cute.Tensor, pv_mma_rs: cute.TiledMma, vals: cutlass.Constexpr, rank: Int32,
                     m_tile: Int32, req: Int32, ctid: Int32):
        """The cluster merge where the ranks own only live rows (``cluster_merge_spread``), by
        all 256 consumer threads, where the holders of a rank's rows are a few (at 16 heads
        and k = 8, 16 threads): each thread takes 16 bytes of an owned row at a time, loads
        it from the k slots (the peers', then this rank's) and their LSEs all at once,
        weights them by exp(lse_q - lse), sums them and stores bf16 (two column pairs); and
        each row's LSE. ``recv``: the merge buffer (``cluster_recv_bytes``, fp32); ``vals``:
        the accumulator's values per row, PV split and quad-lane. Items follow the slabs'
        order (``Epilogue.cluster_epilogue``): vector v of quad-lane c of a WG's row o at
        ((wg·blocks8 + o/8)·16 + v)·512 + (4·(row mod 8) + c)·16."""
        cfg = self.cfg
        io = self.io
        k = cfg.cluster
        R = cfg.cluster_rows_per_rank
        vecs = PV_SPLITS * vals // 4  # 16-byte vectors per quad-lane of a row
        blocks8 = max(R // 8, 1)
        slot_floats = roles.NUM_CONSUMER_WGS * blocks8 * vecs * 128
        lse_off, _ = cfg.cluster_recv_bytes
        pair = pipeline.NamedBarrier(barrier_id=int(roles.Barrier.PAIR_SYNC), num_threads=roles.PAIR_THREADS)
        pair.arrive_and_wait()  # this rank's own slot is written
        items = roles.NUM_CONSUMER_WGS * vecs * R * 4
        for it in cutlass.range(ctid, items, roles.PAIR_THREADS, unroll=1):
            c = it % 4
            o = it // 4 % R
            v = it // (4 * R) % vecs
            w = it // (4 * R * vecs)
            row = rank * R + o
            off = ((w * blocks8 + o // 8) * vecs + v) * 128 + (4 * (row % 8) + c) * 4
            lq = cute.make_rmem_tensor((k,), Float32)
            x = [cute.make_rmem_tensor((4,), Float32) for _ in range(k)]
            for q in cutlass.range_constexpr(k):
                lq[q] = recv[lse_off // 4 + q * L.M_TILE + row]
                cute.autovec_copy(cute.local_tile(recv, (4,), ((q * slot_floats + off) // 4,)), x[q])
            m = lq[0]
            for q in cutlass.range_constexpr(1, k):
                m = cutlass.max(m, lq[q])
            total_w = Float32(0.0)
            if m > -Float32.inf:
                for q in cutlass.range_constexpr(k):
                    total_w += cute.math.exp2((lq[q] - m) * Float32(1.0 / LN2), fastmath=False)
            lse_tot = -Float32.inf
            if total_w > 0.0:
                lse_tot = m + cute.math.log2(total_w, fastmath=False) * Float32(LN2)
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            for q in cutlass.range_constexpr(k):
                w_q = Float32(0.0)
                if lq[q] > -Float32.inf:
                    w_q = cute.math.exp2((lq[q] - lse_tot) * Float32(1.0 / LN2), fastmath=False)
                acc.store(acc.load() + x[q].load() * w_q)
            grow = m_tile * L.M_TILE + row
            if grow < cfg.rows:
                if it < 4 * R and c == 0:  # one item a row
                    io.lse[req, grow % cfg.heads, grow // cfg.heads] = lse_tot
                if not cutlass.const_expr("store" in cfg.skip):
                    # quad-lane c's columns: its accumulator partition (rows 0 and 8 of warp
                    # 0); values j, j + 1 are one column pair, as in store_tile
                    c_q = pv_mma_rs.get_slice(c).partition_C(cute.make_identity_tensor((L.M_TILE, cfg.pv_n)))
                    c_q_mn = cute.make_tensor(c_q.iterator, M.acc_mn_layout(pv_mma_rs, c_q.layout))
                    col0 = (w * PV_SPLITS + 4 * v // vals) * cfg.pv_n
                    for e in cutlass.range_constexpr(0, 4, 2):
                        pr = cute.make_rmem_tensor((2,), BFloat16)
                        pr[0] = acc[e].to(BFloat16)
                        pr[1] = acc[e + 1].to(BFloat16)
                        col = col0 + c_q_mn[0, 4 * v % vals + e][1]
                        cute.autovec_copy(pr, cute.local_tile(io.out[grow, None, req], (2,), (col // 2,)))
