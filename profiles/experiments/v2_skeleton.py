"""GPU: the ceiling of decode v2's dataflow, measured with a timing-only skeleton.

v2's design (the 2-CTA cluster of the decode-v2 plan in NOTES): a cluster of two CTAs
takes one 64-row query tile; each CTA owns 256 of the 512 output dims and each of its two
consumer WGs 128 (O is 64 fp32 registers a thread, so Q fits in registers and QK runs as an
RS WGMMA: Q is never re-read from shared memory). The KV blocks of the tile rotate over the
four WGs of the cluster: block g's owner loads all 576 dims of K (TMA), runs QK and the
softmax, and publishes P (e4m3) and its softmax state into both CTAs' shared memory
(stmatrix here; there by ``SkelConfig.handoff``: a bulk copy, or DSMEM stores; one mbarrier
each); the other CTA loads only its V half of the block. A WG that owns block g+1 runs
its PV of block g after its softmax of g+1 (the chain first). Every WG computes Oᵀ = Vᵀ·Pᵀ for its 128 dims: Vᵀ as the
register A operand straight from the natural K tile (ldmatrix.trans + one prmt per
register: no transposition through shared memory), P as the K-major B operand. The softmax
chain runs through the cluster: softmax(g) reads the state of g-1 from its own shared
memory, written there by g-1's owner.

What the skeleton keeps of that: every TMA load (paged, with the L2 evict-first hint),
every WGMMA, the softmax (the shipped ``OnlineSoftmax.step``), every shared-memory access
and DSMEM store of the dataflow at its size, every barrier and remote arrival, and an
epilogue writing each unit's O as bf16. What it leaves out, so the figures are lower
bounds: masking (lengths are multiples of 64), the exact byte order of the Vᵀ and remote P
registers (the instruction counts are those of the real mapping, the values are not), 1/ℓ
and the LSE, and the split merge (a range of blocks is written as if whole: ``pair_bounds``'s
convention). Its outputs are garbage; it never reads or writes out of bounds.

Switches (``SkelConfig``): the handoff of P and the state (bulk copy, 4- or 16-byte DSMEM
stores, st.async), P slots, KV stages, ownership in pairs, QK as an SS WGMMA, a WG's PVs of
two blocks issued together (``pv_pairs``), the memory-model scope of the handshakes
(``scope``), and timing-only cuts: no softmax, no chain (softmax(g) does not wait for g-1's
state), no P waits at all, ``lean`` (Q loaded once per range; the output written only under
a condition false at run time, so that O, and with it every PV, stays live), no QK / PV
WGMMAs, no Vᵀ loads. ``pv_sync`` waits for each PV right after its issue: left in flight
across the loop's data-dependent branches, a PV makes ptxas serialize every WGMMA of the
kernel (C7514, "non wgmma instructions reading accumulator registers"), which every variant
without it shows (``sass_counts(...).gmma_run`` 1 instead of 40).

``scope="cluster"`` (the first builds) waits with acquire.cluster and arrives remotely with
release.cluster: ptxas puts a CCTL.IVALL (L1 invalidate) after every wait and MEMBAR.ALL.GPU
+ ERRBAR before every remote arrival, which took a third of the consumer warps' stall
samples. ``scope="cta"`` is what CUTLASS's pipelines do and what a real kernel would: every
payload here arrives by TMA or st.async, whose bytes the barrier itself counts, and a remote
arrival only frees a slot whose reads are complete.

Work: ``clusters`` clusters (66 on 132 SMs); cluster p takes query tile p % m_tiles and the
(p // m_tiles)-th equal range of that tile's blocks over the whole batch (equal lengths).

Timing: every row's variants against the shipped decode on the same case (``make_case``),
alternating, graph replay; ``--trace ROW`` prints cluster 0's per-block %globaltimer stamps
(µs) of each variant instead. Results and their reading: NOTES, "Decode v2's dataflow".

    python3 profiles/experiments/v2_skeleton.py [--rows ...] [--variants ...] [--reps 3]
    python3 profiles/experiments/v2_skeleton.py --trace "b128 h128 s_k4096" --variants "v2, cta scope"
"""


import argparse
import hashlib
from dataclasses import dataclass
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM
from snapmla_cute.kernels import ptx
from snapmla_cute.kernels.decode.config import FP8, L2_EVICT_FIRST, DecodeConfig
from snapmla_cute.kernels.decode.consumer import Consumer
from snapmla_cute.kernels.decode.softmax import OnlineSoftmax
from snapmla_cute.kernels.views import view as _view
from snapmla_cute.layouts import mma as M
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines.handshakes import PairExchange

HALF = CONTENT_DIM // 2  # dims a CTA owns
WG_DIMS = HALF // 2  # dims a consumer WG owns
KV_TX = L.BLOCK_N * CONTENT_DIM + L.BLOCK_N * ROPE_DIM * 2 + L.BLOCK_N * 4  # an owned block
HALF_TX = L.BLOCK_N * HALF  # the V half of the other CTA's block
STAGE_BYTES = L.BLOCK_N * CONTENT_DIM


