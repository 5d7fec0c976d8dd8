"""GPU, timing only: the dataflow of a plan-free small-batch decode without its math
(profiles/NOTES.md, "Small batches: the dataflow without its math"). A CTA per (split, tile
of ``rows`` heads, request), each step of the dataflow a ``stop`` that cuts the rest off:

1. ``entry``: Q's rows x 576 by cp.async and the request's length (one global load), side by
   side; the rows the CTA owns stored (16-byte stores);
2. ``stream``: + the split's blocks (blocks s·n/S .. (s+1)·n/S of n = ceil(L / 64)): each
   block's page id from the block table, then its 64 x 640 bytes by cp.async, ``stages`` in
   flight;
3. ``merge``: + the request's S splits in one cluster of S: each CTA pushes a stand-in O (fp32,
   or f16 pairs) to the rows' owners through distributed shared memory, conflict-free, and each
   owner sums its rows over the S senders; or ``gmerge``: + the same through global memory
   (partials, a count per tile released and acquired as the shipped merge's, the S partials'
   loads in flight).

``launch`` returns at entry. Left out against a real kernel: QK, softmax, PV and the LSE
weights of the merge. Printed beside it: the shipped call and its "no compute, no store"
variant. ``--what`` picks the tables: ``rows`` (those), ``sweep`` (the shipped kernel on
few parts, with and without compute), ``chain`` (the shipped kernel on one or two blocks a
part with one stage left out at a time).

    python3 profiles/experiments/small_batch_skeleton.py [--what rows sweep chain] [--json out.json]
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
HEAD_BYTES = 576 * 2
BLOCK_BYTES = 64 * 640  # one 64-token page of the FP8 cache
STOPS = ("launch", "entry", "stream", "merge", "gmerge")  # gmerge: through global memory, no cluster


@dataclass(frozen=True)
class SkeletonConfig:
    splits: int  # S: the cluster's size, a request's splits
    rows: int = 64  # heads per CTA: 64 (a WGMMA tile), or 16 (heads split across CTAs)
    stages: int = 2  # KV blocks in flight per CTA
    stop: str = "merge"  # how much of the dataflow runs (STOPS, in order): the decomposition
    merge_bytes: int = 4  # bytes per pushed O element: 4 (fp32) or 2 (f16 pairs)


class SmallBatchSkeleton:
    def __init__(self, cfg: SkeletonConfig):
        assert cfg.stop in STOPS and cfg.merge_bytes in (2, 4) and cfg.rows in (16, 32, 64)
        self.cfg = cfg
        self.rows = cfg.rows
        self.q_bytes = cfg.rows * HEAD_BYTES
        self.smem_bytes = self.q_bytes + cfg.stages * BLOCK_BYTES  # the merge's receive buffer aliases it
        assert self.smem_bytes <= 227 * 1024 and cfg.splits % min(cfg.splits, 16) == 0
        if cfg.stop == "merge":
            assert cfg.splits <= 8 and (cfg.rows + cfg.splits) * 512 * cfg.merge_bytes <= self.smem_bytes
        self.per = -(-cfg.rows // cfg.splits)  # rows each CTA owns in the merge
        self.units = 512 * cfg.merge_bytes // 16  # 16-byte units of a merged row
        self.upc = self.units // 64  # units per 8 output columns
        self.threads_per_row = THREADS // cfg.rows
        self.words_per_thread = 512 * cfg.merge_bytes // 4 // self.threads_per_row  # pushed per thread

    @cute.jit
    def __call__(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_table: cute.Tensor, m_lens: cute.Tensor,
                 m_out: cute.Tensor, m_ws: cute.Tensor, m_cnt: cute.Tensor, stream):
        @cute.struct
        class SharedStorage:
            buf: cute.struct.Align[cute.struct.MemRange[Float32, self.smem_bytes // 4], 128]

        self.shared_storage = SharedStorage
        S = self.cfg.splits
        self.kernel(m_q, m_kv, m_table, m_lens, m_out, m_ws, m_cnt).launch(
            grid=[S, m_q.shape[1] // self.rows, m_q.shape[0]], block=[THREADS, 1, 1],
            cluster=[S if self.cfg.stop == "merge" else 1, 1, 1],
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
               m_out: cute.Tensor, m_ws: cute.Tensor, m_cnt: cute.Tensor):
        cfg = self.cfg
        S, rows, per, stages = cfg.splits, self.rows, self.per, cfg.stages
        tidx, _, _ = cute.arch.thread_idx()
        split, tile, req = cute.arch.block_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        buf = storage.buf.get_tensor(cute.make_layout((self.smem_bytes // 4,)))
        base = storage.buf.data_ptr().toint()
        first = split * per
        mine = cutlass.min(per, rows - first)
        if cutlass.const_expr(cfg.stop != "launch"):
            # 1. Q's tile and the length, side by side
            q_src = m_q.iterator.toint() + (Int64(req) * m_q.shape[1] + tile * rows) * HEAD_BYTES
            for k in cutlass.range_constexpr(-(-self.q_bytes // 16 // THREADS)):
                off = (k * THREADS + tidx) * 16
                if cutlass.const_expr((k + 1) * THREADS * 16 <= self.q_bytes):
                    ptx.cp_async_or_zero(base + off, q_src + off, 16, Int32(1))
                elif off < self.q_bytes:
                    ptx.cp_async_or_zero(base + off, q_src + off, 16, Int32(1))
            cute.arch.cp_async_commit_group()
            seqlen = m_lens[req]
            n = (seqlen + 63) // 64
            lo = split * n // S
            hi = (split + 1) * n // S
            acc = Float32(0.0)
            if cutlass.const_expr(cfg.stop != "entry"):
                # 2. the split's blocks, `stages` in flight
                g_kv = m_kv.iterator.toint()
                kv0 = base + self.q_bytes
                for k in cutlass.range_constexpr(stages - 1):
                    if lo + k < hi:
                        self.load_block(g_kv, m_table[req, lo + k], kv0 + k * BLOCK_BYTES, tidx)
                    else:
                        cute.arch.cp_async_commit_group()
                for blk in cutlass.range(lo, hi, unroll=1):
                    slot = (blk - lo) % stages
                    ahead = blk + stages - 1
                    if ahead < hi:
                        self.load_block(g_kv, m_table[req, ahead], kv0 + ((ahead - lo) % stages) * BLOCK_BYTES, tidx)
                    else:
                        cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(stages - 1)
                    cute.arch.sync_threads()
                    acc += buf[(self.q_bytes + slot * BLOCK_BYTES) // 4 + tidx]  # a use of the block (no math)
                    cute.arch.sync_threads()  # the slot is refilled next
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            acc += buf[tidx]  # and of Q
            if cutlass.const_expr(cfg.stop == "gmerge"):
                self.global_merge(m_q, m_out, m_ws, m_cnt, acc, req, tile, split, first, mine, tidx)
            elif cutlass.const_expr(cfg.stop != "merge"):
                # no merge: each CTA stores the rows it would own after one
                for i in cutlass.range(tidx, mine * 64, THREADS, unroll=1):
                    v = cute.make_rmem_tensor((8,), Float32)
                    for e in cutlass.range_constexpr(8):
                        v[e] = acc + Float32(e)
                    self.store8(m_out, req * m_q.shape[1] + tile * rows + first + i // 64, i % 64, v)
            else:
                # 3. every CTA is done with its buffer before peers push into it
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                units, upc = self.units, self.upc
                row = tidx // self.threads_per_row
                t = tidx % self.threads_per_row
                owner = row // per
                r = row - owner * per
                # unit u of row r from sender s at ((s·units + u)·per + r)·16: a warp's lanes
                # (consecutive rows, then t) fill whole 128-byte lines, no bank conflicts
                for uu in cutlass.range_constexpr(self.words_per_thread // 4):
                    u = uu * self.threads_per_row + t
                    v = acc + Float32(uu)
                    ptx.st_cluster_v4(ptx.mapa(base + ((split * units + u) * per + r) * 16, owner), v, v, v, v)
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                for i in cutlass.range(tidx, mine * 64, THREADS, unroll=1):
                    rr = i // 64
                    oc = i % 64
                    tot = cute.make_rmem_tensor((8,), Float32)
                    for e in cutlass.range_constexpr(8):
                        tot[e] = Float32(0.0)
                    for s in cutlass.range_constexpr(S):
                        for k in cutlass.range_constexpr(upc):
                            self.add_unit(tot, buf, (s * units + oc * upc + k) * per + rr, k)
                    self.store8(m_out, req * m_q.shape[1] + tile * rows + first + rr, oc, tot)

    @cute.jit
    def global_merge(self, m_q, m_out, m_ws, m_cnt, acc, req, tile, split, first, mine, tidx):
        """The split-KV merge through global memory, as the shipped kernel's (a count per
        tile, the S CTAs co-resident): every CTA writes its rows' partial, counts itself
        (release), waits for all S (acquire), then merges the rows it owns from the S
        partials in L2; the last to finish resets the counts for the next call."""
        cfg = self.cfg
        S, rows = cfg.splits, self.rows
        units, upc = self.units, self.upc
        slab = req * (m_q.shape[1] // rows) + tile
        row0 = (slab * S + split) * rows  # this CTA's rows in the workspace [*, units x 16 B]
        for k in cutlass.range_constexpr(rows * units // THREADS):
            i = k * THREADS + tidx
            x = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                x[e] = acc + Float32(e + k)
            cute.autovec_copy(x, cute.local_tile(m_ws, (4,), ((row0 + i // units) * units + i % units,)))
        cute.arch.sync_threads()
        cnt = m_cnt.iterator + 2 * slab
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(cnt, Int32(1), sem="release", scope="gpu")
            seen = cute.arch.load(cnt, Int32, sem="acquire", scope="gpu")
            while seen < S:
                seen = cute.arch.load(cnt, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, mine * 64, THREADS, unroll=1):
            rr = i // 64
            oc = i % 64
            tot = cute.make_rmem_tensor((8,), Float32)
            for e in cutlass.range_constexpr(8):
                tot[e] = Float32(0.0)
            G = min(S, 16)  # the splits' loads of a group in flight together (no serial L2 trips)
            for g in cutlass.range(S // G, unroll=1):
                for sg in cutlass.range_constexpr(G):
                    for k in cutlass.range_constexpr(upc):
                        self.add_unit(tot, m_ws, ((slab * S + g * G + sg) * rows + first + rr) * units + oc * upc + k, k)
            self.store8(m_out, req * m_q.shape[1] + tile * rows + first + rr, oc, tot)
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(cnt + 1, Int32(1), sem="acq_rel", scope="gpu")
            if old == S - 1:
                m_cnt[2 * slab] = 0
                m_cnt[2 * slab + 1] = 0

    @cute.jit
    def add_unit(self, tot: cute.Tensor, src: cute.Tensor, idx, k: cutlass.Constexpr):
        """Unit ``k`` of an output chunk (``src``'s 16-byte unit ``idx``) into the chunk's 8
        sums: two fp32 units fill them; one unit of f16 pairs (4 stand-in floats) counts for both
        halves."""
        x = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(cute.local_tile(src, (4,), (idx,)), x)
        for e in cutlass.range_constexpr(4):
            if cutlass.const_expr(self.upc == 2):
                tot[4 * k + e] = tot[4 * k + e] + x[e]
            else:
                tot[e] = tot[e] + x[e]
                tot[4 + e] = tot[4 + e] + x[e]

    @cute.jit
    def store8(self, m_out: cute.Tensor, row: Int32, chunk: Int32, v: cute.Tensor):
        """Eight columns of an output row (of b·h) as one 16-byte store."""
        o = cute.make_rmem_tensor((8,), BFloat16)
        for e in cutlass.range_constexpr(8):
            o[e] = v[e].to(BFloat16)
        cute.autovec_copy(o, cute.local_tile(m_out[row, None], (8,), (chunk,)))


def fake_args(cfg: SkeletonConfig):
    b, h, pages, width = fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (t(BFloat16, (b, h, 576), (fake.sym(), 576, 1), 16), t(cutlass.Uint8, (pages, BLOCK_BYTES), (BLOCK_BYTES, 1), 16),
            t(Int32, (b, width), (fake.sym(), 1), 4), t(Int32, (b,), (1,), 4),
            t(BFloat16, (fake.sym(), 512), (512, 1), 16), t(Float32, (fake.sym(),), (1,), 16),
            t(Int32, (fake.sym(),), (1,), 4), fake.stream())


def compile_skeleton(cfg: SkeletonConfig, arch: str | None = None):
    return jit_cache.compile_kernel("small_batch_skeleton", cfg, SmallBatchSkeleton, fake_args, arch=arch)


def V(splits, rows, stages, *stops, merge_bytes=4):
    return [SkeletonConfig(splits, rows, stages, stop, merge_bytes) for stop in stops]


ROWS_TIMED = [  # (b, h, s_k), the variants timed there
    ((1, 128, 640), V(5, 64, 2, *STOPS[:-1]) + V(5, 64, 2, "merge", merge_bytes=2) + V(8, 16, 2, "merge")
     + V(10, 64, 2, "stream") + V(5, 64, 2, "gmerge", merge_bytes=2) + V(10, 64, 2, "gmerge", merge_bytes=2)
     + V(10, 64, 2, "gmerge") + V(16, 16, 2, "gmerge", merge_bytes=2)),
    ((8, 128, 640), V(4, 64, 3, "stream") + V(4, 64, 3, "gmerge", merge_bytes=2) + V(8, 64, 2, "gmerge", merge_bytes=2)),
    ((1, 64, 8192), V(8, 64, 3, "stream", "merge") + V(8, 16, 4, "merge")
     + V(32, 64, 3, "stream", "gmerge") + V(32, 64, 3, "gmerge", merge_bytes=2) + V(64, 64, 3, "stream")
     + V(64, 64, 3, "gmerge", merge_bytes=2) + V(128, 64, 2, "gmerge", merge_bytes=2)),
    ((8, 128, 8192), V(8, 64, 3, "stream") + V(8, 64, 3, "gmerge", merge_bytes=2)),
    ((1, 128, 2048), V(8, 64, 3, "stream", "merge") + V(16, 64, 3, "stream") + V(16, 64, 3, "gmerge", merge_bytes=2)
     + V(32, 64, 2, "stream") + V(32, 64, 2, "gmerge", merge_bytes=2)),
    ((1, 16, 2048), V(8, 16, 4, "stream", "merge") + V(16, 16, 4, "stream") + V(16, 16, 4, "gmerge", merge_bytes=2)
     + V(32, 16, 2, "stream") + V(32, 16, 2, "gmerge", merge_bytes=2)),
    ((8, 16, 2048), V(8, 16, 4, "merge") + V(16, 16, 4, "stream") + V(16, 16, 4, "gmerge", merge_bytes=2)),
]
COMPUTE = ("qk", "pv", "transpose", "softmax")  # the profiling skips that leave no compute
# the shipped kernel on one (two) blocks a part with one stage left out at a time: which
# part of the compute chain a lone CTA's first block waits on
CHAIN_SKIPS = [(), ("transpose",), ("softmax",), ("softmax", "transpose"), ("pv",), ("qk",), COMPUTE]
CHAIN_ROWS = [((1, 128, 2048), (32, 16), CHAIN_SKIPS), ((1, 16, 2048), (32,), CHAIN_SKIPS[:4] + CHAIN_SKIPS[-1:])]
# the shipped kernel on few parts, with and without compute: a lone CTA's time per block
PART_SWEEP = [(shape, parts, [(), COMPUTE])
              for shape, parts in (((1, 64, 8192), (4, 8, 16, 32, 64)), ((1, 128, 2048), (2, 4, 8, 16, 32)),
                                   ((1, 16, 2048), (8, 16, 32)))]


def name(cfg: SkeletonConfig) -> str:
    return f"S{cfg.splits} r{cfg.rows} st{cfg.stages} {cfg.stop}" + (" f16" if cfg.merge_bytes == 2 else "")


def shipped_us(c, md, skip=()) -> float:
    """Graph-replay µs of the shipped decode of case ``c`` on ``md``'s parts (no clusters),
    with the profiling ``skip`` stages left out."""
    from snapmla_cute import mla_decode
    from snapmla_cute.timing import time_us
    from snapmla_cute.tuning import DECODE_TUNING

    DECODE_TUNING.clear()
    DECODE_TUNING.update({"skip": skip, "cluster": 1})
    try:
        return time_us(lambda: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md, out=c.out, lse=c.lse,
                                          check=False))
    finally:
        DECODE_TUNING.clear()


def few_parts(specs) -> list[dict]:
    """One row per (shape, part count) of ``specs``: the shipped kernel with each skip set."""
    from snapmla_cute import decode_metadata
    from snapmla_cute.bench import decode_case

    rows = []
    for (b, h, s_k), parts, skips in specs:
        c = decode_case(b, h, 1, [s_k] * b, 64, False)
        for P in parts:
            md = decode_metadata(c.seqlens, s_q=1, heads=h, num_parts=P, cluster=1)
            row = dict(shape=f"b{b} h{h} s_k{s_k}", variant=f"shipped on {P} parts ({-(-s_k // 64 // P)} blocks a part)")
            for skip in skips:
                label = "us" if not skip else "no compute" if skip == COMPUTE else "no " + "+".join(skip)
                row[label] = round(shipped_us(c, md, skip), 1)
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    from snapmla_cute import decode_metadata
    from snapmla_cute.bench import decode_case
    from snapmla_cute.timing import time_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--what", nargs="+", default=["rows"], choices=["rows", "sweep", "chain"],
                    help="rows: ROWS_TIMED; sweep: the shipped kernel on few parts (PART_SWEEP); chain: its stages "
                         "left out on one or two blocks a part (CHAIN_ROWS)")
    args = ap.parse_args()
    rows = few_parts(CHAIN_ROWS) if "chain" in args.what else []
    for (b, h, s_k), variants in ROWS_TIMED if "rows" in args.what else ():
        c = decode_case(b, h, 1, [s_k] * b, 64, False)
        shape = f"b{b} h{h} s_k{s_k}"
        shipped = time_us(c.serving_call())
        bare = shipped_us(c, decode_metadata(c.seqlens, s_q=1, heads=h, cluster=1), COMPUTE + ("store",))
        rows += [dict(shape=shape, variant="shipped", us=round(shipped, 1)),
                 dict(shape=shape, variant="shipped, no compute, no store", us=round(bare, 1))]
        q = c.q.view(b, h, 576).contiguous()
        kv = c.cache.kv.view(c.cache.kv.shape[0], BLOCK_BYTES)
        out = torch.empty(b * h, 512, dtype=torch.bfloat16, device="cuda")
        for cfg in variants:
            fn = compile_skeleton(cfg).fn
            tiles = h // cfg.rows
            ws = torch.empty(b * tiles * cfg.splits * cfg.rows * 128 * cfg.merge_bytes, device="cuda")
            cnt = torch.zeros(2 * b * tiles, dtype=torch.int32, device="cuda")
            fn(q, kv, c.block_table, c.seqlens, out, ws, cnt)
            torch.cuda.synchronize()
            rows.append(dict(shape=shape, variant=name(cfg),
                             us=round(time_us(lambda: fn(q, kv, c.block_table, c.seqlens, out, ws, cnt)), 1)))
            print(rows[-1], flush=True)
    if "sweep" in args.what:
        rows += few_parts(PART_SWEEP)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    from tabulate import tabulate

    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
