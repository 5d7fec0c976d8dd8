"""Split-KV scheduler for the decode kernel, computed on the device (CUDA-graph safe).

Reads ``cache_seqlens`` and writes the work split into caller-owned buffers, so a captured
graph replays correctly when the lengths change, with no host sync.

Cost model (as FlashMLA's): request r costs ``c_r = n_r + overhead`` units, its n_r =
ceil(L_r / block_n) KV blocks preceded by ``overhead`` units for its Q load and epilogue.
Laid end to end the requests occupy units ``[S_r, S_r + c_r)`` (S = exclusive prefix sum);
part p takes units ``[p·w, (p+1)·w)``, w = ceil(total / num_parts), and owns the blocks
whose units fall there. A request whose blocks span several parts is split (its partial
results are merged inside the decode kernel); an empty request belongs to the part that covers
the last unit of its overhead and writes a zero output and -inf LSE.

Whole-request and cluster plans: when the batch fits the parts and splitting would not pay
(``whole_requests``), part p takes request p whole, or (the decode launched in clusters of k
parts) parts kc..kc+k-1 take a k-th of request c's blocks each, merged on-chip; parts past
them stay idle. A split costs its partial, written and read back by the merge
(``split_units`` per split, about 6 units for 64 rows, fitted with fp32 partials), and a
fixed wait for the merge (``SPLIT_FIXED_UNITS``); and at most ``stream_parts`` parts stream
KV at their full rate before HBM bounds the whole launch. The rule picks the plan with the
smaller estimate: whole, max(c_max, T / s); split, max(w, (T + n_s·split_units) / s) +
fixed, with n_s = b + ceil(T / w) - 1 splits (every part boundary inside a request), s =
min(stream_parts, num_parts); cluster, max((c_max - 5) / k + 5, T / s) +
CLUSTER_FIXED_UNITS. Fitted on the H100 to 29 equal-length dense and sparse shapes
(profiles/merge.md, "Whole-request and cluster plans").

Every part is computed independently (binary searches over S in shared memory), so one
CTA of 256 threads does the whole plan in two block-wide scans.

Input  ``cache_seqlens`` int32 [b], b <= MAX_BATCH
Output ``sched``         int32 [num_parts, SCHED_FIELDS]:
          begin request, begin block, end request, end block (exclusive; the end request is
          processed up to it), split index of the begin request, 0, 0, 0. A part with no work
          has end request < begin request (or begin request = b).
       ``split_offsets`` int32 [b + 1]: prefix sums of splits per request (request r has
          ``split_offsets[r+1] - split_offsets[r]`` splits, stored from row split_offsets[r]
          of the partial buffers); at most b + num_parts - 1 in all.
The whole-request rule's two parameters come as scalars (``split_units`` 0: never whole), so
one compiled scheduler serves every decode shape; the decode kernel plans with its own
``DecodeConfig.scheduler`` values as constants. The same plan in plain Python, for tests and
the host's choices, is ``snapmla_cute.planning.schedule_reference`` (and ``plan_of``).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.memory import SmemAllocator

from snapmla_cute import jit_cache
from snapmla_cute.kernels import fake

NAME = "decode_scheduler"
SCHED_FIELDS = 8


@dataclass(frozen=True)
class SchedulerConfig:
    block_n: int = 64  # KV tokens per block
    fixed_overhead_blocks: int = 5  # per-request cost (Q load, epilogue) in block units
    # the whole-request rule (``whole_requests``): units of one split's partial, written
    # and read back (0: never whole requests; the standalone scheduler takes it as a scalar)
    split_units: int = 0
    stream_parts: int = 0  # parts streaming KV at full rate before HBM binds (0: every part)
    # parts per cluster: the cluster plan (cluster c takes request c, a k-th of its blocks
    # per part, merged on-chip) is one of the rule's choices when k > 1
    cluster: int = 1


# a split's fixed cost beyond its partial's bytes (the drain before the count, the merge's
# wait), in block units; with split_units and stream_parts fitted on the H100
SPLIT_FIXED_UNITS = 6
# the cluster merge's (through distributed shared memory), in block units
CLUSTER_FIXED_UNITS = 1
# ``whole_requests``' answers: the split plan, part p = request p, cluster c = request c
PLAN_SPLIT, PLAN_WHOLE, PLAN_CLUSTER = 0, 1, 3


MAX_BATCH = 8192  # the prefix sums live in shared memory
# the longest request the plan counts exactly: MAX_BATCH requests of (2^31 / MAX_BATCH - 6)
# blocks and their overhead units stay below 2^31, so its int32 sums never wrap; every
# reader of a length clamps it to [0, MAX_SEQLEN] (``clamp_len``): a negative one (unchecked
# input) is an empty request, not split rows outside the partials
MAX_SEQLEN = (2**31 // MAX_BATCH - 6) * 64
THREADS = 256


class DecodeSchedulerKernel:
    def __init__(self, cfg: SchedulerConfig = SchedulerConfig()):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_cache_seqlens: cute.Tensor,
        m_sched: cute.Tensor,
        m_split_offsets: cute.Tensor,
        split_units: Int32,
        stream_parts: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            prefix: cute.struct.MemRange[Int32, MAX_BATCH + 1]
            warp_sums: cute.struct.MemRange[Int32, THREADS // 32]

        self.shared_storage = SharedStorage
        self.kernel(m_cache_seqlens, m_sched, m_split_offsets, split_units, stream_parts).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    @cute.jit
    def n_blocks(self, seqlen):
        return (clamp_len(seqlen) + self.cfg.block_n - 1) // self.cfg.block_n

    @staticmethod
    @cute.jit
    def warp_inclusive_scan(x, lane):
        """Inclusive prefix sum of one Int32 per lane over the warp."""
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, 1 << k)
            if lane >= (1 << k):
                x += y
        return x

    @staticmethod
    @cute.jit
    def exclusive_scan(v, s_warp, tidx, threads: cutlass.Constexpr = THREADS):
        """Block-wide exclusive prefix sum of one Int32 per thread: (prefix, total); ``s_warp``
        holds a sum per warp (also the top-k translation's chunk scan)."""
        lane = tidx % 32
        warp = tidx // 32
        x = DecodeSchedulerKernel.warp_inclusive_scan(v, lane)
        if lane == 31:
            s_warp[warp] = x
        cute.arch.sync_threads()
        before = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(threads // 32):
            t = s_warp[w]
            if w < warp:
                before += t
            total += t
        cute.arch.sync_threads()  # s_warp is reused by the next scan
        return before + x - v, total

    @cute.kernel
    def kernel(self, m_cache_seqlens: cute.Tensor, m_sched: cute.Tensor, m_split_offsets: cute.Tensor,
               split_units: Int32, stream_parts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        batch = m_cache_seqlens.shape[0]
        num_parts = m_sched.shape[0]
        storage = SmemAllocator().allocate(self.shared_storage)
        s_pre = storage.prefix.get_tensor(cute.make_layout((MAX_BATCH + 1,)))
        s_warp = storage.warp_sums.get_tensor(cute.make_layout((THREADS // 32,)))
        # 1. unit prefix sums S_r, 2. splits per request and their prefix sums (each
        # thread owns a contiguous run of requests)
        total = self.unit_prefix(m_cache_seqlens, s_pre, s_warp, tidx, THREADS)
        cute.arch.sync_threads()
        width = self.width_of(total, num_parts)
        whole = Int32(0)
        if batch <= num_parts:
            c_max = self.max_units(s_pre, batch, tidx % 32)
            whole = self.whole_requests(total, c_max, batch, num_parts, split_units, stream_parts)
        self.split_prefix(s_pre, batch, self.split_width(total, width, whole), m_split_offsets, s_warp, tidx, THREADS)

        # 3. every part on its own
        for p in cutlass.range(tidx, num_parts, THREADS, unroll=1):
            b_req, b_blk, e_req, e_blk, split = self.part_plan(s_pre, batch, total, width, p, whole)
            m_sched[p, 0] = b_req
            m_sched[p, 1] = b_blk
            m_sched[p, 2] = e_req
            m_sched[p, 3] = e_blk
            m_sched[p, 4] = split
            m_sched[p, 5] = 0
            m_sched[p, 6] = 0
            m_sched[p, 7] = 0

    @cute.jit
    def runs_prefix(self, count, batch, m_out, s_warp, tidx, threads: cutlass.Constexpr):
        """Exclusive prefix sum of ``count(r)`` over the requests into ``m_out[0..b]`` (the
        total last) by ``threads`` threads, each owning a contiguous run of requests;
        returns the total."""
        per = (batch + threads - 1) // threads
        lo = cutlass.min(tidx * per, batch)
        hi = cutlass.min(lo + per, batch)
        mine = Int32(0)
        for r in cutlass.range(lo, hi, unroll=1):
            mine += count(r)
        run, total = self.exclusive_scan(mine, s_warp, tidx, threads)
        for r in cutlass.range(lo, hi, unroll=1):
            m_out[r] = run
            run += count(r)
        if tidx == 0:
            m_out[batch] = total
        return total

    @cute.jit
    def unit_prefix(self, m_cache_seqlens, s_pre, s_warp, tidx, threads: cutlass.Constexpr):
        """Step 1 by ``threads`` threads: S_r into ``s_pre[0..b]``; returns the total.
        The caller syncs before reading ``s_pre``."""
        ov = self.cfg.fixed_overhead_blocks
        return self.runs_prefix(
            lambda r: self.n_blocks(m_cache_seqlens[r]) + ov, cute.size(m_cache_seqlens), s_pre, s_warp, tidx, threads
        )

    @cute.jit
    def split_prefix(self, s_pre, batch, width, m_out, s_warp, tidx, threads: cutlass.Constexpr):
        """Step 2 by ``threads`` threads: split offsets of every request into ``m_out[0..b]``
        (shared or global memory)."""
        self.runs_prefix(lambda r: self.n_splits(s_pre, r, width), batch, m_out, s_warp, tidx, threads)

    @cute.jit
    def max_units(self, s_pre, batch, lane):
        """The largest request cost c_max (units) from the prefix sums, by one warp (every
        lane gets it; each warp may compute it, no barrier)."""
        m = Int32(0)
        for r in cutlass.range(lane, batch, 32, unroll=1):
            m = cutlass.max(m, s_pre[r + 1] - s_pre[r])
        return cute.arch.warp_redux_sync(m, "max")

    @cute.jit
    def whole_requests(self, total, c_max, batch, num_parts, split_units, stream_parts, cluster: cutlass.Constexpr = 1):
        """``PLAN_WHOLE`` if part p should take request p whole, ``PLAN_CLUSTER`` if cluster c
        (``cluster`` parts) should take request c, else ``PLAN_SPLIT`` (the module's rule)."""
        res = Int32(PLAN_SPLIT)
        if split_units > 0 and batch <= num_parts:
            s = num_parts
            if stream_parts > 0:
                s = cutlass.min(num_parts, stream_parts)
            w = cutlass.max((total + num_parts - 1) // num_parts, 1)
            n_s = batch + (total + w - 1) // w - 1
            t_split = cutlass.max(w, (total + n_s * split_units + s - 1) // s) + SPLIT_FIXED_UNITS
            t_whole = cutlass.max(c_max, (total + s - 1) // s)
            best = t_split
            if t_whole <= t_split:
                res = Int32(PLAN_WHOLE)
                best = t_whole
            if cutlass.const_expr(cluster > 1):
                if batch * cluster <= num_parts:
                    ov = self.cfg.fixed_overhead_blocks
                    t_cl = cutlass.max((c_max - ov + cluster - 1) // cluster + ov, (total + s - 1) // s)
                    if t_cl + CLUSTER_FIXED_UNITS <= best:
                        res = Int32(PLAN_CLUSTER)
        return res

    @staticmethod
    @cute.jit
    def split_width(total, width, whole):
        """The width ``splits_of`` counts with: past every unit (one split each) when whole
        (``whole`` None: the rule compiled out)."""
        w = width
        if cutlass.const_expr(whole is not None):
            if whole != 0:
                w = total + 1
        return w

    @cute.jit
    def part_plan(self, s_pre, batch, total, width, p, whole=None):
        """Part ``p``'s row of the plan from the unit prefix sums: (begin request, begin
        block, end request, end block, split index of the begin request); with ``whole``,
        request p (all its blocks) or nothing past the batch (``whole`` None: never)."""
        ov = self.cfg.fixed_overhead_blocks
        u0 = p * width
        u1 = cutlass.min(u0 + width, total)
        b_req = batch
        b_blk = Int32(0)
        e_req = Int32(0)
        e_blk = Int32(0)
        split = Int32(0)
        in_plan = u0 < total
        if cutlass.const_expr(whole is not None):
            if whole != 0:
                in_plan = False
                if p < batch:
                    b_req = p
                    e_req = p
                    e_blk = s_pre[p + 1] - s_pre[p] - ov
        if cutlass.const_expr(self.cfg.cluster > 1):
            if whole == PLAN_CLUSTER:  # a k-th of request p // k
                k = self.cfg.cluster
                b_req = batch
                e_req = Int32(0)
                e_blk = Int32(0)
                if p < k * batch:
                    r = p // k
                    n = s_pre[r + 1] - s_pre[r] - ov
                    q = p % k
                    b_req = r
                    e_req = r
                    b_blk = q * n // k
                    e_blk = (q + 1) * n // k
        if in_plan:
            # begin: the request holding unit u0 (largest r with S_r <= u0)
            a = Int32(0)
            z = batch
            while a < z - 1:
                mid = (a + z) // 2
                if s_pre[mid] <= u0:
                    a = mid
                else:
                    z = mid
            b_req = a
            first_unit = s_pre[a] + ov
            b_blk = cutlass.max(u0 - first_unit, 0)
            if s_pre[a + 1] > first_unit and p * width > first_unit:
                split = p - first_unit // width
            # end: the last request with a block before u1 (an empty one: whose
            # overhead ends by u1), i.e. the largest r with key_r < u1
            a = Int32(-1)
            z = batch
            while a < z - 1:
                mid = (a + z) // 2
                if self.end_key(s_pre, mid) < u1:
                    a = mid
                else:
                    z = mid
            e_req = a
            if a >= 0:
                e_blk = cutlass.min(s_pre[a + 1] - s_pre[a] - ov, u1 - s_pre[a] - ov)
        return b_req, b_blk, e_req, e_blk, split

    @cute.jit
    def end_key(self, s_pre, r):
        ov = self.cfg.fixed_overhead_blocks
        key = s_pre[r] + ov
        if s_pre[r + 1] - s_pre[r] == ov:  # empty request: its overhead must be covered
            key -= 1
        return key

    @staticmethod
    @cute.jit
    def width_of(total, num_parts):
        """Units per part: w = ceil(total / num_parts), at least 1."""
        return cutlass.max((total + num_parts - 1) // num_parts, 1)

    @cute.jit
    def n_splits(self, s_pre, r, width):
        return self.splits_of(s_pre[r], s_pre[r + 1], width)

    @cute.jit
    def splits_of(self, start, end, width):
        """Splits of the request whose units are ``[start, end)`` (S_r, S_r+1): the parts its
        blocks' units fall in; 1 for an empty request."""
        first_unit = start + self.cfg.fixed_overhead_blocks
        n = Int32(1)
        if end > first_unit:
            n = (end - 1) // width - first_unit // width + 1
        return n


@cute.jit
def clamp_len(seqlen):
    """A request's length as the plan and the roles read it: in [0, MAX_SEQLEN]."""
    return cutlass.min(cutlass.max(seqlen, 0), MAX_SEQLEN)


def fake_args(config: SchedulerConfig):
    i32 = cutlass.Int32
    return (
        fake.tensor(i32, (fake.sym(),), (1,), 4),
        fake.tensor(i32, (fake.sym(), SCHED_FIELDS), (SCHED_FIELDS, 1), 16),
        fake.tensor(i32, (fake.sym(),), (1,), 4),
        i32(0),
        i32(0),
        fake.stream(),
    )


def compile(config: SchedulerConfig = SchedulerConfig(), *, arch: str | None = None, keep_sass: bool = False):
    """The compiled scheduler for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, DecodeSchedulerKernel, fake_args, arch=arch, keep_sass=keep_sass)