@dataclass(frozen=True)
class SkelConfig:
    heads: int = 128
    s_q: int = 1
    softmax: bool = True  # the shipped softmax step; False: S cast to e4m3 as it is
    qk_ahead: bool = True  # a block's QK issued one block ahead by its owner (else at its softmax)
    pv_sync: bool = False  # wait for each PV right after issuing it (no WGMMA in flight across branches)
    p_wait: bool = True  # False: no WG waits for a block's P (timing only: the handoff's latency left out)
    q_smem: bool = False  # QK as an SS WGMMA (Q in shared memory, never loaded: timing only) instead of RS
    lean: bool = False  # timing only: Q loaded once per range, no output writes (their scalar L2 traffic left out)
    chain: bool = True  # softmax(g) waits for the state of g-1; False: no serial dependency
    pairs: bool = False  # block g's CTA: (g >> 1) & 1 (chain local, remote in turn); else g & 1
    stages: int = 5
    slots: int = 2  # P / state slots per CTA
    clusters: int = 66
    evict_first: bool = True
    # P and the state to the peer: "bulk" (one cp.async.bulk each, after the WG's barrier),
    # "b32" (each thread its 4-byte words, then a cluster fence and one arrival), "v4" (each
    # warp reads back its 1 KB of P and stores it in 16-byte pieces; every thread arrives),
    # "st_async" (the same pieces by st.async, completing the peer's mbarrier's transactions:
    # the peer arms its own barrier, so no release fence or remote arrival is needed)
    handoff: str = "bulk"
    # a WG's PVs of two consecutive blocks of a unit issued together (the second into a
    # temporary, O = γ·O + T after one wait): half the serial PV round trips; needs the
    # registers an SS QK frees (q_smem)
    pv_pairs: bool = False
    # timing-only cuts of the data path: no QK WGMMAs, no PV WGMMAs, no Vᵀ ldmatrix
    qk_gemm: bool = True
    pv_gemm: bool = True
    vt_load: bool = True
    # memory-model scope of the mbarrier handshakes: "cluster" (every wait acquire.cluster,
    # every remote arrival release.cluster: ptxas emits CCTL.IVALL after each wait and
    # ERRBAR + CGAERRBAR before each remote arrival) or "cta" (CUTLASS's pipelines: waits and
    # arrivals at their default .cta scope; enough where the data comes by TMA or st.async,
    # whose completion the barrier itself tracks, and where an arrival only frees a slot
    # whose reads are complete)
    scope: str = "cluster"
    # requests of different lengths: ``block_table`` is then one row per block of the batch,
    # (page, request, block, the request's blocks), and ``nblk`` the batch's blocks; each
    # request takes ceil(length / 64) whole blocks (no masking, as everywhere here)
    varlen: bool = False
    trace: bool = False  # %globaltimer stamps of cluster 0 into the trace tensor

    @property
    def pi_order(self):
        """P packed in the token order π, as v1 ships it (``Consumer.acc_to_fp8_operand``)."""
        return True

    @property
    def m_tiles(self):
        return self.heads * self.s_q // L.M_TILE

    @property
    def parts(self):
        return (self.clusters // self.m_tiles) * self.m_tiles


@dsl_user_op
def st_cluster_b32(cluster_addr: Int32, v, *, loc=None, ip=None):
    """``st.shared::cluster.b32``: 4 bytes into a cluster CTA's shared memory."""
    ptx._asm(None, [Int32(cluster_addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
             "st.shared::cluster.b32 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def bulk_to_peer(dst: Int32, src: Int32, nbytes: int, mbar: Int32, *, loc=None, ip=None):
    """``cp.async.bulk.shared::cluster.shared::cta``: ``nbytes`` of this CTA's shared memory
    to a peer's (``dst``, ``mbar``: shared::cluster addresses), completing on its mbarrier."""
    ptx._asm(None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (dst, src, mbar)],
             f"cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [$0], [$1], {nbytes}, [$2];",
             "r,r,r,~{memory}", loc, ip)


@dsl_user_op
def st_cluster_v4_b32(cluster_addr: Int32, a, b, c, d, *, loc=None, ip=None):
    """``st.shared::cluster.v4.b32``: 16 bytes into a cluster CTA's shared memory."""
    ptx._asm(None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (cluster_addr, a, b, c, d)],
             "st.shared::cluster.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", loc, ip)


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None):
    """``ld.shared.v4.b32``: 16 bytes of this CTA's shared memory into four registers."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    res = ptx._asm(llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
                   "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def st_async_v4(cluster_addr: Int32, a, b, c, d, mbar: Int32, *, loc=None, ip=None):
    """``st.async…mbarrier::complete_tx::bytes.v4.b32``: 16 bytes into a peer's shared memory,
    counted on its mbarrier ``mbar`` (shared::cluster address)."""
    ptx._asm(None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (cluster_addr, a, b, c, d, mbar)],
             "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];",
             "r,r,r,r,r,r,~{memory}", loc, ip)


@dsl_user_op
def st_async_v4_f32(cluster_addr: Int32, a, b, c, d, mbar: Int32, *, loc=None, ip=None):
    """``st_async_v4`` of four floats."""
    from cutlass import Float32

    ptx._asm(None, [Int32(cluster_addr).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip)
                                                                     for x in (a, b, c, d)]
             + [Int32(mbar).ir_value(loc=loc, ip=ip)],
             "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [$0], {$1, $2, $3, $4}, [$5];",
             "r,f,f,f,f,r,~{memory}", loc, ip)


@dsl_user_op
def mbar_expect_tx_cluster(mbar: Int32, nbytes: int, *, loc=None, ip=None):
    """One arrival on a peer's mbarrier that also expects ``nbytes`` of transactions."""
    ptx._asm(None, [Int32(mbar).ir_value(loc=loc, ip=ip)],
             f"mbarrier.arrive.expect_tx.release.cluster.shared::cluster.b64 _, [$0], {nbytes};", "r,~{memory}",
             loc, ip)


@dsl_user_op
def mbar_try_wait_cta(smem_addr: Int32, phase: Int32, *, loc=None, ip=None) -> Int32:
    """``mbarrier.try_wait.parity.shared::cta.b64`` (default: acquire, cta scope)."""
    from cutlass.cutlass_dsl import T

    res = ptx._asm(T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
                   "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
                   "=r,r,r,~{memory}", loc, ip)
    return Int32(res)


@dsl_user_op
def mbar_arrive_remote(cluster_addr: Int32, *, loc=None, ip=None):
    """``mbarrier.arrive.shared::cluster.b64`` (default: release, cta scope), as CUTLASS's
    ``ClusterBarrier::arrive(cta_id)``."""
    ptx._asm(None, [Int32(cluster_addr).ir_value(loc=loc, ip=ip)],
             "mbarrier.arrive.shared::cluster.b64 _, [$0];", "r,~{memory}", loc, ip)


def _owner(cfg, g):
    """(CTA, WG) that owns block g of a range (g counted from the range's start)."""
    if cfg.pairs:
        return (g >> 1) & 1, g & 1
    return g & 1, (g >> 1) & 1


def _storage(cfg, kv_sl, kr_sl, p_sl):
    """One CTA's shared memory (a plain function: a class body's `if` inside a jit function
    would be staged)."""

    @cute.struct
    class Storage:
        full: cute.struct.MemRange[Int64, cfg.stages]
        empty: cute.struct.MemRange[Int64, cfg.stages]
        pready: cute.struct.MemRange[Int64, cfg.slots]
        pfree: cute.struct.MemRange[Int64, cfg.slots]
        state: cute.struct.Align[cute.struct.MemRange[Float32, cfg.slots * 4 * L.M_TILE], 16]
        ks: cute.struct.Align[cute.struct.MemRange[Float32, 64 * cfg.stages], 128]
        kv: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(kv_sl)], 1024]
        kr: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kr_sl)], 1024]
        if cfg.q_smem:
            q: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(L.q_nope_layout())], 1024]
            qr: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(L.q_rope_layout())], 1024]
        p: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(p_sl)], 1024]

    return Storage


