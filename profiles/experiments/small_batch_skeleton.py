"""GPU, timing only: the dataflow of a plan-free small-batch decode without its math
(profiles/small_batches.md, "Small batches: the dataflow without its math"). A CTA per (split, tile
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

The ETAP-16 compute on the DSMEM path (``SkeletonConfig.compute``, ``EtapSkeleton``; the
issue "a small-batch, few-heads kernel: tokens on WGMMA's M"): 16 heads a CTA, the real QK
(Sᵀ = K·Qᵀ), softmax along M with one cross-warp reduction a block, P to e4m3 into shared
memory as Pᵀ, PV (Oᵀ = Vᵀ·Pᵀ, V by ldmatrix.trans as the register A operand), then O/ℓ and
the LSE merged in the cluster with the LSE weights; its section's comment has the layout.
``--what gate`` times it beside the same dataflow without math, the shipped call and
FlashMLA's FP8 decode (``GATE_ROWS``) and prints the gate's verdict at b1 h128 s_k640;
``--compile-only`` (no GPU) compiles the gate's variants and prints their SASS counts.

    python3 profiles/experiments/small_batch_skeleton.py [--what rows sweep chain gate] [--json out.json]
    CUTE_DSL_ARCH=sm_90a python3 profiles/experiments/small_batch_skeleton.py --compile-only
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator

from snapmla_cute import jit_cache, ptx
from snapmla_cute.format import FP8_MAX
from snapmla_cute.kernels import fake
from snapmla_cute.kernels.decode.config import INV_FP8_MAX, P_TINY
from snapmla_cute.layouts import mma as M
from snapmla_cute.layouts import smem as L

FP8 = cutlass.Float8E4M3FN

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
    # the ETAP-16 compute on the DSMEM path (``EtapSkeleton``; stop "merge", rows 16,
    # S in 1, 2, 4, 8, stages >= 3): real QK, softmax, P and PV, then O/ℓ and the LSE merged
    compute: bool = False


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


# ------------------------------------------------------------------------------------------
# ETAP-16 compute on the DSMEM path (``SkeletonConfig.compute``): tokens on WGMMA's M
# ------------------------------------------------------------------------------------------
#
# A CTA per (split, 16-head group, request), its split's blocks s·n/S .. (s+1)·n/S as above.
# Three warpgroups: WG0 and WG1 compute, WG2 loads.
#
# * Loads (WG2): Q's 16 rows (e4m3 content as a K-major SW128 (16, 512) tile, bf16 RoPE as
#   (16, 64), σ_q) and the split's blocks by cp.async, each 16-byte piece straight to its
#   swizzled place (content (64, 512) SW128, RoPE (64, 64) SW128, the 64 σ_k), ``stages``
#   in flight; each thread's copies arrive on the stage's ``full`` mbarrier
#   (cp.async.mbarrier.arrive.noinc, 128 arrivals); a stage is refilled once all 256 compute
#   threads have arrived on its ``empty`` mbarrier. Tokens past the length are zero-filled.
# * QK (the block's owner WG, blocks alternate WG0/WG1): Sᵀ = K·Qᵀ, m64n16 with the K
#   tile as A and Q as B from shared memory: 16 e4m3 k-steps, then 4 bf16 RoPE k-steps on
#   the same accumulator (Eq. 6), the first with scale-d 0. Issued two blocks ahead.
# * Softmax along M: a thread holds 2 tokens x 4 heads of Sᵀ. Per head it reduces
#   max(t) and max(t·q_fac + log2 σ_k) (t = acc·σ_k) over its tokens and the 8 lanes of
#   its column (3 shuffles), writes them per warp, and after ONE barrier of the 256
#   compute threads every thread reads the owner's 4 warps' partials and updates the
#   state of its 4 heads identically: m = max(m, q_fac·max t), P'max = 2^(max(t·q_fac +
#   log2 σ_k) - m) (the block maximum of P' = P·σ_k, from the same reduction), σ_p =
#   P'max/448, γ = 2^(m_prev - m)·σ_p,prev/σ_p (App. C, Alg. 1 line 9). ℓ stays a per-thread
#   partial (γ-rescaled every block) and is reduced once at the end.
# * P → shared memory as Pᵀ (the owner): P' / σ_p to e4m3 with the pair (token g, token
#   g+8) of a head in one b16, so one stmatrix.x2.trans per warp writes each head's 16
#   tokens as a 16-byte row of the K-major SW64 (16 heads, 64) B tile, K position 2j + b
#   holding token j + 8b of the warp's 16 (the order σ below). A second barrier publishes it.
# * PV (both WGs, 256 dims each): Oᵀ = Vᵀ·Pᵀ, four m64n16 GEMMs a WG (eight a block), V
#   as the register A operand: per 32-token k-step one ldmatrix.x4.trans from the
#   token-major stage and four prmt (b25dddd's addresses, selectors 0x6240/0x7351 for the
#   order σ), P as B from shared memory; each GEMM in a zeroed temporary, o = γ·o + PV in
#   fp32 (as today's kernel).
# * The split's O/ℓ (fp32) and its LSE go to the heads' owners in the cluster through
#   distributed shared memory (rank r owns heads r·16/S ..): one v4 store per thread,
#   GEMM tile and head pair, into a receive area of the owner's own (no wait for the peers'
#   stages); one cluster barrier; each owner merges its heads over the S splits with the
#   LSE weights and stores bf16 (and the LSE, to ``ws``). S = 1 stores directly.

ETAP_HEADS = 16  # heads a CTA (WGMMA's N)
ETAP_MATH_THREADS = 256  # WG0, WG1
ETAP_THREADS = 384  # + WG2, the loads
ETAP_STAGE_BYTES = 64 * 512  # a stage's e4m3 content (its RoPE and scales apart)
V_SEL = (0x6240, 0x7351)  # prmt: dim 2c / 2c+1 of the tokens (2q, 2q+8, 2q+1, 2q+9)
RED_BAR = 1  # named barrier of the 256 compute threads
# setmaxnreg: the load WG gives up registers to the math WGs (128·40 + 256·232 = 384·168,
# the pool of one 384-thread CTA on an SM)
ETAP_LOAD_REGS = 40
ETAP_MATH_REGS = 232
LN2 = 0.6931471805599453


def sigma_token(k: int) -> int:
    """Token of K position ``k`` (0..63) of the Pᵀ tile and of the V fragments: within each
    16, position 2j + b holds token j + 8b (the pair a thread of Sᵀ holds, token g and g+8)."""
    g, r = divmod(k, 16)
    return 16 * g + r // 2 + 8 * (r % 2)


def _swz(offset, bits):
    return offset ^ (((offset >> (4 + 3)) & ((1 << bits) - 1)) << 4)


def q16_offset(row, col_byte):
    """Byte offset of e4m3 element (row, col) of the K-major SW128 (16, 512) Q tile."""
    return (col_byte // 128) * 2048 + _swz((row % 8) * 128 + (row // 8) * 1024 + col_byte % 128, 3)


def p16_offset(head, k):
    """Byte offset of e4m3 element (head, K position k) of the K-major SW64 (16, 64) Pᵀ tile."""
    return _swz((head % 8) * 64 + (head // 8) * 512 + k, 2)


def v_lane_base(wg, warp, lane):
    """This lane's ldmatrix row address in a stage for dims tile 0, k-step 0 (b25dddd's
    ``layouts/v_operand.py``): token ``lane``, dims 256·wg + 16·warp."""
    return wg * 2 * 8192 + (lane >> 3) * 1024 + (lane & 7) * 128 + ((warp ^ (lane & 7)) << 4)


def v_lane_addr(base, h: int, kb: int):
    """``v_lane_base`` moved to the WG's 64-dim tile ``h`` and 32-token k-step ``kb``."""
    return (base ^ (64 * (h % 2))) + (h // 2) * 8192 + kb * (32 * 128)


def _check_etap_maps():
    """The V fragments (ldmatrix.trans + prmt) and the Pᵀ stores (stmatrix.x2.trans) replayed
    on byte labels: both in the order σ, every byte where the A / B operand wants it."""
    from snapmla_cute.layouts.smem import content_offset
    from snapmla_cute.layouts.transpose import prmt

    tile = bytearray(64 * 512)
    label = {}
    for tok in range(64):
        for dim in range(512):
            v = (tok * 7 + dim * 13) % 251
            tile[content_offset(tok, dim)] = v
            label[tok, dim] = v

    def b16(off):
        return tile[off] | (tile[off + 1] << 8)

    for wg in range(2):
        for warp in range(4):
            for h in range(4):
                for kb in range(2):
                    rows = [v_lane_addr(v_lane_base(wg, warp, lane), h, kb) for lane in range(32)]
                    for lane in range(32):
                        q, c = lane & 3, lane >> 2
                        regs = [b16(rows[8 * m + 2 * q] + 2 * c) | (b16(rows[8 * m + 2 * q + 1] + 2 * c) << 16)
                                for m in range(4)]
                        words = [prmt(regs[0], regs[1], V_SEL[0]), prmt(regs[0], regs[1], V_SEL[1]),
                                 prmt(regs[2], regs[3], V_SEL[0]), prmt(regs[2], regs[3], V_SEL[1])]
                        for i, w in enumerate(words):  # A word i: row c + 8(i%2), k 16(i//2) + 4q ..
                            dim = 256 * wg + 64 * h + 16 * warp + 2 * c + i % 2
                            k0 = 32 * kb + 16 * (i // 2) + 4 * q
                            want = [label[sigma_token(k0 + e), dim] for e in range(4)]
                            assert list(w.to_bytes(4, "little")) == want, (wg, warp, h, kb, lane, i)
    # Pᵀ: lane (g, t) of warp w holds P(token 16w + g + 8i, head 2t + e + 8m); its register
    # m is the bytes (e, i) = (0, 0), (0, 1), (1, 0), (1, 1) (``pack_e4m3x4``'s order)
    buf = [None] * 1024
    for warp in range(4):
        regs = {}
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs[lane] = [[(16 * warp + g + 8 * i, 2 * t + e + 8 * m) for e in range(2) for i in range(2)]
                          for m in range(2)]
        for m in range(2):
            for j in range(8):  # stored row j of matrix m: the address of lane 8m + j
                addr = p16_offset(8 * m + j, 16 * warp)
                for i in range(8):  # element (i, j): lane 4i + j // 2, half j % 2 of its register m
                    buf[addr + 2 * i: addr + 2 * i + 2] = regs[4 * i + j // 2][m][2 * (j % 2): 2 * (j % 2) + 2]
    for head in range(16):
        for k in range(64):
            assert buf[p16_offset(head, k)] == (sigma_token(k), head), (head, k)


_check_etap_maps()


class EtapSkeleton:
    """The ETAP-16 compute on the DSMEM path (the section's comment above): a CTA per
    (split, 16-head group, request), clusters of S along the splits."""

    def __init__(self, cfg: SkeletonConfig):
        S = cfg.splits
        assert cfg.compute and cfg.stop == "merge" and cfg.rows == ETAP_HEADS and S in (1, 2, 4, 8)
        assert cfg.stages >= 3, "QK is issued two blocks ahead of the PV that frees a stage"
        self.cfg = cfg
        self.per = ETAP_HEADS // S  # heads each rank owns in the merge
        self.recv_floats = S * self.per * 512 if S > 1 else 4

    @cute.jit
    def __call__(self, m_q_nope: cute.Tensor, m_q_rope: cute.Tensor, m_q_scale: cute.Tensor, m_kv: cute.Tensor,
                 m_kv_scale: cute.Tensor, m_table: cute.Tensor, m_lens: cute.Tensor, m_out: cute.Tensor,
                 m_lse: cute.Tensor, scale_log2: Float32, stream):
        cfg = self.cfg
        stages = cfg.stages
        K = OperandMajorMode.K
        qk = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, ETAP_HEADS))
        qk0 = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, ETAP_HEADS))
        qk_rope = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K, K, Float32, (1, 1, 1), (64, ETAP_HEADS))
        pv = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, ETAP_HEADS),
                                               warpgroup.OperandSource.RMEM)
        pv0 = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, ETAP_HEADS),
                                                warpgroup.OperandSource.RMEM)
        q_sl = _sl("K_SW128", FP8, (ETAP_HEADS, 512), 1)
        qr_sl = _sl("K_SW128", BFloat16, (ETAP_HEADS, 64), 1)
        kv_sl = _sl("K_SW128", FP8, (64, 512), stages)
        kr_sl = _sl("K_SW128", BFloat16, (64, 64), stages)
        p_sl = _sl("K_SW64", FP8, (ETAP_HEADS, 64), 2)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1 + 2 * stages]  # Q full, KV full[st], KV empty[st]
            red: cute.struct.Align[cute.struct.MemRange[Float32, 2 * ETAP_HEADS * 4 * 2], 16]  # (slot, head, warp, 2)
            lsum: cute.struct.Align[cute.struct.MemRange[Float32, 8 * ETAP_HEADS], 16]  # (warp, head)
            q_scale: cute.struct.Align[cute.struct.MemRange[Float32, ETAP_HEADS], 16]
            recv_lse: cute.struct.Align[cute.struct.MemRange[Float32, 8 * ETAP_HEADS], 16]  # (split, head)
            ks: cute.struct.Align[cute.struct.MemRange[Float32, 64 * stages], 128]
            q_nope: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(q_sl)], 1024]
            q_rope: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(qr_sl)], 1024]
            kv: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(kv_sl)], 1024]
            kr: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kr_sl)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(p_sl)], 1024]
            recv: cute.struct.Align[cute.struct.MemRange[Float32, self.recv_floats], 128]

        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() > 227 * 1024):
            raise ValueError(f"small_batch_skeleton: {SharedStorage.size_in_bytes()} B of shared memory")
        S = cfg.splits
        self.kernel(qk, qk0, qk_rope, pv, pv0, q_sl, qr_sl, kv_sl, kr_sl, p_sl, m_q_nope, m_q_rope, m_q_scale, m_kv,
                    m_kv_scale, m_table, m_lens, m_out, m_lse, scale_log2).launch(
            grid=[S, m_q_nope.shape[1] // ETAP_HEADS, m_q_nope.shape[0]], block=[ETAP_THREADS, 1, 1],
            cluster=[S, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)  # fixes the register pool so ptxas honours setmaxnreg

    @cute.kernel
    def kernel(self, qk: cute.TiledMma, qk0: cute.TiledMma, qk_rope: cute.TiledMma, pv: cute.TiledMma,
               pv0: cute.TiledMma, q_sl: cute.ComposedLayout, qr_sl: cute.ComposedLayout, kv_sl: cute.ComposedLayout,
               kr_sl: cute.ComposedLayout, p_sl: cute.ComposedLayout, m_q_nope: cute.Tensor, m_q_rope: cute.Tensor,
               m_q_scale: cute.Tensor, m_kv: cute.Tensor, m_kv_scale: cute.Tensor, m_table: cute.Tensor,
               m_lens: cute.Tensor, m_out: cute.Tensor, m_lse: cute.Tensor, scale_log2: Float32):
        cfg = self.cfg
        S, stages = cfg.splits, cfg.stages
        tidx, _, _ = cute.arch.thread_idx()
        split, tile, req = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        storage = SmemAllocator().allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 128)
            for st in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(mbar + 1 + st, 128)
                cute.arch.mbarrier_init(mbar + 1 + stages + st, ETAP_MATH_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(S > 1):
            cute.arch.cluster_arrive_relaxed()  # waited before the first remote store
        seqlen = m_lens[req]
        n = (seqlen + 63) // 64
        lo = split * n // S
        nb = (split + 1) * n // S - lo
        heads = m_q_nope.shape[1]
        row0 = req * heads + tile * ETAP_HEADS  # this CTA's first row of q / out (b·h rows)
        recv = storage.recv.get_tensor(cute.make_layout((self.recv_floats,)))
        recv_lse = storage.recv_lse.get_tensor(cute.make_layout((8 * ETAP_HEADS,)))
        # each role to its end (no code after the branches: the two budgets differ)
        if wg == 2:
            cute.arch.setmaxregister_decrease(ETAP_LOAD_REGS)
            self.load(storage, m_q_nope, m_q_rope, m_q_scale, m_kv, m_kv_scale, m_table, req, row0, seqlen, lo, nb,
                      tidx - ETAP_MATH_THREADS)
            if cutlass.const_expr(S > 1):
                # the cluster barrier's two phases, as the math WGs (which also merge)
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
        else:
            cute.arch.setmaxregister_increase(ETAP_MATH_REGS)
            self.compute(storage, qk, qk0, qk_rope, pv, pv0, q_sl, qr_sl, kv_sl, kr_sl, p_sl, m_out, m_lse,
                         scale_log2, split, row0, seqlen, lo, nb, wg, tidx)
            if cutlass.const_expr(S > 1):
                cute.arch.cluster_wait()  # every split's rows and LSEs arrived
                self.merge(recv, recv_lse, m_out, m_lse, row0, split, tidx)

    # ---------------------------------------------------------------- WG2: the loads
    @cute.jit
    def load(self, storage, m_q_nope: cute.Tensor, m_q_rope: cute.Tensor, m_q_scale: cute.Tensor, m_kv: cute.Tensor,
             m_kv_scale: cute.Tensor, m_table: cute.Tensor, req: Int32, row0: Int32, seqlen: Int32, lo: Int32,
             nb: Int32, ptid: Int32):
        """Q's tile and σ_q, then the split's blocks, ``stages`` in flight (the section's comment)."""
        stages = self.cfg.stages
        mbar = storage.mbar.data_ptr()
        # Q: 512 content pieces (16 rows x 32), 128 RoPE pieces (16 x 8), 4 of σ_q
        q_src = m_q_nope.iterator.toint() + Int64(row0) * 512
        q_dst = storage.q_nope.data_ptr().toint()
        for k in cutlass.range_constexpr(4):
            u = k * 128 + ptid
            ptx.cp_async_or_zero(q_dst + q16_offset(u // 32, (u % 32) * 16), q_src + u * 16, 16, Int32(1))
        qr_dst = storage.q_rope.data_ptr().toint()
        qr_src = m_q_rope.iterator.toint() + Int64(row0) * 128
        ptx.cp_async_or_zero(qr_dst + L.rope_offset(ptid // 8, (ptid % 8) * 8), qr_src + ptid * 16, 16, Int32(1))
        if ptid < 4:
            ptx.cp_async_or_zero(storage.q_scale.data_ptr().toint() + ptid * 16,
                                 m_q_scale.iterator.toint() + Int64(row0) * 4 + ptid * 16, 16, Int32(1))
        ptx.cp_async_arrive_noinc(mbar.toint())
        # KV: thread p takes 16-byte pieces b + 2j (b = p % 2, j < 20) of token p // 2: 32
        # contiguous bytes a token per instruction, and on the shared side 4 wavefronts per
        # 512 bytes (the swizzle spreads a warp's 16 tokens x 2 pieces over the banks)
        tok = ptid // 2
        b = ptid % 2
        lane_dst = (tok % 8) * 128 + (tok // 8) * 1024 + ((b ^ (tok % 8)) << 4)
        g_kv = m_kv.iterator.toint() + Int64(tok * 640 + b * 16)
        g_ks = m_kv_scale.iterator.toint() + Int64(ptid * 16)
        kv0 = storage.kv.data_ptr().toint() + lane_dst
        kr0 = storage.kr.data_ptr().toint() + lane_dst
        ks0 = storage.ks.data_ptr().toint() + ptid * 16
        lane = ptid % 32
        pages = Int32(0)
        for i in cutlass.range(nb, unroll=1):
            stage = i % stages
            if i % 32 == 0:
                # the next 32 blocks' page ids, a lane each, in one load (not a dependent
                # global load before every block's copies)
                pages = Int32(0)
                if i + lane < nb:
                    pages = m_table[req, lo + i + lane]
            page = cute.arch.shuffle_sync(pages, i % 32)
            if i >= stages:
                cute.arch.mbarrier_wait(mbar + 1 + stages + stage, (i // stages - 1) % 2)
            read = Int32(tok < seqlen - (lo + i) * 64)  # tokens past the length: zeros
            src = g_kv + Int64(page) * BLOCK_BYTES
            for j in cutlass.range_constexpr(16):
                dst = (kv0 ^ (32 * (j % 4))) + (j // 4) * 8192 + stage * ETAP_STAGE_BYTES
                ptx.cp_async_or_zero(dst, src + 32 * j, 16, read)
            for j in cutlass.range_constexpr(4):
                dst = (kr0 ^ (32 * j)) + stage * (64 * 128)
                ptx.cp_async_or_zero(dst, src + 512 + 32 * j, 16, read)
            if ptid < 16:
                ptx.cp_async_or_zero(ks0 + stage * 256, g_ks + Int64(page) * 256, 16, Int32(1))
            ptx.cp_async_arrive_noinc((mbar + 1 + stage).toint())

    # ---------------------------------------------------------------- WG0, WG1: the math
    @cute.jit
    def compute(self, storage, qk: cute.TiledMma, qk0: cute.TiledMma, qk_rope: cute.TiledMma, pv: cute.TiledMma,
                pv0: cute.TiledMma, q_sl: cute.ComposedLayout, qr_sl: cute.ComposedLayout, kv_sl: cute.ComposedLayout,
                kr_sl: cute.ComposedLayout, p_sl: cute.ComposedLayout, m_out: cute.Tensor, m_lse: cute.Tensor,
                scale_log2: Float32, split: Int32, row0: Int32, seqlen: Int32, lo: Int32, nb: Int32, wg: Int32,
                tidx: Int32):
        """Both math WGs over all of the split's blocks; block i's QK, softmax and P are its
        owner's (WG i % 2), its PV both WGs' (256 dims each). Per block one barrier of the
        256 threads: before it the owner publishes P(i) and the other WG the maxima of its
        block i+1; after it both run PV(i), waited (and added, o = γ·o + PV) in the next
        block under its softmax."""
        cfg = self.cfg
        stages = cfg.stages
        wg_tidx = tidx % 128
        warp = cute.arch.make_warp_uniform(wg_tidx // 32)
        lane = tidx % 32
        mbar = storage.mbar.data_ptr()
        for mma in (qk, qk_rope, pv):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        for mma in (qk0, pv0):
            mma.set(warpgroup.Field.ACCUMULATE, False)
        s_q = storage.q_nope.get_tensor(q_sl.outer, swizzle=q_sl.inner)
        s_qr = storage.q_rope.get_tensor(qr_sl.outer, swizzle=qr_sl.inner)
        s_kv = storage.kv.get_tensor(kv_sl.outer, swizzle=kv_sl.inner)
        s_kr = storage.kr.get_tensor(kr_sl.outer, swizzle=kr_sl.inner)
        s_p = storage.p.get_tensor(p_sl.outer, swizzle=p_sl.inner)
        ks = storage.ks.get_tensor(cute.make_layout((64 * stages,)))
        red = storage.red.get_tensor(cute.make_layout((2 * ETAP_HEADS * 4 * 2,)))
        q_scale = storage.q_scale.get_tensor(cute.make_layout((ETAP_HEADS,)))
        qk_thr = qk.get_slice(wg_tidx)
        qkr_thr = qk_rope.get_slice(wg_tidx)
        pv_thr = pv.get_slice(wg_tidx)
        t_k = qk_thr.make_fragment_A(qk_thr.partition_A(s_kv))
        t_q = qk_thr.make_fragment_B(qk_thr.partition_B(s_q))
        t_kr = qkr_thr.make_fragment_A(qkr_thr.partition_A(s_kr))
        t_qr = qkr_thr.make_fragment_B(qkr_thr.partition_B(s_qr))
        t_p = pv_thr.make_fragment_B(pv_thr.partition_B(s_p))
        qk_mmas = (qk, qk0, qk_rope, t_k, t_q, t_kr, t_qr)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((64, ETAP_HEADS)))
        acc_s_mn = cute.make_tensor(acc_s.iterator, M.acc_mn_layout(qk, acc_s.layout))
        c_s = qk_thr.partition_C(cute.make_identity_tensor((64, ETAP_HEADS)))
        c_mn = cute.make_tensor(c_s.iterator, M.acc_mn_layout(qk, c_s.layout))  # (token, head) of (r, c)
        acc_o = [pv_thr.make_fragment_C(pv_thr.partition_shape_C((64, ETAP_HEADS))) for _ in range(4)]
        acc_o_mn = [cute.make_tensor(a.iterator, M.acc_mn_layout(pv, a.layout)) for a in acc_o]
        temps = [pv_thr.make_fragment_C(pv_thr.partition_shape_C((64, ETAP_HEADS))) for _ in range(4)]
        temps_mn = [cute.make_tensor(a.iterator, M.acc_mn_layout(pv, a.layout)) for a in temps]
        frags = [pv.make_fragment_A(pv_thr.partition_shape_A((64, 64))) for _ in range(4)]
        # the state of this thread's 4 heads (columns of Sᵀ and of Oᵀ alike)
        row_max = cute.make_rmem_tensor((4,), Float32)
        sigma_p = cute.make_rmem_tensor((4,), Float32)
        row_sum = cute.make_rmem_tensor((4,), Float32)  # this thread's share of ℓ
        q_fac = cute.make_rmem_tensor((4,), Float32)
        gamma = cute.make_rmem_tensor((4,), Float32)
        gamma_pv = cute.make_rmem_tensor((4,), Float32)  # γ of the block whose PV is in flight
        inv = cute.make_rmem_tensor((4,), Float32)
        m_safe = cute.make_rmem_tensor((4,), Float32)
        sk = cute.make_rmem_tensor((2,), Float32)  # σ_k of my two tokens of my next block
        # t = acc·σ_k of my next block, kept for its P: not in acc_s, whose registers only
        # WGMMAs may define (else ptxas serializes every WGMMA, C7515: the owner's QK(i+2) is
        # still in flight where its branch joins the other's)
        s_t = cute.make_rmem_tensor((2, 4), Float32)
        for c in cutlass.range_constexpr(4):
            row_max[c] = -Float32.inf
            sigma_p[c] = Float32(1.0)
            row_sum[c] = Float32(0.0)
        for h in cutlass.range_constexpr(4):
            acc_o[h].fill(0.0)
        cute.arch.mbarrier_wait(mbar, 0)  # Q and σ_q
        cute.arch.fence_proxy("async.shared", space="cta")  # cp.async's writes, read by WGMMA
        for c in cutlass.range_constexpr(4):
            q_fac[c] = q_scale[c_mn[0, c][1]] * scale_log2  # σ_q·scale·log2e
        v_base = storage.kv.data_ptr().toint() + v_lane_base(wg, warp, lane)
        p_lane = storage.p.data_ptr().toint() + p16_offset(lane % 16, 16 * warp)
        # each WG's first block (WG0 block 0, WG1 block 1): QK and its maxima before the loop,
        # so that every wait in the loop is the same on every path ptxas follows (a read of
        # acc_s it cannot prove complete serializes every WGMMA of the kernel: C7514)
        if wg < nb:
            self.wait_kv(mbar, wg)
            self.issue_qk(qk_mmas, acc_s, wg % stages)
            warpgroup.wait_group(0)
            self.maxima(acc_s_mn, s_t, c_mn, sk, q_fac, ks, red, wg % stages, seqlen - (lo + wg) * 64, wg, warp, lane)
        cute.arch.barrier(barrier_id=RED_BAR, number_of_threads=ETAP_MATH_THREADS)
        for i in cutlass.range(nb, unroll=1):
            slot = i % 2
            self.update_state(red, slot, c_mn, q_fac, row_max, sigma_p, gamma, inv, m_safe)
            if i % 2 == wg:
                # the owner: P(i) to shared memory (from s_t: PV(i-1) stays in flight), then
                # PV(i-1) waited and added, then QK of block i+2
                self.publish_p(s_t, sk, q_fac, m_safe, inv, gamma, row_sum, p_lane + slot * 1024)
                cute.arch.fence_proxy("async.shared", space="cta")
                if i > 0:
                    warpgroup.wait_group(0)
                    self.finish_pv(acc_o_mn, temps_mn, gamma_pv, mbar, (i - 1) % stages)
                if i + 2 < nb:
                    self.wait_kv(mbar, i + 2)
                    self.issue_qk(qk_mmas, acc_s, (i + 2) % stages)
            else:
                for c in cutlass.range_constexpr(4):
                    row_sum[c] = row_sum[c] * gamma[c]
                if i + 1 < nb and i > 0:
                    # my block i+1 (block 1's was reduced before the loop): its QK was issued
                    # at block i-1, before PV(i-1). wait_group(0), so PV(i-1) too: ptxas does
                    # not follow a wait_group(1) across the loop's back edge, and a read of
                    # acc_s it cannot prove complete serializes every WGMMA (C7514)
                    warpgroup.wait_group(0)
                    self.maxima(acc_s_mn, s_t, c_mn, sk, q_fac, ks, red, (i + 1) % stages, seqlen - (lo + i + 1) * 64,
                                (i + 1) % 2, warp, lane)
                if i > 0:
                    warpgroup.wait_group(0)
                    self.finish_pv(acc_o_mn, temps_mn, gamma_pv, mbar, (i - 1) % stages)
            for c in cutlass.range_constexpr(4):
                gamma_pv[c] = gamma[c]
            cute.arch.barrier(barrier_id=RED_BAR, number_of_threads=ETAP_MATH_THREADS)
            self.issue_pv(pv, pv0, frags, temps, t_p, slot, v_base + (i % stages) * ETAP_STAGE_BYTES)
        warpgroup.wait_group(0)  # unconditional: ptxas does not tie the loop's trips to nb
        if nb > 0:
            self.finish_pv(acc_o_mn, temps_mn, gamma_pv, mbar, (nb - 1) % stages)
        self.finish_split(acc_o_mn, c_mn, row_max, sigma_p, row_sum, storage, m_out, m_lse, split, row0, wg, warp,
                          lane, tidx)

    @cute.jit
    def wait_kv(self, mbar, i: Int32):
        """Block i of the split has landed (its stage's ``full`` phase), fenced for WGMMA."""
        stages = self.cfg.stages
        cute.arch.mbarrier_wait(mbar + 1 + i % stages, (i // stages) % 2)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def issue_qk(self, qk_mmas, acc_s: cute.Tensor, stage: Int32):
        """Sᵀ = K·Qᵀ of one block, asynchronously: 16 e4m3 k-steps (the first with scale-d 0),
        then the 4 bf16 RoPE k-steps on the same accumulator (Eq. 6)."""
        qk, qk0, qk_rope, t_k, t_q, t_kr, t_qr = qk_mmas
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(t_k, mode=[2])):
            cute.gemm(qk0 if kb == 0 else qk, acc_s, t_k[None, None, kb, stage], t_q[None, None, kb, 0], acc_s)
        for kb in cutlass.range_constexpr(cute.size(t_kr, mode=[2])):
            cute.gemm(qk_rope, acc_s, t_kr[None, None, kb, stage], t_qr[None, None, kb, 0], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def maxima(self, acc_s_mn: cute.Tensor, s_t: cute.Tensor, c_mn: cute.Tensor, sk: cute.Tensor, q_fac: cute.Tensor, ks: cute.Tensor,
               red: cute.Tensor, stage: Int32, valid: Int32, slot: Int32, warp: Int32, lane: Int32):
        """The owner's half of the block's one reduction: t = acc·σ_k (-inf past the length,
        kept in ``s_t`` for P, σ_k in ``sk``), per head max(t) and max(t·q_fac + log2 σ_k)
        over this thread's 2 tokens and its column's 8 lanes, written per warp to
        ``red[slot]`` as (head, warp, 2). t goes to ``s_t`` (acc_s is left to the WGMMAs)."""
        lk = [None, None]
        for r in cutlass.range_constexpr(2):
            s = ks[stage * 64 + c_mn[r, 0][0]]
            if c_mn[r, 0][0] >= valid:
                s = Float32(0.0)
            sk[r] = s
            lk[r] = cute.math.log2(s, fastmath=True)
        mx = []
        for c in cutlass.range_constexpr(4):
            ts = []
            us = []
            for r in cutlass.range_constexpr(2):
                t = acc_s_mn[r, c] * sk[r]
                if c_mn[r, 0][0] >= valid:
                    t = -Float32.inf
                s_t[r, c] = t
                ts.append(t)
                us.append(t * q_fac[c] + lk[r])
            mx.append(cute.arch.fmax(ts[0], ts[1]))
            mx.append(cute.arch.fmax(us[0], us[1]))
        for off in (4, 8, 16):
            for k in cutlass.range_constexpr(8):
                mx[k] = cute.arch.fmax(mx[k], cute.arch.shuffle_sync_bfly(mx[k], offset=off))
        if lane < 4:
            for c in cutlass.range_constexpr(4):
                base = ((slot * ETAP_HEADS + c_mn[0, c][1]) * 4 + warp) * 2
                red[base] = mx[2 * c]
                red[base + 1] = mx[2 * c + 1]

    @cute.jit
    def update_state(self, red: cute.Tensor, slot: Int32, c_mn: cute.Tensor, q_fac: cute.Tensor,
                     row_max: cute.Tensor, sigma_p: cute.Tensor, gamma: cute.Tensor, inv: cute.Tensor,
                     m_safe: cute.Tensor):
        """Every thread, every block: the owner's 4 warps' partials of its 4 heads → the new
        m, σ_p = P'max/448 (P'max = 2^(max(t·q_fac + log2 σ_k) - m)), 1/σ_p and γ
        (Alg. 1 lines 6-9, as ``softmax.OnlineSoftmax.step``)."""
        for c in cutlass.range_constexpr(4):
            v = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.local_tile(red, (8,), (slot * ETAP_HEADS + c_mn[0, c][1],)), v)
            t_max = cute.arch.fmax(cute.arch.fmax(v[0], v[2]), cute.arch.fmax(v[4], v[6]))
            u_max = cute.arch.fmax(cute.arch.fmax(v[1], v[3]), cute.arch.fmax(v[5], v[7]))
            m_prev = row_max[c]
            mn = cute.arch.fmax(m_prev, t_max * q_fac[c])
            ms = mn
            if mn == -Float32.inf:
                ms = Float32(0.0)
            p_max = cute.math.exp2(u_max - ms, fastmath=True)
            sig_prev = sigma_p[c]
            num = Float32(1.0)
            den = sig_prev
            sig_cur = sig_prev
            if p_max > Float32(P_TINY):
                num = Float32(FP8_MAX)
                den = p_max
                sig_cur = p_max * Float32(INV_FP8_MAX)
            iv = num / den
            g = Float32(0.0)
            if m_prev != -Float32.inf:
                g = cute.math.exp2(m_prev - ms, fastmath=True) * sig_prev * iv
            row_max[c] = mn
            sigma_p[c] = sig_cur
            gamma[c] = g
            inv[c] = iv
            m_safe[c] = ms

    @cute.jit
    def publish_p(self, s_t: cute.Tensor, sk: cute.Tensor, q_fac: cute.Tensor, m_safe: cute.Tensor,
                  inv: cute.Tensor, gamma: cute.Tensor, row_sum: cute.Tensor, p_addr: Int32):
        """The owner: P = 2^(t·q_fac - m), P' = P·σ_k, P'/σ_p to e4m3, (token g, token g+8)
        of a head in one b16 → one stmatrix.x2.trans (the Pᵀ rows of heads 0-7, 8-15: K
        positions in the order σ); ℓ = γ·ℓ + ΣP/σ_p over this thread's tokens."""
        pf = [[None] * 4, [None] * 4]
        for c in cutlass.range_constexpr(4):
            ps = []
            for r in cutlass.range_constexpr(2):
                p = cute.math.exp2(s_t[r, c] * q_fac[c] - m_safe[c], fastmath=True)
                ps.append(p)
                pf[r][c] = p * sk[r] * inv[c]
            row_sum[c] = gamma[c] * row_sum[c] + (ps[0] + ps[1]) * inv[c]
        w0 = ptx.pack_e4m3x4(pf[0][0], pf[1][0], pf[0][1], pf[1][1])  # heads 2t, 2t+1
        w1 = ptx.pack_e4m3x4(pf[0][2], pf[1][2], pf[0][3], pf[1][3])  # heads 2t+8, 2t+9
        ptx.stsm_x2_trans(p_addr, w0, w1)

    @cute.jit
    def issue_pv(self, pv: cute.TiledMma, pv0: cute.TiledMma, frags: list, temps: list, t_p: cute.Tensor, slot: Int32,
                 v_stage: Int32):
        """This WG's 256 dims of Oᵀ = Vᵀ·Pᵀ for one block, asynchronously: per 64-dim tile two
        ldmatrix.x4.trans + prmt k-steps of V (the order σ) as A, Pᵀ[slot] as B, into a
        zeroed temporary."""
        for h in cutlass.range_constexpr(4):
            words = cute.recast_tensor(frags[h], Uint32)
            for kb in cutlass.range_constexpr(2):
                r0, r1, r2, r3 = ptx.ldsm_x4_trans(v_lane_addr(v_stage, h, kb))
                w4 = [cute.arch.prmt(r0, r1, V_SEL[0]), cute.arch.prmt(r0, r1, V_SEL[1]),
                      cute.arch.prmt(r2, r3, V_SEL[0]), cute.arch.prmt(r2, r3, V_SEL[1])]
                for k in cutlass.range_constexpr(4):
                    words[k, 0, kb] = Uint32(w4[k])
        warpgroup.fence()
        for h in cutlass.range_constexpr(4):
            for kb in cutlass.range_constexpr(2):
                cute.gemm(pv0 if kb == 0 else pv, temps[h], frags[h][None, None, kb], t_p[None, None, kb, slot],
                          temps[h])
        warpgroup.commit_group()

    @cute.jit
    def finish_pv(self, acc_o_mn: list, temps_mn: list, gamma_pv: cute.Tensor, mbar, stage: Int32):
        """o = γ·o + PV of the block just waited for (fp32, per head column); its stage is
        free for this thread."""
        for h in cutlass.range_constexpr(4):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(4):
                    acc_o_mn[h][r, c] = acc_o_mn[h][r, c] * gamma_pv[c] + temps_mn[h][r, c]
        cute.arch.mbarrier_arrive(mbar + 1 + self.cfg.stages + stage)

    @cute.jit
    def finish_split(self, acc_o_mn: list, c_mn: cute.Tensor, row_max: cute.Tensor, sigma_p: cute.Tensor,
                     row_sum: cute.Tensor, storage, m_out: cute.Tensor, m_lse: cute.Tensor, split: Int32, row0: Int32,
                     wg: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """ℓ over the 256 threads (the one reduction at the end), the split's LSE (log2),
        then O/ℓ: stored (S = 1), or pushed with the LSE to each head's owner in the cluster
        (fp32, one v4 store per GEMM tile and head pair: dims d, d+1 of two heads)."""
        S, per = self.cfg.splits, self.per
        lsum = storage.lsum.get_tensor(cute.make_layout((8 * ETAP_HEADS,)))
        for c in cutlass.range_constexpr(4):
            s = row_sum[c]
            for off in (4, 8, 16):
                s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
            if lane < 4:
                lsum[(tidx // 32) * ETAP_HEADS + c_mn[0, c][1]] = s
        cute.arch.barrier(barrier_id=RED_BAR, number_of_threads=ETAP_MATH_THREADS)
        lse = cute.make_rmem_tensor((4,), Float32)
        inv_l = cute.make_rmem_tensor((4,), Float32)
        for c in cutlass.range_constexpr(4):
            tot = tree([lsum[w * ETAP_HEADS + c_mn[0, c][1]] for w in range(8)], lambda a, b: a + b)
            lse[c] = -Float32.inf
            inv_l[c] = Float32(0.0)
            if tot > Float32(0.0):
                lse[c] = row_max[c] + cute.math.log2(tot * sigma_p[c], fastmath=True)
                inv_l[c] = Float32(1.0) / tot
        # Oᵀ row g of warp w is dim 16w + 2g, row g + 8 dim 16w + 2g + 1 (the V fragment's rows)
        d0 = 256 * wg + 16 * warp + 2 * (lane // 4)
        if cutlass.const_expr(S == 1):
            for h in cutlass.range_constexpr(4):
                for c in cutlass.range_constexpr(4):
                    o = cute.make_rmem_tensor((2,), BFloat16)
                    o[0] = (acc_o_mn[h][0, c] * inv_l[c]).to(BFloat16)
                    o[1] = (acc_o_mn[h][1, c] * inv_l[c]).to(BFloat16)
                    cute.autovec_copy(o, cute.local_tile(m_out[row0 + c_mn[0, c][1], None], (2,), ((d0 + 64 * h) // 2,)))
            if tidx < 4:
                for c in cutlass.range_constexpr(4):
                    m_lse[row0 + c_mn[0, c][1]] = lse[c] * Float32(LN2)
        else:
            recv = storage.recv.data_ptr().toint()
            recv_lse = storage.recv_lse.data_ptr().toint()
            cute.arch.cluster_wait()  # every peer has started (the entry's arrival)
            for e in cutlass.range_constexpr(2):
                head = c_mn[0, 2 * e][1]  # heads head, head + 1 (same owner: per is even)
                owner = head // per
                hl = head % per
                for h in cutlass.range_constexpr(4):
                    dp = (d0 + 64 * h) // 2
                    addr = recv + (((split * 256 + dp) * per + hl) * 2) * 4
                    ptx.st_cluster_v4(ptx.mapa(addr, owner),
                                      acc_o_mn[h][0, 2 * e] * inv_l[2 * e], acc_o_mn[h][1, 2 * e] * inv_l[2 * e],
                                      acc_o_mn[h][0, 2 * e + 1] * inv_l[2 * e + 1],
                                      acc_o_mn[h][1, 2 * e + 1] * inv_l[2 * e + 1])
            if tidx < 4:
                for c in cutlass.range_constexpr(4):
                    head = c_mn[0, c][1]
                    ptx.st_cluster_f32(ptx.mapa(recv_lse + (split * ETAP_HEADS + head % per) * 4, head // per), lse[c])
            cute.arch.cluster_arrive()  # release: the rows are out

    @cute.jit
    def merge(self, recv: cute.Tensor, recv_lse: cute.Tensor, m_out: cute.Tensor, m_lse: cute.Tensor, row0: Int32,
              split: Int32, tidx: Int32):
        """This rank's heads (split·per ..) over the S splits, weighted by 2^(lse_s - max),
        by the 256 math threads: a (dim pair, head) item each, its S pairs loaded together."""
        S, per = self.cfg.splits, self.per
        for it in cutlass.range(tidx, per * 256, ETAP_MATH_THREADS, unroll=1):
            hl = it % per
            dp = it // per
            lses = [recv_lse[s * ETAP_HEADS + hl] for s in range(S)]
            l_max = tree(lses, cute.arch.fmax)
            l_safe = l_max
            if l_max == -Float32.inf:
                l_safe = Float32(0.0)
            ws = [cute.math.exp2(x - l_safe, fastmath=True) for x in lses]
            w_sum = tree(ws, lambda a, b: a + b)
            acc = [Float32(0.0), Float32(0.0)]
            for s in cutlass.range_constexpr(S):
                x = cute.make_rmem_tensor((2,), Float32)
                cute.autovec_copy(cute.local_tile(recv, (2,), ((s * 256 + dp) * per + hl,)), x)
                acc[0] = acc[0] + ws[s] * x[0]
                acc[1] = acc[1] + ws[s] * x[1]
            iw = Float32(0.0)
            if w_sum > Float32(0.0):
                iw = Float32(1.0) / w_sum
            o = cute.make_rmem_tensor((2,), BFloat16)
            o[0] = (acc[0] * iw).to(BFloat16)
            o[1] = (acc[1] * iw).to(BFloat16)
            row = row0 + split * per + hl
            cute.autovec_copy(o, cute.local_tile(m_out[row, None], (2,), (dp,)))
            if dp == 0:
                lse = -Float32.inf
                if w_sum > Float32(0.0):
                    lse = (l_max + cute.math.log2(w_sum, fastmath=True)) * Float32(LN2)
                m_lse[row] = lse


def _sl(kind: str, dtype, shape, stages: int):
    """A K-major swizzled shared-memory layout (``layouts.smem``'s construction) of
    ``stages`` tiles ``shape``."""
    atom = warpgroup.make_smem_layout_atom(getattr(warpgroup.SmemLayoutAtomKind, kind), dtype)
    return cute.tile_to_shape(atom, (*shape, stages), order=(0, 1, 2))


def tree(vals, op):
    """op over vals as a balanced tree."""
    vals = list(vals)
    while len(vals) > 1:
        nxt = [op(vals[k], vals[k + 1]) for k in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def etap_fake_args(cfg: SkeletonConfig):
    b, h, pages, width = fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (t(cutlass.Uint8, (b, h, 512), (fake.sym(), 512, 1), 16), t(BFloat16, (b, h, 64), (fake.sym(), 64, 1), 16),
            t(Float32, (b, h), (fake.sym(), 1), 16), t(cutlass.Uint8, (pages, BLOCK_BYTES), (BLOCK_BYTES, 1), 16),
            t(Float32, (pages, 64), (64, 1), 16), t(Int32, (b, width), (fake.sym(), 1), 4), t(Int32, (b,), (1,), 4),
            t(BFloat16, (fake.sym(), 512), (512, 1), 16), t(Float32, (fake.sym(),), (1,), 4), Float32(0.0),
            fake.stream())


def fake_args(cfg: SkeletonConfig):
    b, h, pages, width = fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (t(BFloat16, (b, h, 576), (fake.sym(), 576, 1), 16), t(cutlass.Uint8, (pages, BLOCK_BYTES), (BLOCK_BYTES, 1), 16),
            t(Int32, (b, width), (fake.sym(), 1), 4), t(Int32, (b,), (1,), 4),
            t(BFloat16, (fake.sym(), 512), (512, 1), 16), t(Float32, (fake.sym(),), (1,), 16),
            t(Int32, (fake.sym(),), (1,), 4), fake.stream())


def compile_skeleton(cfg: SkeletonConfig, arch: str | None = None, keep_sass: bool = False):
    if cfg.compute:
        return jit_cache.compile_kernel("small_batch_etap", cfg, EtapSkeleton, etap_fake_args, arch=arch,
                                        keep_sass=keep_sass)
    return jit_cache.compile_kernel("small_batch_skeleton", cfg, SmallBatchSkeleton, fake_args, arch=arch,
                                    keep_sass=keep_sass)


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


def E(splits, stages=4):
    """The ETAP-16 compute variant on S = ``splits`` (a cluster of S per 16-head group)."""
    return SkeletonConfig(splits, 16, stages, "merge", compute=True)


# the gate (``--what gate``): per row the ETAP-16 compute at a few split counts, each beside
# the same dataflow without math (``merge``, 16 rows a CTA, same S and stages)
GATE_ROWS = [
    ((1, 128, 640), (8, 4, 2)),  # 10 blocks: 1-2, 2-3, 5 a CTA; 64 / 32 / 16 CTAs
    ((1, 64, 8192), (8, 4)),  # 128 blocks: 16 or 32 a CTA on 32 / 16 CTAs
    ((1, 16, 32768), (8, 4)),  # 512 blocks on 8 / 4 CTAs (one cluster: the design's limit)
    ((8, 128, 8192), (2, 1, 4)),  # 64 groups: 128 / 64 / 256 CTAs, 64 / 128 / 32 blocks a CTA
]
GATE_PROVES = 0.60  # the design proves out at <= 0.60x FlashMLA's time at b1 h128 s_k640
GATE_DEAD = 0.75  # and is dead at >= 0.75x


def gate_variants() -> list[SkeletonConfig]:
    """Every distinct variant the gate compiles: the compute ones, then their no-math partners."""
    splits = sorted({S for _, ss in GATE_ROWS for S in ss}, reverse=True)
    return [E(S) for S in splits] + [SkeletonConfig(S, 16, 4, "merge") for S in splits]


def compile_check(arch: str) -> int:
    """Compiles the gate's variants for ``arch`` with their SASS and prints what it shows;
    returns the number of violations (local memory anywhere; a compute variant whose
    WGMMAs ptxas serialized: gmma_run < 2)."""
    import re
    import time

    from tabulate import tabulate

    from snapmla_cute.sass import kernel_resources, sass_counts

    rows, bad = [], 0
    for cfg in gate_variants():
        t0 = time.time()
        art = compile_skeleton(cfg, arch=arch, keep_sass=True).artifacts
        sass = str(art.SASS or "")
        counts = sass_counts(sass)
        res = max(kernel_resources(art.CUBIN), key=lambda k: (k.registers, k.frame_bytes))
        ok = counts.local_traffic == 0 and res.frame_bytes == 0 and (not cfg.compute or counts.gmma_run >= 2)
        bad += not ok
        rows.append(dict(variant=name(cfg), registers=res.registers,
                         max_reg_used=max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1) + 1,
                         frame_bytes=res.frame_bytes, LDL=counts.local_ld, STL=counts.local_st, QGMMA=counts.qgmma,
                         HGMMA=counts.hgmma, gmma_run=counts.gmma_run, sass_instructions=counts.instructions,
                         compile_s=round(time.time() - t0, 1), ok="yes" if ok else "NO"))
        print(rows[-1], flush=True)
    print(tabulate(rows, headers="keys"))
    print(f"{arch}: {len(rows) - bad} of {len(rows)} variants pass (0 local memory; compute: gmma_run >= 2)")
    return bad


def gate(rounds: int = 2) -> list[dict]:
    """The gate's timings on this GPU (graph replay, µs): per row FlashMLA's FP8 decode, the
    shipped ``mla_decode`` (its default metadata) and the variants of ``GATE_ROWS`` without
    math, ``rounds`` rounds each; then each ETAP-16 compute variant: one call whose output is
    compared with the shipped call's (rel-L2; LSE max abs), then ``rounds`` timings. The
    baselines go first so that a row's figures are out before its first compute launch."""
    from snapmla_cute import peers
    from snapmla_cute import reference as ref
    from snapmla_cute.bench import decode_case
    from snapmla_cute.steps import DEFAULT_SCALE_LOG2 as _DEFAULT_SCALE_LOG2
    from snapmla_cute.timing import time_us

    rows = []
    for (b, h, s_k), splits in GATE_ROWS:
        shape = f"b{b} h{h} s_k{s_k}"
        c = decode_case(b, h, 1, [s_k] * b, 64, False)
        flash = peers.dense_us(c.q, c.kv_pages, c.block_table, c.seqlens, which=("dense_fp8",))["dense_fp8"]
        flash = None if flash is None else round(flash, 1)
        q_nope = c.qq[0].view(torch.uint8).view(b, h, 512)
        q_rope = c.qq[1].view(b, h, 64)
        q_scale = c.qq[2].view(b, h)
        kv = c.cache.kv.view(c.cache.kv.shape[0], BLOCK_BYTES)
        out = torch.empty(b * h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(b * h, device="cuda")  # the compute variants' LSE (natural log)
        cnt = torch.zeros(2 * b * h, dtype=torch.int32, device="cuda")
        q_bf16 = c.q.view(b, h, 576).contiguous()
        base = [("shipped mla_decode", c.serving_call())]
        comp = []
        for S in splits:
            base.append((name(SkeletonConfig(S, 16, 4, "merge")), functools.partial(
                compile_skeleton(SkeletonConfig(S, 16, 4, "merge")).fn, q_bf16, kv, c.block_table, c.seqlens, out,
                lse, cnt)))
            comp.append((name(E(S)), functools.partial(
                compile_skeleton(E(S)).fn, q_nope, q_rope, q_scale, kv, c.cache.kv_scale, c.block_table, c.seqlens,
                out, lse, _DEFAULT_SCALE_LOG2)))
        found = {label: dict(shape=shape, variant=label, flashmla_fp8_us=flash) for label, _ in base + comp}
        for rnd in range(rounds):
            for label, call in base:
                found[label][f"us_{rnd + 1}"] = round(time_us(call), 1)
                print(found[label], flush=True)
        for label, call in comp:
            print(f"{shape} {label}: first call", flush=True)
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            row = found[label]
            row["rel_l2_vs_shipped"] = float(f"{ref.rel_l2(out.view(b, 1, h, 512).float(), c.out.float()):.2e}")
            row["lse_max_abs"] = float(f"{(lse.view(b, h) - c.lse.view(b, h)).abs().max().item():.2e}")
            for rnd in range(rounds):
                row[f"us_{rnd + 1}"] = round(time_us(call), 1)
            print(row, flush=True)
        rows += list(found.values())
    return rows


def gate_summary(rows: list[dict]) -> tuple[list[dict], str]:
    """Per row: FlashMLA, the shipped call, the best compute and no-math variants (min over
    rounds), their ratios to FlashMLA; and the verdict at b1 h128 s_k640."""
    out, verdict = [], "no verdict: FlashMLA was not timed"
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        us = {r["variant"]: min(v for k, v in r.items() if k.startswith("us_")) for r in rs}
        flash = rs[0]["flashmla_fp8_us"]
        comp = min((k for k in us if "ETAP" in k), key=us.get)
        bare = min((k for k in us if "merge" in k and "ETAP" not in k), key=us.get)
        check = next(r for r in rs if r["variant"] == comp)["rel_l2_vs_shipped"]
        x = (lambda t: None if flash is None else round(t / flash, 2))
        out.append({"row": shape, "FlashMLA FP8": flash, "shipped": us["shipped mla_decode"],
                    "shipped/F": x(us["shipped mla_decode"]), "no math (best)": f"{us[bare]} ({bare.split(' st')[0]})",
                    "ETAP-16 (best)": f"{us[comp]} ({comp.split(' r16')[0]})", "ETAP/F": x(us[comp]),
                    "rel-L2 vs shipped": check})
        if shape == "b1 h128 s_k640" and flash is not None:
            ratio = us[comp] / flash
            wrong = not check <= 2e-2
            verdict = (f"gate at b1 h128 s_k640: ETAP-16 {us[comp]} us ({comp}) / FlashMLA FP8 {flash} us = "
                       f"{ratio:.2f}x -> " + ("PROVES OUT (<= 0.60x)" if ratio <= GATE_PROVES else
                                              "DEAD (>= 0.75x)" if ratio >= GATE_DEAD else
                                              "NOT DECIDED (between 0.60x and 0.75x)")
                       + ("; WARNING: its output is off the shipped call's (rel-L2 "
                          f"{check}): a wrong kernel was timed" if wrong else ""))
    return out, verdict


def name(cfg: SkeletonConfig) -> str:
    if cfg.compute:
        return f"S{cfg.splits} r16 st{cfg.stages} ETAP-16 compute"
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
    ap.add_argument("--what", nargs="+", default=["rows"], choices=["rows", "sweep", "chain", "gate"],
                    help="rows: ROWS_TIMED; sweep: the shipped kernel on few parts (PART_SWEEP); chain: its stages "
                         "left out on one or two blocks a part (CHAIN_ROWS); gate: the ETAP-16 compute against "
                         "FlashMLA (GATE_ROWS)")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile the gate's variants for CUTE_DSL_ARCH (default sm_90a) with their SASS, "
                         "print registers, local memory and WGMMA counts; exit 1 on a violation")
    ap.add_argument("--rounds", type=int, default=2, help="gate: interleaved timing rounds")
    args = ap.parse_args()
    if args.compile_only:
        import os
        import sys

        sys.exit(1 if compile_check(os.environ.get("CUTE_DSL_ARCH") or "sm_90a") else 0)
    if "gate" in args.what:
        from tabulate import tabulate

        rows = gate(args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        print(tabulate(rows, headers="keys"))
        summary, verdict = gate_summary(rows)
        print()
        print(tabulate(summary, headers="keys"))
        print(verdict)
        return
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
