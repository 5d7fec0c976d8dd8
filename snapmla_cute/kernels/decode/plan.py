"""Role: each CTA's part of the split-KV plan, computed in the decode kernel itself.

Every CTA runs ``decode_scheduler``'s code for its own part from ``cache_seqlens`` (no
scheduler launch before the decode): two prefix sums over the requests (one warp with
shuffles for batches of at most 32, else CTA-wide scans), then its part's row. The row and
the split rows of its first and last request go to shared memory (``PLAN_WORDS``), where
every role reads them back as a ``PartWork`` after its ``setmaxnreg``. Parts left without KV
work are assigned a split request to help merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from snapmla_cute.kernels.decode.args import DecodeInputs
from snapmla_cute.kernels.decode.config import DecodeConfig
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.kernels.decode_scheduler import MAX_BATCH, PLAN_CLUSTER, DecodeSchedulerKernel, clamp_len
from snapmla_cute.layouts import smem as L


@dataclass(frozen=True)
class PartWork:
    """This part's work, read from the plan in shared memory: requests ``begin_req`` ..
    ``end_req`` (``n_reqs`` of them), from block ``begin_blk`` of the first to block
    ``end_blk`` (exclusive) of the last; the first is split ``begin_split`` of its request."""

    s_plan: object
    m_seqlens: object
    begin_req: object
    begin_blk: object
    end_req: object
    end_blk: object
    begin_split: object
    n_reqs: object

    @staticmethod
    @cute.jit
    def read(s_plan, m_seqlens):
        """The plan as written by ``Planner.plan`` (read after ``setmaxnreg``: values live
        across it would be spilled to local memory)."""
        begin_req = s_plan[0]
        n_reqs = Int32(0)
        if begin_req < cute.size(m_seqlens):
            n_reqs = s_plan[2] - begin_req + 1
        return PartWork(s_plan, m_seqlens, begin_req, s_plan[1], s_plan[2], s_plan[3], s_plan[4], n_reqs)

    @cute.jit
    def block_range(self, r, req):
        """(length, first block, end block) of the r-th request segment (request ``req``)."""
        seqlen = clamp_len(self.m_seqlens[req])
        blk_lo = Int32(0)
        if r == 0:
            blk_lo = self.begin_blk
        blk_hi = (seqlen + L.BLOCK_N - 1) // L.BLOCK_N
        if req == self.end_req:
            blk_hi = self.end_blk
        return seqlen, blk_lo, blk_hi

    @cute.jit
    def total_blocks(self):
        """KV blocks of the whole part."""
        total = Int32(0)
        for r in cutlass.range(self.n_reqs, unroll=1):
            _, blk_lo, blk_hi = self.block_range(r, self.begin_req + r)
            total += blk_hi - blk_lo
        return total

    @cute.jit
    def split_rows(self, r, req):
        """Where the r-th segment's result goes: (first split row of the request, its splits,
        this segment's split index); (0, 1, 0) for a request the part holds whole."""
        first = Int32(0)
        n_splits = Int32(1)
        split = Int32(0)
        if r == 0:
            first = self.s_plan[5]
            n_splits = self.s_plan[6]
            split = self.begin_split
        elif req == self.end_req:
            first = self.s_plan[7]
            n_splits = self.s_plan[8]
        return first, n_splits, split

    def helpers(self):
        """Parts the plan left without KV work (each helps merge a split request)."""
        return self.s_plan[9]

    def helper_request(self):
        """The split request this idle part helps merge, or -1."""
        return self.s_plan[10]

    def clustered(self):
        """The cluster plan: this part holds a k-th of one request, merged on-chip."""
        return self.s_plan[15] == PLAN_CLUSTER

    def helper_share(self):
        """(request, its first split row, this part's merger index, its splits, its mergers)
        of the idle part's merge share."""
        return self.s_plan[10], self.s_plan[11], self.s_plan[12], self.s_plan[13], self.s_plan[14]