class V2Skeleton:
    def __init__(self, cfg: SkelConfig):
        self.cfg = cfg
        self.dcfg = DecodeConfig(cfg.heads, cfg.s_q, 64, False)

    @cute.jit
    def __call__(self, m_q_nope: cute.Tensor, m_q_rope: cute.Tensor, m_q_scale: cute.Tensor,
                 m_block_table: cute.Tensor, m_out: cute.Tensor, m_kv: cute.Tensor, m_kv_scale: cute.Tensor,
                 nblk: Int32, scale_log2: Float32, m_trace: cute.Tensor, stream):
        cfg = self.cfg
        R = cfg.heads * cfg.s_q
        b = m_q_nope.shape[0]
        pages = m_kv.shape[0]
        row = KV_ROW_BYTES
        q_nope = _view(m_q_nope, (R, CONTENT_DIM, b), (CONTENT_DIM, 1, R * CONTENT_DIM), FP8)
        q_rope = _view(m_q_rope, (R, ROPE_DIM, b), (ROPE_DIM, 1, R * ROPE_DIM))
        q_scale = _view(m_q_scale, (R, b), (1, R))
        kv_c = _view(m_kv, (64, CONTENT_DIM, pages), (row, 1, 64 * row), FP8)
        kv_r = _view(m_kv, (64, ROPE_DIM, pages), (row // 2, 1, 64 * row // 2), BFloat16, CONTENT_DIM)
        kv_s = _view(m_kv_scale, (64, pages), (1, 64))
        out = _view(m_out, (R, CONTENT_DIM, b), (CONTENT_DIM, 1, R * CONTENT_DIM))

        K = OperandMajorMode.K
        RM = warpgroup.OperandSource.RMEM
        QS = warpgroup.OperandSource.SMEM if cfg.q_smem else RM
        qk = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, 64), QS)
        qk0 = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, 64), QS)
        qkr = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K, K, Float32, (1, 1, 1), (64, 64), QS)
        pv = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, 64), RM)
        pv0 = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (64, 64), RM)

        kv_sl = L.kv_content_layout(cfg.stages)
        kr_sl = L.kv_rope_layout(cfg.stages)
        p_sl = L.p_layout(cfg.slots)
        half_box = cute.slice_(cute.flat_divide(cute.slice_(kv_sl, (None, None, 0)), (64, HALF)), (None, None, 0, 0))
        tma_kv, g_kv = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kv_c, half_box, (64, HALF))
        tma_kr, g_kr = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kv_r,
                                                   cute.slice_(kr_sl, (None, None, 0)), (64, ROPE_DIM))
        tma_ks, g_ks = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kv_s, cute.make_layout((64,)),
                                                   (64,))

        Storage = _storage(cfg, kv_sl, kr_sl, p_sl)
        self.storage = Storage
        self.kernel(qk, qk0, qkr, pv, pv0, tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks, q_nope, q_rope, q_scale,
                    m_block_table, out, nblk, scale_log2, m_trace, kv_sl, kr_sl, p_sl).launch(
            grid=[2, cfg.parts, 1], block=[384, 1, 1], cluster=[2, 1, 1], smem=Storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(self, qk: cute.TiledMma, qk0: cute.TiledMma, qkr: cute.TiledMma, pv: cute.TiledMma, pv0: cute.TiledMma,
               tma_kv: cute.CopyAtom, g_kv: cute.Tensor, tma_kr: cute.CopyAtom, g_kr: cute.Tensor,
               tma_ks: cute.CopyAtom, g_ks: cute.Tensor, q_nope: cute.Tensor, q_rope: cute.Tensor,
               q_scale: cute.Tensor, block_table: cute.Tensor, out: cute.Tensor, nblk: Int32, scale_log2: Float32,
               m_trace: cute.Tensor,
               kv_sl: cute.ComposedLayout, kr_sl: cute.ComposedLayout, p_sl: cute.ComposedLayout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        rank, part, _ = cute.arch.block_idx()
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        st = SmemAllocator().allocate(self.storage)
        self.trace_t = m_trace
        self.meta_t = block_table
        if tidx == 0:
            for s in cutlass.range_constexpr(cfg.stages):
                cute.arch.mbarrier_init(st.full.data_ptr() + s, 1)
                cute.arch.mbarrier_init(st.empty.data_ptr() + s, 8)
            for s in cutlass.range_constexpr(cfg.slots):
                cute.arch.mbarrier_init(st.pready.data_ptr() + s, 128 if cfg.handoff == "v4" else 1)
                cute.arch.mbarrier_init(st.pfree.data_ptr() + s, 16)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        # the tile and the block range of this cluster
        tile = part % cfg.m_tiles
        n_rng = cfg.parts // cfg.m_tiles
        rng = part // cfg.m_tiles
        total = nblk if cfg.varlen else nblk * q_nope.shape[2]
        lo = rng * total // n_rng
        hi = (rng + 1) * total // n_rng

        s_kv = st.kv.get_tensor(kv_sl.outer, swizzle=kv_sl.inner)
        s_kr = st.kr.get_tensor(kr_sl.outer, swizzle=kr_sl.inner)
        s_p = st.p.get_tensor(p_sl.outer, swizzle=p_sl.inner)
        s_ks = st.ks.get_tensor(cute.make_layout((64, cfg.stages)))
        s_state = st.state.get_tensor(cute.make_layout((L.M_TILE, 4, cfg.slots), stride=(4, 1, 4 * L.M_TILE)))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(24)
            if warp == 0:
                self.produce(tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks, s_kv, s_kr, s_ks, st, block_table, nblk, lo,
                             hi, rank)
        else:
            cute.arch.setmaxregister_increase(240)
            self.consume(qk, qk0, qkr, pv, pv0, s_kv, s_kr, s_ks, s_p, s_state, st, q_nope, q_rope, q_scale, out, nblk,
                         scale_log2, lo, hi, rank, tile, wg_idx - 1, tidx % 128)
        # no CTA leaves while its peer may still arrive on or store into it
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def produce(self, tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks, s_kv, s_kr, s_ks, st, block_table, nblk, lo, hi,
                rank):
        cfg = self.cfg
        tkv_s, tkv_g = cpasync.tma_partition(
            tma_kv, 0, cute.make_layout(1), cute.group_modes(cute.flat_divide(s_kv, (64, HALF)), 0, 2),
            cute.group_modes(cute.flat_divide(g_kv, (64, HALF)), 0, 2))
        tkr_s, tkr_g = cpasync.tma_partition(
            tma_kr, 0, cute.make_layout(1), cute.group_modes(s_kr, 0, 2),
            cute.group_modes(cute.flat_divide(g_kr, (64, ROPE_DIM)), 0, 2))
        tks_s, tks_g = cpasync.tma_partition(
            tma_ks, 0, cute.make_layout(1), cute.group_modes(s_ks, 0, 1),
            cute.group_modes(cute.flat_divide(g_ks, (64,)), 0, 1))
        policy = None
        if cutlass.const_expr(cfg.evict_first):
            policy = Int64(L2_EVICT_FIRST)
        lane = cute.arch.lane_idx()
        # block-table entries 32 at a time, one per lane (as the shipped producer): one load
        # latency per 32 blocks instead of one per block on the producer's path
        cur_req = Int32(-1)
        base = Int32(0)
        cached = Int32(0)
        for g in cutlass.range(lo, hi, unroll=1):
            k = g - lo
            s = k % cfg.stages
            n = k // cfg.stages
            if n >= 1:
                self.wait(st.empty.data_ptr().toint() + 8 * s, (n - 1) & 1)
            page = Int32(0)
            if cutlass.const_expr(cfg.varlen):
                page = block_table[g, 0]
            else:
                req = g // nblk
                blk = g - req * nblk
                if req != cur_req or blk >= base + 32:
                    cur_req = req
                    base = blk
                    cached = Int32(0)
                    if base + lane < nblk:
                        cached = block_table[req, base + lane]
                page = cute.arch.shuffle_sync(cached, blk - base)
            own_cta, _ = _owner(cfg, k)
            full = st.full.data_ptr() + s
            # the whole warp issues the copies (each elects one thread: elect.sync under a
            # lane test would hang); one lane sets the transaction count
            if own_cta == rank:
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(full, KV_TX)
                for h in cutlass.range_constexpr(2):
                    cute.copy(tma_kv, tkv_g[(None, 0, h, page)], tkv_s[(None, 0, h, s)], tma_bar_ptr=full,
                              cache_policy=policy)
                cute.copy(tma_kr, tkr_g[(None, 0, 0, page)], tkr_s[(None, s)], tma_bar_ptr=full, cache_policy=policy)
                cute.copy(tma_ks, tks_g[(None, 0, page)], tks_s[(None, s)], tma_bar_ptr=full, cache_policy=policy)
            else:
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(full, HALF_TX)
                cute.copy(tma_kv, tkv_g[(None, 0, rank, page)], tkv_s[(None, 0, rank, s)], tma_bar_ptr=full,
                          cache_policy=policy)

    @cute.jit
    def consume(self, qk, qk0, qkr, pv, pv0, s_kv, s_kr, s_ks, s_p, s_state, st, q_nope, q_rope, q_scale, out, nblk,
                scale_log2, lo, hi, rank, tile, wg, wg_tidx):
        cfg = self.cfg
        peer = 1 - rank
        warp_in_wg = wg_tidx // 32
        lane = wg_tidx % 32
        for mma in (qk, qkr, pv):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        qk0.set(warpgroup.Field.ACCUMULATE, False)
        pv0.set(warpgroup.Field.ACCUMULATE, False)
        qk_thr = qk.get_slice(wg_tidx)
        qkr_thr = qkr.get_slice(wg_tidx)
        pv_thr = pv.get_slice(wg_tidx)
        # Q in registers (A operands of the RS QK), loaded per unit
        if cutlass.const_expr(cfg.q_smem):
            qn_sl = L.q_nope_layout()
            qr_sl = L.q_rope_layout()
            s_qn = cute.slice_(st.q.get_tensor(qn_sl.outer, swizzle=qn_sl.inner), (None, None, 0))
            s_qr = cute.slice_(st.qr.get_tensor(qr_sl.outer, swizzle=qr_sl.inner), (None, None, 0))
            t_q = qk_thr.make_fragment_A(qk_thr.partition_A(s_qn))
            t_qr = qkr_thr.make_fragment_A(qkr_thr.partition_A(s_qr))
        else:
            t_q = qk_thr.make_fragment_A(qk_thr.partition_shape_A((L.M_TILE, CONTENT_DIM)))
            t_qr = qkr_thr.make_fragment_A(qkr_thr.partition_shape_A((L.M_TILE, ROPE_DIM)))
        t_k = qk_thr.make_fragment_B(qk_thr.partition_B(s_kv))
        t_kr = qkr_thr.make_fragment_B(qkr_thr.partition_B(s_kr))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((L.M_TILE, L.BLOCK_N)))
        acc_s_mn = cute.make_tensor(acc_s.iterator, M.acc_mn_layout(qk, acc_s.layout))
        c_s = qk_thr.partition_C(cute.make_identity_tensor((L.M_TILE, L.BLOCK_N)))
        c_s_mn = cute.make_tensor(c_s.iterator, M.acc_mn_layout(qk, c_s.layout))
        rows_per_thr = cute.size(c_s_mn, mode=[0])
        # Oᵀ = Vᵀ·Pᵀ: two 64-dim tiles, P the B operand (heads x tokens, K-major)
        t_pb = pv_thr.make_fragment_B(pv_thr.partition_B(s_p))
        acc_o = [pv_thr.make_fragment_C(pv_thr.partition_shape_C((64, L.M_TILE))) for _ in range(2)]
        acc_o_mn = [cute.make_tensor(a.iterator, M.acc_mn_layout(pv, a.layout)) for a in acc_o]
        c_o = pv_thr.partition_C(cute.make_identity_tensor((64, L.M_TILE)))
        c_o_mn = cute.make_tensor(c_o.iterator, M.acc_mn_layout(pv, c_o.layout))
        t_vt = [pv_thr.make_fragment_A(pv_thr.partition_shape_A((64, L.BLOCK_N))) for _ in range(2)]
        # pv_pairs: the second block's Vᵀ and its PV temporary
        t_vt2 = [pv_thr.make_fragment_A(pv_thr.partition_shape_A((64, L.BLOCK_N))) for _ in range(2)]
        acc_t = [pv_thr.make_fragment_C(pv_thr.partition_shape_C((64, L.M_TILE))) for _ in range(2)]
        acc_t_mn = [cute.make_tensor(a.iterator, M.acc_mn_layout(pv, a.layout)) for a in acc_t]
        pair = (pv0, t_vt2, acc_t, acc_t_mn)
        softmax = OnlineSoftmax.create(self.dcfg, rows_per_thr)
        exchange = PairExchange(s_state)
        wg_bar = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=128)
        p_addr = s_p.iterator.toint()
        kv_addr = s_kv.iterator.toint()
        state_addr = s_state.iterator.toint()
        gam = cute.make_rmem_tensor((cute.size(c_o_mn, mode=[1]),), Float32)
        gam1 = cute.make_rmem_tensor((cute.size(c_o_mn, mode=[1]),), Float32)
        dfr = Int32(-1)  # pv_pairs: a plain block whose PV waits for the next one's

        me = rank * 2 + wg
        pend = Int32(-1)  # a block whose PV is in flight and whose slots are not released yet
        # the range's first block, peeled (in the loop ptxas would see a second QK issue on the
        # back edge's path and serialize every WGMMA of the kernel)
        if hi > lo:
            c0, w0 = _owner(cfg, 0)
            c1, w1 = _owner(cfg, 1)
            first_req, _, _ = self.unit(lo, nblk)
            if c0 * 2 + w0 == me or c1 * 2 + w1 == me:
                # the first unit's Q, into registers (the next units' are loaded a block
                # ahead, with the QK that needs them)
                self.load_q(q_nope, q_rope, qk_thr, qkr_thr, t_q, t_qr, tile, first_req)
            if c0 * 2 + w0 == me:
                self.wait(st.full.data_ptr().toint(), 0)
                self.issue_qk(qk, qk0, qkr, acc_s, t_q, t_qr, t_k, t_kr, 0)
        for g in cutlass.range(lo, hi, unroll=1):
            k = g - lo
            slot = k % cfg.slots
            req, blk, nb = self.unit(g, nblk)
            # (Python's `and` would be taken at trace time: ids compared instead)
            own_cta, own_wg = _owner(cfg, k)
            mine = own_cta * 2 + own_wg == me
            nxt_cta, nxt_wg = _owner(cfg, k + 1)
            in_range = Int32(g + 1 < hi)
            lead = nxt_cta * 2 + nxt_wg + 4 * (1 - in_range) == me  # I own block k+1
            if cutlass.const_expr(cfg.handoff == "st_async"):
                # the peer owns block k: arm this CTA's barrier for its 5 KB (the phase of k-slots
                # is complete: every WG waited for it two or more blocks ago)
                if own_cta != rank:
                    if wg_tidx == 0 and wg == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(st.pready.data_ptr() + slot,
                                                                L.M_TILE * L.BLOCK_N + 16 * L.M_TILE)
            if lead and cfg.qk_ahead:
                # QK of the next block (mine) a block ahead; PV(k) waits for my softmax(k+1),
                # which is on the chain
                s1 = (k + 1) % cfg.stages
                self.wait(st.full.data_ptr().toint() + 8 * s1, ((k + 1) // cfg.stages) & 1)
                if cutlass.const_expr(not cfg.lean):
                    if blk + 1 == nb:
                        self.load_q(q_nope, q_rope, qk_thr, qkr_thr, t_q, t_qr, tile, req + 1)
                self.issue_qk(qk, qk0, qkr, acc_s, t_q, t_qr, t_k, t_kr, s1)
            if mine:
                if wg_tidx == 0:
                    self.stamp(0, k)
                if cutlass.const_expr(not cfg.qk_ahead):
                    self.wait(st.full.data_ptr().toint() + 8 * (k % cfg.stages), (k // cfg.stages) & 1)
                    if blk == 0:
                        self.load_q(q_nope, q_rope, qk_thr, qkr_thr, t_q, t_qr, tile, req)
                    self.issue_qk(qk, qk0, qkr, acc_s, t_q, t_qr, t_k, t_kr, k % cfg.stages)
                warpgroup.wait_group(0)  # QK(k), and the PV before it
                if pend >= 0:
                    self.release(st, pend, peer, lane)
                pend = Int32(-1)
                if blk == 0 or k == 0:  # a unit's (or the range's) first block
                    softmax.start_request(c_s_mn, q_scale, tile, req, nb * 64, scale_log2)
                    softmax.reset()
                else:
                    if cutlass.const_expr(cfg.chain):
                        self.wait_p(st, k - 1)  # the state of block k-1
                    if wg_tidx == 0:
                        self.stamp(2, k)
                    exchange.read_state((k - 1) % cfg.slots, c_s_mn, softmax.other_state())
                ks_pre = cute.make_rmem_tensor((cute.size(c_s_mn, mode=[1]),), Float32)
                for jj in cutlass.range_constexpr(cute.size(c_s_mn, mode=[1])):
                    ks_pre[jj] = s_ks[c_s_mn[0, jj][1], k % cfg.stages]
                if cutlass.const_expr(cfg.softmax):
                    softmax.step(acc_s_mn, c_s_mn, ks_pre, blk, nb * 64, blk == 0, False, None)
                t_p = Consumer.acc_to_fp8_operand(self, acc_s, pv.tv_layout_A)  # v1's cast, π-packed
                if wg_tidx == 0:
                    self.stamp(4, k)
                if k >= cfg.slots:
                    self.wait(st.pfree.data_ptr().toint() + 8 * slot, ((k - cfg.slots) // cfg.slots) & 1)
                if wg_tidx == 0:
                    self.stamp(5, k)
                self.publish(t_p, p_addr, state_addr, st.pready.data_ptr().toint(), slot, wg_tidx, peer, exchange,
                             c_s_mn, softmax)
                cute.arch.fence_proxy("async.shared", space="cta")
                if cutlass.const_expr(cfg.handoff == "v4"):
                    # every thread: its stores are released to the local and the remote waiters
                    cute.arch.mbarrier_arrive(st.pready.data_ptr() + slot)
                    ptx.mbar_arrive_cluster(ptx.mapa(st.pready.data_ptr().toint() + 8 * slot, peer))
                    if wg_tidx == 0:
                        self.stamp(3, k)
                else:
                    wg_bar.arrive_and_wait()
                if wg_tidx == 0 and cfg.handoff != "v4":
                    self.stamp(1, k)
                    cute.arch.mbarrier_arrive(st.pready.data_ptr() + slot)
                    bar_peer = ptx.mapa(st.pready.data_ptr().toint() + 8 * slot, peer)
                    if cutlass.const_expr(cfg.handoff == "st_async"):
                        pass  # the stores complete the peer's barrier themselves
                    elif cutlass.const_expr(cfg.handoff == "bulk"):
                        p_bytes = L.M_TILE * L.BLOCK_N
                        st_bytes = 4 * 4 * L.M_TILE
                        mbar_expect_tx_cluster(bar_peer, p_bytes + st_bytes)
                        bulk_to_peer(ptx.mapa(p_addr + slot * p_bytes, peer), p_addr + slot * p_bytes, p_bytes,
                                     bar_peer)
                        bulk_to_peer(ptx.mapa(state_addr + slot * st_bytes, peer), state_addr + slot * st_bytes,
                                     st_bytes, bar_peer)
                    else:
                        cute.arch.fence_acq_rel_cluster()
                        ptx.mbar_arrive_cluster(bar_peer)
                    self.stamp(3, k)
                if cutlass.const_expr(cfg.pv_pairs):
                    if Int32(k >= 1) + Int32(blk >= 1) == 2:
                        # PV(k-1), deferred from my lead iteration, and PV(k) together
                        pend = self.pv_pair(pv, pair, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, gam1, s_state, st,
                                            out, kv_addr, lo, hi, nblk, k - 1, pend, rank, peer, tile, wg,
                                            warp_in_wg, lane)
                    else:
                        if k >= 1:
                            pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out,
                                                 kv_addr, lo, hi, nblk, k - 1, pend, rank, peer, tile, wg,
                                                 warp_in_wg, lane)
                        pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out,
                                             kv_addr, lo, hi, nblk, k, pend, rank, peer, tile, wg, warp_in_wg, lane)
                else:
                    if k >= 1:
                        # the PV of block k-1, deferred from my lead iteration
                        pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out,
                                             kv_addr, lo, hi, nblk, k - 1, pend, rank, peer, tile, wg, warp_in_wg,
                                             lane)
                    pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out, kv_addr,
                                         lo, hi, nblk, k, pend, rank, peer, tile, wg, warp_in_wg, lane)
            else:
                if not lead:
                    if cutlass.const_expr(cfg.pv_pairs):
                        # defer PV(k) when block k+1 is plain for me too and in the same unit
                        n2_cta, n2_wg = _owner(cfg, k + 2)
                        plain = (Int32(nxt_cta * 2 + nxt_wg != me) + Int32(n2_cta * 2 + n2_wg != me)
                                 + Int32(g + 1 < hi) + Int32(blk + 1 < nb))
                        if dfr >= 0:
                            pend = self.pv_pair(pv, pair, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, gam1, s_state,
                                                st, out, kv_addr, lo, hi, nblk, dfr, pend, rank, peer, tile, wg,
                                                warp_in_wg, lane)
                            dfr = Int32(-1)
                        elif plain == 4:
                            dfr = k
                        else:
                            pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out,
                                                 kv_addr, lo, hi, nblk, k, pend, rank, peer, tile, wg, warp_in_wg,
                                                 lane)
                    else:
                        pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out, kv_addr,
                                             lo, hi, nblk, k, pend, rank, peer, tile, wg, warp_in_wg, lane)
        if cutlass.const_expr(cfg.pv_pairs):
            if dfr >= 0:  # (never: a deferred block's successor pairs with it)
                pend = self.pv_block(pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out, kv_addr, lo,
                                     hi, nblk, dfr, pend, rank, peer, tile, wg, warp_in_wg, lane)
        warpgroup.wait_group(0)

    @cute.jit
    def unit(self, g, nblk):
        """(request, block in it, the request's blocks) of block g of the batch."""
        if cutlass.const_expr(self.cfg.varlen):
            t = self.meta_t
            return t[g, 1], t[g, 2], t[g, 3]
        else:
            req = g // nblk
            return req, g - req * nblk, nblk

    @cute.jit
    def stamp(self, ev: cutlass.Constexpr, k):
        """``trace``: %globaltimer of event ``ev`` at block k (cluster 0, one thread)."""
        if cutlass.const_expr(self.cfg.trace):
            rank, part, _ = cute.arch.block_idx()
            tr = self.trace_t
            if part == 0 and k < 512:
                tr[(rank * 8 + ev) * 512 + k] = Int32(cute.arch.globaltimer())

    @cute.jit
    def wait(self, addr, phase):
        """Waits for phase ``phase`` of this CTA's mbarrier at ``addr``; traps after 2 s."""
        try_wait = ptx.mbar_try_wait_cluster if self.cfg.scope == "cluster" else mbar_try_wait_cta
        if try_wait(addr, phase) == 0:
            t0 = cute.arch.globaltimer()  # read only when the first try fails
            while try_wait(addr, phase) == 0:
                if cute.arch.globaltimer() - t0 > 2_000_000_000:
                    ptx.trap()  # a protocol error fails the launch instead of hanging

    @cute.jit
    def wait_p(self, st, k):
        """P and the softmax state of block k are in this CTA's slot (written by its owner,
        here or in the peer)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.p_wait):
            self.wait(st.pready.data_ptr().toint() + 8 * (k % cfg.slots), (k // cfg.slots) & 1)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def pv_block(self, pv, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, s_state, st, out, kv_addr, lo, hi, nblk, k,
                 pend, rank, peer, tile, wg, warp_in_wg, lane):
        """O = γ_k·O + Vᵀ_k·P_kᵀ for this WG's 128 dims; the unit's epilogue after its last
        block. Returns the block whose slots are not released yet (-1: none); with
        ``pv_sync`` its PV is already done."""
        cfg = self.cfg
        slot = k % cfg.slots
        s = k % cfg.stages
        g = lo + k
        req, blk, nb = self.unit(g, nblk)
        self.wait_p(st, k)
        if wg == 0:
            if warp_in_wg == 0:
                if lane == 0:
                    self.stamp(6, k)
        self.read_gamma(gam, s_state, c_o_mn, slot)
        self.wait(st.full.data_ptr().toint() + 8 * s, (k // cfg.stages) & 1)
        warpgroup.wait_group(0)  # the previous PV has read its Vᵀ registers and written O
        self.load_vt(t_vt, kv_addr, s, rank, wg, warp_in_wg, lane)
        if pend >= 0:
            self.release(st, pend, peer, lane)
        self.rescale_o(acc_o, acc_o_mn, gam, blk)
        warpgroup.fence()
        self.issue_pv(pv, pv, acc_o, t_vt, t_pb, slot)
        warpgroup.commit_group()
        if cutlass.const_expr(cfg.pv_sync):
            warpgroup.wait_group(0)
        if wg == 0:
            if warp_in_wg == 0:
                if lane == 0:
                    self.stamp(7, k)
        nxt = k
        if blk + 1 == nb or g + 1 == hi:
            warpgroup.wait_group(0)
            self.release(st, k, peer, lane)
            nxt = Int32(-1)
            self.finish(acc_o_mn, c_o_mn, out, tile, req, rank, wg, nb)
        return nxt

    @cute.jit
    def read_gamma(self, gam, s_state, c_o_mn, slot):
        """γ of the block in P slot ``slot``, for this thread's O columns (query rows)."""
        for jj in cutlass.range_constexpr(cute.size(c_o_mn, mode=[1])):
            gam[jj] = s_state[c_o_mn[0, jj][1], 3, slot]

    @cute.jit
    def rescale_o(self, acc_o, acc_o_mn, gam, blk):
        """O = γ·O, O zeroed first at a unit's first block."""
        if blk == 0:
            for h in cutlass.range_constexpr(2):
                acc_o[h].fill(0.0)
        for h in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_o_mn[h], mode=[0])):
                for j in cutlass.range_constexpr(cute.size(acc_o_mn[h], mode=[1])):
                    acc_o_mn[h][i, j] = acc_o_mn[h][i, j] * gam[j]

    @cute.jit
    def issue_pv(self, pv_first, pv, acc, t_vt, t_pb, slot):
        """acc (+)= Vᵀ·Pᵀ of P slot ``slot`` for both 64-dim tiles; the first k-block by
        ``pv_first`` (an accumulating or an overwriting MMA)."""
        for h in cutlass.range_constexpr(2 if self.cfg.pv_gemm else 0):
            for kb in cutlass.range_constexpr(cute.size(t_pb, mode=[2])):
                cute.gemm(pv_first if kb == 0 else pv, acc[h], t_vt[h][None, None, kb], t_pb[None, None, kb, slot],
                          acc[h])

    @cute.jit
    def pv_pair(self, pv, pair, acc_o, acc_o_mn, c_o_mn, t_vt, t_pb, gam, gam1, s_state, st, out, kv_addr, lo, hi,
                nblk, k, pend, rank, peer, tile, wg, warp_in_wg, lane):
        """``pv_pairs``: blocks k and k+1 of one unit. O = γ_k·O, O += Vᵀ_k·P_kᵀ and
        T = Vᵀ_k+1·P_k+1ᵀ issued together, one wait, O = γ_k+1·O + T. Both are released
        here; returns -1."""
        cfg = self.cfg
        pv0, t_vt2, acc_t, acc_t_mn = pair
        k1 = k + 1
        slot0 = k % cfg.slots
        slot1 = k1 % cfg.slots
        g = lo + k
        req, blk, nb = self.unit(g, nblk)
        self.wait_p(st, k)
        self.wait_p(st, k1)
        self.read_gamma(gam, s_state, c_o_mn, slot0)
        self.read_gamma(gam1, s_state, c_o_mn, slot1)
        self.wait(st.full.data_ptr().toint() + 8 * (k % cfg.stages), (k // cfg.stages) & 1)
        self.wait(st.full.data_ptr().toint() + 8 * (k1 % cfg.stages), (k1 // cfg.stages) & 1)
        warpgroup.wait_group(0)
        self.load_vt(t_vt, kv_addr, k % cfg.stages, rank, wg, warp_in_wg, lane)
        self.load_vt(t_vt2, kv_addr, k1 % cfg.stages, rank, wg, warp_in_wg, lane)
        if pend >= 0:
            self.release(st, pend, peer, lane)
        self.rescale_o(acc_o, acc_o_mn, gam, blk)
        warpgroup.fence()
        self.issue_pv(pv, pv, acc_o, t_vt, t_pb, slot0)
        self.issue_pv(pv0, pv, acc_t, t_vt2, t_pb, slot1)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        for h in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_o_mn[h], mode=[0])):
                for j in cutlass.range_constexpr(cute.size(acc_o_mn[h], mode=[1])):
                    acc_o_mn[h][i, j] = acc_o_mn[h][i, j] * gam1[j] + acc_t_mn[h][i, j]
        if wg == 0:
            if warp_in_wg == 0:
                if lane == 0:
                    self.stamp(7, k1)
        self.release(st, k, peer, lane)
        self.release(st, k1, peer, lane)
        if blk + 2 == nb or g + 2 == hi:
            self.finish(acc_o_mn, c_o_mn, out, tile, req, rank, wg, nb)
        return Int32(-1)

    @cute.jit
    def release(self, st, k, peer, lane):
        """Block k's PV is done: its P slot (both CTAs') and its KV stage (this CTA's)."""
        cfg = self.cfg
        slot = k % cfg.slots
        if lane == 0:
            cute.arch.mbarrier_arrive(st.pfree.data_ptr() + slot)
            remote = ptx.mapa(st.pfree.data_ptr().toint() + 8 * slot, peer)
            if cutlass.const_expr(self.cfg.scope == "cluster"):
                ptx.mbar_arrive_cluster(remote)
            else:
                mbar_arrive_remote(remote)
            cute.arch.mbarrier_arrive(st.empty.data_ptr() + k % cfg.stages)

    @cute.jit
    def load_q(self, q_nope, q_rope, qk_thr, qkr_thr, t_q, t_qr, tile, req):
        if cutlass.const_expr(self.cfg.q_smem):
            return  # timing only: Q's shared memory is never written
        gq = cute.local_tile(q_nope[None, None, req], (L.M_TILE, CONTENT_DIM), (tile, 0))
        gqr = cute.local_tile(q_rope[None, None, req], (L.M_TILE, ROPE_DIM), (tile, 0))
        cute.autovec_copy(qk_thr.partition_A(gq), t_q)
        cute.autovec_copy(qkr_thr.partition_A(gqr), t_qr)

    @cute.jit
    def issue_qk(self, qk, qk0, qkr, acc_s, t_q, t_qr, t_k, t_kr, s):
        warpgroup.fence()
        if cutlass.const_expr(self.cfg.qk_gemm):
            for kb in cutlass.range_constexpr(cute.size(t_q, mode=[2])):
                cute.gemm(qk0 if kb == 0 else qk, acc_s, t_q[None, None, kb], t_k[None, None, kb, s], acc_s)
            for kb in cutlass.range_constexpr(cute.size(t_qr, mode=[2])):
                cute.gemm(qkr, acc_s, t_qr[None, None, kb], t_kr[None, None, kb, s], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def publish(self, t_p, p_addr, state_addr, pready_addr, slot, wg_tidx, peer, exchange, c_s_mn, softmax):
        """P into this CTA's slot (two stmatrix.x4, v1's layout) and the state (a quad's
        leader, its two rows: 16 bytes each); to the peer by ``handoff``: "b32" eight 4-byte
        stores a thread (the A-fragment words where P's K-major bytes go), "v4" / "st_async"
        the warp's 1 KB read back and stored in 16-byte pieces, "bulk" nothing here (the
        caller's bulk copy)."""
        cfg = self.cfg
        words = cute.recast_tensor(t_p, Uint32)
        base = slot * (L.M_TILE * L.BLOCK_N)
        remote = ptx.mapa(p_addr + base, peer)
        r0 = (wg_tidx // 32) * 16 + (wg_tidx % 32) // 4
        for kb in cutlass.range_constexpr(cute.size(words, mode=[2])):
            off = L.p_stsm_offset(wg_tidx // 32, wg_tidx % 32, kb)
            ptx.stsm_x4(p_addr + base + off, *[Int32(words[i, 0, kb]) for i in range(4)])
            if cutlass.const_expr(cfg.handoff == "b32"):
                for i in cutlass.range_constexpr(4):
                    rr = r0 + 8 * (i % 2)
                    col = kb * 32 + (i // 2) * 16 + (wg_tidx % 4) * 4
                    st_cluster_b32(remote + rr * 64 + (col ^ ((rr % 4) * 16)), Int32(words[i, 0, kb]))
        bar_peer = ptx.mapa(pready_addr + 8 * slot, peer)
        if cutlass.const_expr(cfg.handoff in ("v4", "st_async")):
            # the warp's own 16 rows of P (1 KB, written by its stmatrix) to the peer
            cute.arch.sync_warp()
            for half in cutlass.range_constexpr(2):
                off = base + 1024 * (wg_tidx // 32) + 32 * (wg_tidx % 32) + 16 * half
                v = ld_shared_v4(p_addr + off)
                if cutlass.const_expr(cfg.handoff == "v4"):
                    st_cluster_v4_b32(ptx.mapa(p_addr + off, peer), *v)
                else:
                    st_async_v4(ptx.mapa(p_addr + off, peer), *v, bar_peer)
        exchange.write_state(slot, c_s_mn, softmax.own_state(), wg_tidx)
        if wg_tidx % 4 == 0 and cfg.handoff == "st_async":
            for i in cutlass.range_constexpr(cute.size(c_s_mn, mode=[0])):
                lr = c_s_mn[i, 0][0]
                a = ptx.mapa(state_addr + 4 * (lr * 4 + slot * 4 * L.M_TILE), peer)
                st_async_v4_f32(a, softmax.row_max[i], softmax.sigma_p[i], softmax.row_sum[i], softmax.gamma[i],
                                bar_peer)
        if wg_tidx % 4 == 0 and cfg.handoff in ("b32", "v4"):
            for i in cutlass.range_constexpr(cute.size(c_s_mn, mode=[0])):
                lr = c_s_mn[i, 0][0]
                a = ptx.mapa(state_addr + 4 * (lr * 4 + slot * 4 * L.M_TILE), peer)
                ptx.st_cluster_v4(a, softmax.row_max[i], softmax.sigma_p[i], softmax.row_sum[i], softmax.gamma[i])

    @cute.jit
    def load_vt(self, t_vt, kv_addr, s, rank, wg, warp_in_wg, lane):
        """Vᵀ of this WG's 128 dims of stage ``s`` as A fragments: per 64-dim tile and 32-token
        k-block one ldmatrix.x4.trans (16 dims x 32 tokens a warp, conflict-free in the
        Swizzle-128B K tile) and one prmt per register."""
        for h in cutlass.range_constexpr(2 if self.cfg.vt_load else 0):
            words = cute.recast_tensor(t_vt[h], Uint32)
            d = rank * HALF + wg * WG_DIMS + h * 64 + warp_in_wg * 16  # this warp's 16 dims
            for kb in cutlass.range_constexpr(2):
                tok = kb * 32 + (lane // 8) * 8 + lane % 8
                off = (d // 128) * 8192 + tok * 128 + ((((d % 128) // 16) ^ (tok % 8)) * 16)
                r = ptx.ldsm_x4_trans(kv_addr + s * STAGE_BYTES + off)
                words[0, 0, kb] = Uint32(cute.arch.prmt(r[0], r[1], 0x6420))
                words[1, 0, kb] = Uint32(cute.arch.prmt(r[0], r[1], 0x7531))
                words[2, 0, kb] = Uint32(cute.arch.prmt(r[2], r[3], 0x6420))
                words[3, 0, kb] = Uint32(cute.arch.prmt(r[2], r[3], 0x7531))

    @cute.jit
    def finish(self, acc_o_mn, c_o_mn, out, tile, req, rank, wg, nblk):
        """The unit's epilogue; with ``lean`` only under a condition false at run time
        (``nblk < 0``): left out entirely, O would be dead and the compiler would drop every
        PV WGMMA (lean variants before 2026-11-26 evening had none)."""
        if cutlass.const_expr(self.cfg.lean):
            if nblk < 0:
                self.epilogue(acc_o_mn, c_o_mn, out, tile, req, rank, wg)
        else:
            self.epilogue(acc_o_mn, c_o_mn, out, tile, req, rank, wg)

    @cute.jit
    def epilogue(self, acc_o_mn, c_o_mn, out, tile, req, rank, wg):
        """This WG's Oᵀ as bf16 (unnormalized: the skeleton's output is not checked)."""
        for h in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_o_mn[h], mode=[0])):
                for j in cutlass.range_constexpr(cute.size(acc_o_mn[h], mode=[1])):
                    dim = rank * HALF + wg * WG_DIMS + h * 64 + c_o_mn[i, j][0]
                    out[tile * L.M_TILE + c_o_mn[i, j][1], dim, req] = acc_o_mn[h][i, j].to(BFloat16)


def _file_hash():
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]


def fake_args(cfg: SkelConfig):
    from snapmla_cute.kernels import fake

    u8, bf16, f32, i32 = cutlass.Uint8, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    n, pages, w = fake.sym(), fake.sym(), fake.sym()
    h, s_q = cfg.heads, cfg.s_q
    R = h * s_q
    t = fake.tensor
    return (
        t(u8, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(bf16, (n, s_q, h, ROPE_DIM), (R * ROPE_DIM, h * ROPE_DIM, ROPE_DIM, 1), 16),
        t(f32, (n, s_q, h), (R, h, 1), 4),
        t(i32, (fake.sym() if cfg.varlen else n, w), (fake.sym(), 1), 4),
        t(bf16, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(u8, (pages, 64, KV_ROW_BYTES), (64 * KV_ROW_BYTES, KV_ROW_BYTES, 1), 16),
        t(f32, (pages, 64), (64, 1), 16),
        Int32(1),
        Float32(0.0),
        t(i32, (2 * 8 * 512,), (1,), 4),
        fake.stream(),
    )


def compile_skeleton(cfg: SkelConfig, arch: str | None = None, keep_sass: bool = False):
    from snapmla_cute import jit_cache

    return jit_cache.compile_kernel(f"v2skel_{_file_hash()}", cfg, V2Skeleton, fake_args, arch=arch,
                                    keep_sass=keep_sass)


# ---------------------------------------------------------------------------- timing

ROWS = {  # the bench's rows this dataflow serves (dense, s_q·h ≥ 64), (b, h, s_q, s_k)
    "b128 h128 s_k4096": (128, 128, 1, 4096),
    "b128 h128 s_k8192": (128, 128, 1, 8192),
    "b128 h128 s_k640": (128, 128, 1, 640),
    "b128 h128 s_k2048": (128, 128, 1, 2048),
    "b32 h64 s_k8192": (32, 64, 1, 8192),
    "b128 h128 s_k32768": (128, 128, 1, 32768),
    "b128 h128 s_q2 s_k8192": (128, 128, 2, 8192),  # not causal here: a lower bound for the causal row
    "b1 h128 s_k640": (1, 128, 1, 640),
    "b128 h128 s_k8192 varlen": (128, 128, 1, 8192),  # the bench's lengths, uniform in [4096, 12288]
}
VARLEN_ROWS = {"b128 h128 s_k8192 varlen"}


def skel_config(row, **switches):
    _, h, s_q, _ = ROWS[row]
    return SkelConfig(h, s_q, varlen=row in VARLEN_ROWS, **switches)


def skel_case(row):
    """The shipped decode's case of ``row`` (``make_case``), ``run(fn)`` that launches a
    compiled skeleton on it, and the trace tensor. The skeleton's block table is the case's
    own with equal lengths; else one row per block of the batch, (page, request, block, the
    request's blocks), with ``nblk`` the batch's block count."""
    import torch

    from snapmla_cute.profiling import Shape, make_case

    b, h, s_q, s_k = ROWS[row]
    c = make_case(Shape("v2", b, h, s_q, s_k, False, varlen=row in VARLEN_ROWS))
    lens = c["seqlens"].tolist()
    if len(set(lens)) == 1:
        table, nblk = c["block_table"], lens[0] // 64
    else:
        rows = []
        bt = c["block_table"].cpu()
        for r, n in enumerate(lens):
            nb = (n + 63) // 64
            rows += [(int(bt[r, j]), r, j, nb) for j in range(nb)]
        table, nblk = torch.tensor(rows, dtype=torch.int32, device="cuda"), len(rows)
    q_nope, q_rope, q_scale = c["q"]
    out = torch.empty_like(c["out"])
    tr = torch.zeros(2 * 8 * 512, dtype=torch.int32, device="cuda")

    def run(fn):
        fn(q_nope.view(torch.uint8), q_rope, q_scale, table, out, c["cache"].kv, c["cache"].kv_scale, nblk, 0.1, tr)

    return c, run, tr


DF = {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False, "softmax": False, "p_wait": False,
      "lean": True}
VARIANTS = {
    # without pv_sync a PV stays in flight across the loop's branches and ptxas serializes
    # every WGMMA of the kernel (C7514): how the handoffs and slot counts were first compared
    "v2 serialized, 2 slots, bulk": {},
    "v2 serialized, 3 slots, bulk": {"slots": 3},
    "v2 serialized, pairs, 3 slots, bulk": {"pairs": True, "slots": 3},
    "v2 serialized, 3 slots, b32 stores": {"slots": 3, "handoff": "b32"},
    "v2 serialized, 3 slots, v4 stores": {"slots": 3, "handoff": "v4"},
    "v2 serialized, 3 slots, st.async": {"slots": 3, "handoff": "st_async"},
    # the PV waited right after its issue: WGMMAs pipelined
    "v2": {"slots": 3, "handoff": "st_async", "pv_sync": True},
    "v2 bulk": {"slots": 3, "handoff": "bulk", "pv_sync": True},
    "v2 pairs": {"slots": 3, "handoff": "st_async", "pv_sync": True, "pairs": True},
    "v2 no chain": {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False},
    "v2 no chain, no softmax": {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False, "softmax": False},
    "v2 no P waits, no softmax": {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False, "softmax": False,
                                  "p_wait": False},
    "v2 lean": {"slots": 3, "handoff": "st_async", "pv_sync": True, "lean": True},
    "v2 no P waits, no softmax, lean": {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False,
                                        "softmax": False, "p_wait": False, "lean": True},
    "v2 lean, 4 stages": {"slots": 3, "handoff": "st_async", "pv_sync": True, "lean": True, "stages": 4},
    "v2 lean, SS QK": {"slots": 3, "handoff": "st_async", "pv_sync": True, "lean": True, "stages": 4,
                       "q_smem": True},
    "v2 no P waits, no softmax, lean, SS QK": {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False,
                                               "softmax": False, "p_wait": False, "lean": True, "stages": 4,
                                               "q_smem": True},
    # the dataflow alone ("df": no chain, no softmax, no P waits, lean) and its parts cut in turn
    "df": DF,
    "df, no Vt loads": {**DF, "vt_load": False},
    # (with no PV its Vᵀ registers are dead: the compiler drops their ldmatrix too)
    "df, no PV": {**DF, "pv_gemm": False},
    "df, no GEMMs": {**DF, "pv_gemm": False, "qk_gemm": False},
    "df, 4 stages": {**DF, "stages": 4},
    "df, 4 stages, 6 slots": {**DF, "stages": 4, "slots": 6},
    "df, SS QK": {**DF, "stages": 4, "q_smem": True},
    "df, SS QK, PV pairs": {**DF, "stages": 4, "q_smem": True, "pv_pairs": True},
    "v2 lean, SS QK, PV pairs": {"slots": 3, "handoff": "st_async", "pv_sync": True, "lean": True, "stages": 4,
                                 "q_smem": True, "pv_pairs": True},
    "v2 SS QK, PV pairs": {"slots": 3, "handoff": "st_async", "pv_sync": True, "stages": 4, "q_smem": True,
                           "pv_pairs": True},
    "v2, cta scope": {"slots": 3, "handoff": "st_async", "pv_sync": True, "scope": "cta"},
    "v2 no chain, cta scope": {"slots": 3, "handoff": "st_async", "pv_sync": True, "scope": "cta", "chain": False},
    "v2 no chain, no softmax, cta scope": {"slots": 3, "handoff": "st_async", "pv_sync": True, "scope": "cta",
                                           "chain": False, "softmax": False},
    "v2, cta scope, 4 stages": {"slots": 3, "handoff": "st_async", "pv_sync": True, "scope": "cta", "stages": 4},
    "v2, cta scope, 4 stages, 6 slots": {"slots": 6, "handoff": "st_async", "pv_sync": True, "scope": "cta",
                                         "stages": 4},
    "df, cta scope": {**DF, "scope": "cta"},
    "df, cta scope, 4 stages, 6 slots": {**DF, "scope": "cta", "stages": 4, "slots": 6},
    "df, no GEMMs, cta scope": {**DF, "pv_gemm": False, "qk_gemm": False, "scope": "cta"},
    "df, SS QK, PV pairs, cta scope": {**DF, "stages": 4, "q_smem": True, "pv_pairs": True, "scope": "cta"},
    "v2 SS QK, PV pairs, cta scope": {"slots": 3, "handoff": "st_async", "pv_sync": True, "stages": 4,
                                      "q_smem": True, "pv_pairs": True, "scope": "cta"},
    # (the variants above without "cta scope" wait and arrive at cluster scope; those with
    # "lean" measured no PV at all before the output was kept live: decode_v2.md)
    "v2 no L2 hint": {"slots": 3, "handoff": "st_async", "pv_sync": True, "evict_first": False},
    "v2 no P waits, no softmax, no L2 hint": {"slots": 3, "handoff": "st_async", "pv_sync": True, "chain": False,
                                              "softmax": False, "p_wait": False, "evict_first": False},
}


# the ladder of the closing measurements (decode_v2.md): the schedule, then its parts cut in turn
LADDER = ["v2, cta scope", "v2 no chain, cta scope", "v2 no chain, no softmax, cta scope", "df, cta scope",
          "df, no GEMMs, cta scope"]


def _compile_item(item):
    cfg = item
    compile_skeleton(cfg)
    return True


def main():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from snapmla_cute.bench import time_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=list(ROWS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--variants", nargs="*", default=LADDER)
    ap.add_argument("--trace", default="", help="a row: print cluster 0's per-block stamps (µs) of the v2 variant")
    ap.add_argument("--once", default="", help="a row: run each variant 3 times and stop (an ncu target)")
    a = ap.parse_args()
    if a.once:
        return once(a.once, a.variants)
    if a.trace:
        for v in a.variants:
            print(v, flush=True)
            trace(a.trace, VARIANTS[v])
        return
    cfgs = {(name, v): skel_config(name, **VARIANTS[v]) for name in a.rows for v in a.variants}
    uniq = sorted(set(cfgs.values()), key=repr)
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_item, uniq))
    from warm_bench import warm

    warm([("dense", (*ROWS[n][:3], ROWS[n][3], False, n in VARLEN_ROWS), {}) for n in a.rows], jobs=a.jobs,
         verbose=False)
    results = []
    for name in a.rows:
        c, run, _ = skel_case(name)
        fns = {"v1 (shipped)": c["step"]}
        for v in a.variants:
            fns[v] = lambda fn=compile_skeleton(cfgs[(name, v)]): run(fn)
        times = {k: [] for k in fns}
        for _ in range(a.reps):
            for k, fn in fns.items():
                times[k].append(time_us(fn))
                print(f"  {name} / {k}: {times[k][-1]:.1f}", flush=True)
        torch.cuda.synchronize()
        results.append((name, {k: min(v) for k, v in times.items()}))
        print(name, {k: [round(x, 1) for x in v] for k, v in times.items()}, flush=True)
    print()
    cols = list(results[0][1])
    print("| row | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, t in results:
        print(f"| {name} | " + " | ".join(f"{t[k]:.1f}" for k in cols) + " |")


EVENTS = ["own: top", "own: WG barrier passed", "own: state(k-1) in", "own: P(k) out", "own: softmax done",
          "own: P slot free", "WG0: P(k) in", "WG0: PV(k) issued"]


def once(row, variants):
    import torch

    _, run, _ = skel_case(row)
    for v in variants:
        fn = compile_skeleton(skel_config(row, **VARIANTS[v]))
        for _ in range(3):
            run(fn)
    torch.cuda.synchronize()


def trace(row, variant):
    import torch

    fn = compile_skeleton(skel_config(row, trace=True, **variant))
    _, run, tr = skel_case(row)
    for _ in range(3):
        tr.zero_()
        run(fn)
    torch.cuda.synchronize()
    t = tr.view(2, 8, 512).cpu().long()
    t0 = t[t != 0].min()
    print("block | " + " | ".join(f"r{r} {e}" for r in range(2) for e in EVENTS))
    for k in range(24):
        cells = []
        for r in range(2):
            for e in range(8):
                v = int(t[r, e, k])
                cells.append(f"{(v - t0) / 1000:.2f}" if v else "-")
        print(f"{k} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
