"""Role: the split-KV merge, inside the decode launch (no combine kernel).

The launch is cooperative, so every part's CTA is resident and a CTA may wait for others.
Each split of a request counts itself (``counters``) once its partial result is written.
Splits 0..n-2 process their request last in their part; they, and the idle parts the plan
sends to help, wait for the count and merge a share of its rows each: lse = max + log Σ
exp(lse_s - max), out = Σ exp(lse_s - lse)·O_s, summed in fp32. A request of at most
``DecodeConfig.merge_few`` splits merges batched (a thread per row for the LSE, several 8-dim
items per thread with all their splits' loads issued together) from f16 partials with a
power-of-two scale per row (``DecodeOutputs.partial_views``; the scale folds into the split's
weight); more splits merge fp32 partials, a warp per row and an item per thread at a time.
The last split processes the request first in its part and goes on. The last merger
resets the counters for the next call.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float16, Float32, Int32

from snapmla_cute import ptx
from snapmla_cute.format import CONTENT_DIM
from snapmla_cute.kernels.decode.args import DecodeOutputs
from snapmla_cute.kernels.decode.config import (
    MERGE_BATCH, MERGE_MAX_SPLITS, MERGE_W_OFFSET, MERGE_WAIT_LIMIT_NS, DecodeConfig,
)
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles


@dataclass(frozen=True)
class Merger:
    """The merge of a split request's partials in ``io``, run by the consumer warpgroups of
    its last split, of its other splits and of parts the plan left idle."""

    cfg: DecodeConfig
    tracer: Tracer
    io: DecodeOutputs

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
            # of a row's loads in flight at once; more than merge_few splits, else a thread
            # per row: few_split_lse); the splits' weights exp(lse_s - lse) go to
            # shared memory for step 2, so its loads do not wait on an exp
            s_w = cute.make_tensor(
                cute.make_ptr(Float32, kv_addr + MERGE_W_OFFSET, cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((L.M_TILE, MERGE_MAX_SPLITS), stride=(MERGE_MAX_SPLITS, 1)),
            )
            warp = ctid // 32
            lane = ctid % 32
            warp_rows = nrows  # rows merged a warp per row
            if cutlass.const_expr(cfg.merge_few > 0):
                few = n_splits <= cfg.merge_few  # batched over rows and items
                if few:
                    warp_rows = 0
                    # a thread per row, its splits' loads issued together (rows <= 64 < threads)
                    if ctid < nrows:
                        _, m_scales = io.partial_views(req)
                        self.few_split_lse(
                            m_tile, req, r0 + ctid, ctid, first, n_splits, m_lse, m_lse_partial, m_scales, s_w, s_lse
                        )
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
            if cutlass.const_expr(cfg.merge_few > 0):
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
            if cutlass.const_expr(cfg.merge_few > 0):
                if few:
                    item_end = 0
                    o16, _ = io.partial_views(req)
                    # half as many splits: twice the items per thread at once
                    if n_splits <= max(1, cfg.merge_few // 2):
                        self.few_split_rows(
                            m_tile, req, r0, first, n_splits, n_items, ctid, m_out, o16, s_w, s_lse,
                            max(1, cfg.merge_few // 2),
                        )
                    else:
                        self.few_split_rows(
                            m_tile, req, r0, first, n_splits, n_items, ctid, m_out, o16, s_w, s_lse,
                            cfg.merge_few,
                        )
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
    def few_split_lse(self, m_tile: Int32, req: Int32, share_row: Int32, lr: Int32, first: Int32, n_splits: Int32,
                      m_lse: cute.Tensor, m_lse_partial: cute.Tensor, m_scales: cute.Tensor, s_w: cute.Tensor,
                      s_lse: cute.Tensor):
        """The final LSE of one row of a request of at most ``merge_few`` splits and its
        splits' weights exp(lse_s - lse) times their f16 partials' 1/f, by one thread."""
        cfg = self.cfg
        F = cfg.merge_few
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
    def few_split_rows(
        self, m_tile: Int32, req: Int32, r0: Int32, first: Int32, n_splits: Int32, n_items: Int32, ctid: Int32,
        m_out: cute.Tensor, m_o_partial: cute.Tensor, s_w: cute.Tensor, s_lse: cute.Tensor, F: cutlass.Constexpr,
    ):
        """out rows of a request of at most ``F`` splits (``m_o_partial``: its f16 partials,
        the scales already in ``s_w``): items (row, 8 dims), ``MERGE_BATCH // F`` per thread
        with all their splits' loads issued together, then added in split order."""
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