@dataclass(frozen=True)
class Planner:
    """The plan role (all ``threads`` of the CTA): ``scheduler`` is the scheduler kernel whose
    helpers compute the same plan."""

    cfg: DecodeConfig
    scheduler: DecodeSchedulerKernel
    threads: int
    tracer: Tracer

    @cute.jit
    def plan(self, inputs: DecodeInputs, scratch_ptr: cute.Pointer, s_scan: cute.Tensor, s_plan: cute.Tensor,
             m_tile: Int32, part: Int32, tidx: Int32):
        """All threads: this part's row of the split-KV plan (``decode_scheduler``'s, same
        code) into ``s_plan``, plus the split rows of its first and last request. CTA (0, 0)
        also writes ``split_offsets`` and every m-tile-0 CTA its ``sched`` row, so the
        metadata shows the plan that ran."""
        m_seqlens, m_sched, m_split_offsets = inputs.seqlens, inputs.sched, inputs.split_offsets
        batch = cute.size(m_seqlens)
        num_parts = m_sched.shape[0]
        words = cute.recast_ptr(scratch_ptr, dtype=Int32)
        s_pre = cute.make_tensor(words, cute.make_layout((MAX_BATCH + 1,)))
        s_split = cute.make_tensor(words + (MAX_BATCH + 1), cute.make_layout((MAX_BATCH + 1,)))
        total = Int32(0)
        width = Int32(1)
        rule = cutlass.const_expr(self.scheduler.cfg.split_units > 0)
        whole = Int32(0) if rule else None  # None: the whole-request rule compiled out
        if batch <= 32:
            # one warp, one request per lane: both prefix sums by shuffles, no CTA barrier
            # (the lengths' load and the two CTA-wide scans, four barriers, took ~1.6 µs of each CTA's plan)
            if tidx < 32:
                total, width, w_warp = self.plan_warp(m_seqlens, s_pre, s_split, batch, num_parts, tidx)
                if cutlass.const_expr(rule):
                    whole = w_warp
        else:
            total = self.scheduler.unit_prefix(m_seqlens, s_pre, s_scan, tidx, self.threads)
            cute.arch.sync_threads()
            if tidx == 0:
                self.tracer.stamp("lengths_read")
            width = self.scheduler.width_of(total, num_parts)
            if cutlass.const_expr(rule):
                if batch <= num_parts:  # every warp finds c_max itself: no barrier
                    c_max = self.scheduler.max_units(s_pre, batch, tidx % 32)
                    whole = self.whole_requests(total, c_max, batch, num_parts)
            split_w = self.scheduler.split_width(total, width, whole)
            self.scheduler.split_prefix(s_pre, batch, split_w, s_split, s_scan, tidx, self.threads)
        if tidx == 0:
            self.tracer.stamp("splits_counted")
            b_req, b_blk, e_req, e_blk, split = self.scheduler.part_plan(s_pre, batch, total, width, part, whole)
            self.tracer.stamp("part_planned")
            s_plan[0] = b_req
            s_plan[1] = b_blk
            s_plan[2] = e_req
            s_plan[3] = e_blk
            s_plan[4] = split
            if cutlass.const_expr(self.cfg.cluster > 1):
                # PartWork.clustered (never with the rule compiled out)
                if cutlass.const_expr(rule):
                    s_plan[15] = whole
                else:
                    s_plan[15] = Int32(0)
        cute.arch.sync_threads()
        if tidx == 0:
            b_req = s_plan[0]
            e_req = s_plan[2]
            if b_req < batch:
                s_plan[5] = s_split[b_req]
                s_plan[6] = s_split[b_req + 1] - s_split[b_req]
            if e_req >= 0:
                s_plan[7] = s_split[e_req]
                s_plan[8] = s_split[e_req + 1] - s_split[e_req]
            # parts past the work (idle: p·width >= total) help merge split requests:
            # helper k takes request k mod b if it is split, as merger n_splits - 1 + k div b
            busy = (total + width - 1) // width
            if cutlass.const_expr(rule):
                if whole != 0:
                    busy = batch
                if cutlass.const_expr(self.scheduler.cfg.cluster > 1):
                    if whole == PLAN_CLUSTER:
                        busy = batch * self.scheduler.cfg.cluster
            helpers = cutlass.max(num_parts - busy, 0)
            s_plan[9] = helpers
            s_plan[10] = -1
            k = part - busy
            if k >= 0 and batch > 0:
                hr = k % batch
                hn = s_split[hr + 1] - s_split[hr]
                if hn >= 2:
                    s_plan[10] = hr
                    s_plan[11] = s_split[hr]
                    s_plan[12] = hn - 1 + k // batch
                    s_plan[13] = hn
                    # merger_count(hn, helpers, hr, batch) without its test (hr <= k <
                    # helpers here); written out, the plan keeps the code the GPU ran
                    s_plan[14] = hn - 1 + (helpers - 1 - hr) // batch + 1
            if m_tile == 0:
                for k in cutlass.range_constexpr(5):
                    m_sched[part, k] = s_plan[k]
                for k in cutlass.range_constexpr(5, 8):
                    m_sched[part, k] = 0
        if m_tile == 0 and part == 0:
            for r in cutlass.range(tidx, batch + 1, self.threads, unroll=1):
                m_split_offsets[r] = s_split[r]
        # the producer's TMA writes (async proxy) follow these generic writes to the scratch
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

    @cute.jit
    def whole_requests(self, total: Int32, c_max: Int32, batch: Int32, num_parts: Int32) -> Int32:
        """The scheduler's whole-request rule with this kernel's constants (``DecodeConfig.scheduler``)."""
        c = self.scheduler.cfg
        return self.scheduler.whole_requests(total, c_max, batch, num_parts, Int32(c.split_units),
                                             Int32(c.stream_parts), c.cluster)

    @cute.jit
    def plan_warp(self, m_seqlens: cute.Tensor, s_pre: cute.Tensor, s_split: cute.Tensor, batch: Int32, num_parts: Int32,
                  lane: Int32):
        """``plan``'s two prefix sums for batch ≤ 32 by warp 0 (lane r: request r), the same
        values as ``DecodeSchedulerKernel.unit_prefix`` / ``split_prefix``: returns (total
        units, units per part, whole requests: 0 with the rule compiled out); ``s_pre`` and
        ``s_split`` are visible to lane 0 after."""
        ov = self.scheduler.cfg.fixed_overhead_blocks
        units = Int32(0)
        if lane < batch:
            units = self.scheduler.n_blocks(m_seqlens[lane]) + ov
        incl = self.scheduler.warp_inclusive_scan(units, lane)
        total = cute.arch.shuffle_sync(incl, 31)
        if lane == 0:
            self.tracer.stamp("lengths_read")
        width = self.scheduler.width_of(total, num_parts)
        whole = Int32(0)
        split_w = width
        if cutlass.const_expr(self.scheduler.cfg.split_units > 0):
            whole = self.whole_requests(total, cute.arch.warp_redux_sync(units, "max"), batch, num_parts)
            split_w = self.scheduler.split_width(total, width, whole)
        splits = Int32(0)
        if lane < batch:
            s_pre[lane] = incl - units
            splits = self.scheduler.splits_of(incl - units, incl, split_w)  # S_r, S_r+1 on registers
        if lane == 0:
            s_pre[batch] = total
        incl2 = self.scheduler.warp_inclusive_scan(splits, lane)
        total2 = cute.arch.shuffle_sync(incl2, 31)
        if lane < batch:
            s_split[lane] = incl2 - splits
        if lane == 0:
            s_split[batch] = total2
        cute.arch.sync_warp()
        return total, width, whole
