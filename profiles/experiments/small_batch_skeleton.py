"""GPU, timing only: the floor of a small-batch decode's dataflow, no math (profiles/NOTES.md,
"Small batches: the ceilings"). A CTA per (split, 64-head tile, request), a request's splits
in one cluster of S (non-cooperative launch, no plan, no global partials):

1. at entry, Q's 64 x 576 tile by cp.async, and the request's length (one global load);
2. the split's blocks (blocks s·n/S .. (s+1)·n/S of n = ceil(L / 64)): each block's page id
   from the block table, then its 64 x 640 bytes by cp.async, two blocks in flight;
3. a cluster barrier, then each CTA pushes a stand-in fp32 O (64 x 512, one value per
   element derived from the loaded bytes) to the rows' owners through distributed shared
   memory (st.shared::cluster), a second cluster barrier, and each owner sums its rows over
   the S senders and stores them bf16.

What is left out against a real kernel: QK, softmax, PV and the LSE weights of the merge.
Printed beside it: the shipped call and its "no compute, no store" variant on the same data.

    python3 profiles/experiments/small_batch_skeleton.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from snapmla_cute import jit_cache, ptx
from snapmla_cute.kernels import fake

THREADS = 256
ROWS = 64  # heads per CTA
HEAD_BYTES = 576 * 2
BLOCK_BYTES = 64 * 640  # one 64-token page of the FP8 cache
Q_BYTES = ROWS * HEAD_BYTES
SMEM_BYTES = Q_BYTES + 2 * BLOCK_BYTES  # the receive buffer (at most (64 + S) x 2 KB) aliases it
COLS_PER_THREAD = 512 // 4  # 4 threads per row


@dataclass(frozen=True)
class SkeletonConfig:
    splits: int  # S: the cluster's size, a request's splits


class SmallBatchSkeleton:
    def __init__(self, cfg: SkeletonConfig):
        self.cfg = cfg
        self.per = -(-ROWS // cfg.splits)  # rows each CTA owns in the merge

    @cute.jit
    def __call__(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_table: cute.Tensor, m_lens: cute.Tensor,
                 m_out: cute.Tensor, stream):
        @cute.struct
        class SharedStorage:
            buf: cute.struct.Align[cute.struct.MemRange[Float32, SMEM_BYTES // 4], 128]

        self.shared_storage = SharedStorage
        S = self.cfg.splits
        self.kernel(m_q, m_kv, m_table, m_lens, m_out).launch(
            grid=[S, m_q.shape[1] // ROWS, m_q.shape[0]], block=[THREADS, 1, 1], cluster=[S, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.jit
    def load_block(self, g_kv_base: Int64, page: Int32, dst: Int32, tidx: Int32):
        src = g_kv_base + Int64(page) * BLOCK_BYTES
        for k in cutlass.range_constexpr(BLOCK_BYTES // 16 // THREADS):
            off = (k * THREADS + tidx) * 16
            ptx.cp_async_or_zero(dst + off, src + off, 16, Int32(1))
        cute.arch.cp_async_commit_group()

    @cute.kernel
    def kernel(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_table: cute.Tensor, m_lens: cute.Tensor,
               m_out: cute.Tensor):
        S = self.cfg.splits
        per = self.per
        tidx, _, _ = cute.arch.thread_idx()
        split, tile, req = cute.arch.block_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        buf = storage.buf.get_tensor(cute.make_layout((SMEM_BYTES // 4,)))
        base = storage.buf.data_ptr().toint()
        # 1. Q's tile and the length, side by side
        q_src = m_q.iterator.toint() + (Int64(req) * m_q.shape[1] + tile * ROWS) * HEAD_BYTES
        for k in cutlass.range_constexpr(Q_BYTES // 16 // THREADS):
            off = (k * THREADS + tidx) * 16
            ptx.cp_async_or_zero(base + off, q_src + off, 16, Int32(1))
        cute.arch.cp_async_commit_group()
        seqlen = m_lens[req]
        n = (seqlen + 63) // 64
        lo = split * n // S
        hi = (split + 1) * n // S
        # 2. the split's blocks, two in flight
        g_kv = m_kv.iterator.toint()
        kv0 = base + Q_BYTES
        acc = Float32(0.0)
        if lo < hi:
            self.load_block(g_kv, m_table[req, lo], kv0, tidx)
        for blk in cutlass.range(lo, hi, unroll=1):
            slot = (blk - lo) % 2
            if blk + 1 < hi:
                self.load_block(g_kv, m_table[req, blk + 1], kv0 + (1 - slot) * BLOCK_BYTES, tidx)
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            acc += buf[(Q_BYTES + slot * BLOCK_BYTES) // 4 + tidx]  # a use of the block (no math)
            cute.arch.sync_threads()  # the slot is refilled next
        cute.arch.cp_async_wait_group(0)
        acc += buf[tidx]  # and of Q
        # 3. every CTA is done with its buffer before peers push into it
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        row = tidx // 4
        col0 = (tidx % 4) * COLS_PER_THREAD
        owner = row // per
        dst = ptx.mapa(base + ((split * per + row - owner * per) * 512 + col0) * 4, owner)
        for c in cutlass.range_constexpr(COLS_PER_THREAD // 4):
            v = acc + Float32(c)
            ptx.st_cluster_v4(dst + c * 16, v, v, v, v)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        first = split * per
        mine = cutlass.min(per, ROWS - first)
        for i in cutlass.range(tidx, mine * 512, THREADS, unroll=1):
            r = i // 512
            c = i % 512
            total = Float32(0.0)
            for s in cutlass.range_constexpr(S):
                total += buf[(s * per + r) * 512 + c]
            m_out[req, tile * ROWS + first + r, c] = BFloat16(total)


def fake_args(cfg: SkeletonConfig):
    b, h, pages, width = fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (t(BFloat16, (b, h, 576), (fake.sym(), 576, 1), 16), t(cutlass.Uint8, (pages, BLOCK_BYTES), (BLOCK_BYTES, 1), 16),
            t(Int32, (b, width), (fake.sym(), 1), 4), t(Int32, (b,), (1,), 4),
            t(BFloat16, (b, h, 512), (fake.sym(), 512, 1), 16), fake.stream())


def compile_skeleton(cfg: SkeletonConfig, arch: str | None = None):
    return jit_cache.compile_kernel("small_batch_skeleton", cfg, SmallBatchSkeleton, fake_args, arch=arch)


ROWS_TIMED = [  # (b, h, s_k, splits to try)
    (1, 128, 640, (1, 2, 4, 5, 8)),
    (8, 128, 640, (1, 2, 4)),
    (1, 128, 8192, (2, 4, 8)),
    (1, 64, 8192, (2, 4, 8)),
    (8, 128, 8192, (2, 4, 8)),
]


def main():
    from snapmla_cute import decode_metadata, mla_decode, quantize_q
    from snapmla_cute.bench import decode_case
    from snapmla_cute.timing import time_us
    from snapmla_cute.tuning import DECODE_TUNING

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for b, h, s_k, splits in ROWS_TIMED:
        c = decode_case(b, h, 1, [s_k] * b, 64, False)
        call = c.serving_call()
        shipped = time_us(call)
        DECODE_TUNING.clear()
        DECODE_TUNING.update({"skip": ("qk", "pv", "transpose", "softmax", "store"), "cluster": 1})
        md = decode_metadata(c.seqlens, s_q=1, heads=h, cluster=1)
        bare = time_us(lambda: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md, out=c.out, lse=c.lse,
                                          check=False))
        DECODE_TUNING.clear()
        row = dict(row=f"b{b} h{h} s_k{s_k}", shipped_us=round(shipped, 1), no_compute_no_store_us=round(bare, 1))
        q = c.q.view(b, h, 576).contiguous()
        kv = c.cache.kv.view(c.cache.kv.shape[0], BLOCK_BYTES)
        out = torch.empty(b, h, 512, dtype=torch.bfloat16, device="cuda")
        for S in splits:
            fn = compile_skeleton(SkeletonConfig(S)).fn
            fn(q, kv, c.block_table, c.seqlens, out)
            torch.cuda.synchronize()
            row[f"skeleton_S{S}_us"] = round(time_us(lambda: fn(q, kv, c.block_table, c.seqlens, out)), 1)
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    from tabulate import tabulate

    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
