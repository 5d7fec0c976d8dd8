"""Split-KV scheduler for the decode kernel, computed on the device (CUDA-graph safe).

Reads ``cache_seqlens`` and writes the work split into caller-owned buffers, so a captured
graph replays correctly when the lengths change, with no host sync. The split follows
FlashMLA's: every request costs its KV blocks plus a fixed overhead, the total is cut
into ``num_parts`` near-equal contiguous pieces of the (request, block) sequence, and a
request cut by a piece boundary is split (its partial results merged by the combine kernel).

Input  ``cache_seqlens`` int32 [b]
Output ``sched``         int32 [num_parts, SCHED_FIELDS]:
          begin request, begin block, end request, end block (exclusive; the end request is
          processed up to it), split index of the begin request, 0, 0, 0
       ``split_offsets`` int32 [b + 1]: prefix sums of splits per request (request r has
          ``split_offsets[r+1] - split_offsets[r]`` splits, stored from row split_offsets[r]
          of the partial buffers)
Request r has ceil(L_r / block_n) blocks; an empty request costs only the overhead and gets
one split, which writes a zero output and -inf LSE.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

SCHED_FIELDS = 8


@dataclass(frozen=True)
class SchedulerConfig:
    block_n: int = 64  # KV tokens per block
    fixed_overhead_blocks: int = 5  # per-request cost (Q load, epilogue) in block units


class DecodeSchedulerKernel:
    def __init__(self, cfg: SchedulerConfig = SchedulerConfig()):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_cache_seqlens: cute.Tensor,
        m_sched: cute.Tensor,
        m_split_offsets: cute.Tensor,
        stream,
    ):
        self.kernel(m_cache_seqlens, m_sched, m_split_offsets).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, m_cache_seqlens: cute.Tensor, m_sched: cute.Tensor, m_split_offsets: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block_n = self.cfg.block_n
        overhead = self.cfg.fixed_overhead_blocks
        batch = m_cache_seqlens.shape[0]
        num_parts = m_sched.shape[0]
        # The sequential walk is cheap (b + num_parts steps); one thread does it.
        if tidx == 0:
            total = Int32(0)
            for r in cutlass.range(batch):
                total += (m_cache_seqlens[r] + block_n - 1) // block_n + overhead
            payload = (total + num_parts - 1) // num_parts + overhead
            req = Int32(0)
            blk = Int32(0)
            split = Int32(0)
            cum = Int32(0)
            m_split_offsets[0] = 0
            for p in cutlass.range(num_parts):
                m_sched[p, 0] = req
                m_sched[p, 1] = blk
                m_sched[p, 4] = split
                remain = payload
                walking = req < batch
                while walking:
                    n_blocks = (m_cache_seqlens[req] + block_n - 1) // block_n
                    if remain >= n_blocks - blk + overhead:
                        cum += split + 1
                        m_split_offsets[req + 1] = cum
                        remain -= n_blocks - blk + overhead
                        req += 1
                        blk = Int32(0)
                        split = Int32(0)
                        walking = req < batch
                    else:
                        if remain - overhead > 0:
                            blk += remain - overhead
                            split += 1
                        walking = False
                # end (exclusive): a piece that stops at a request boundary ends at the
                # previous request's last block
                end_req = req
                end_blk = blk
                if blk == 0 and req > 0:
                    end_req = req - 1
                    end_blk = (m_cache_seqlens[req - 1] + block_n - 1) // block_n
                m_sched[p, 2] = end_req
                m_sched[p, 3] = end_blk
                m_sched[p, 5] = 0
                m_sched[p, 6] = 0
                m_sched[p, 7] = 0


def schedule_reference(cache_seqlens, num_parts: int, cfg: SchedulerConfig = SchedulerConfig()):
    """The same walk in plain Python: ``(sched rows, split_offsets)``, for tests and planning."""
    lens = [int(x) for x in cache_seqlens]
    n_blocks = [(L + cfg.block_n - 1) // cfg.block_n for L in lens]
    total = sum(n + cfg.fixed_overhead_blocks for n in n_blocks)
    payload = (total + num_parts - 1) // num_parts + cfg.fixed_overhead_blocks
    req = blk = split = cum = 0
    offsets = [0] * (len(lens) + 1)
    sched = []
    for _ in range(num_parts):
        row = [req, blk, 0, 0, split, 0, 0, 0]
        remain = payload
        while req < len(lens):
            if remain >= n_blocks[req] - blk + cfg.fixed_overhead_blocks:
                cum += split + 1
                offsets[req + 1] = cum
                remain -= n_blocks[req] - blk + cfg.fixed_overhead_blocks
                req, blk, split = req + 1, 0, 0
            else:
                if remain - cfg.fixed_overhead_blocks > 0:
                    blk += remain - cfg.fixed_overhead_blocks
                    split += 1
                break
        end_req, end_blk = req, blk
        if blk == 0 and req > 0:
            end_req, end_blk = req - 1, n_blocks[req - 1]
        row[2], row[3] = end_req, end_blk
        sched.append(row)
    return sched, offsets
