"""SnapMLA FP8 decode kernel for SM90a (paper §3, App. B, App. C Algorithm 1).

One CTA computes one 64-row query tile (rows = s_q * h packed, row r = i * h + head) over
the KV blocks the split-KV scheduler gave its part. Per 64-token block:

1. QK: FP8 e4m3 WGMMA over the 512 content dims and BF16 WGMMA over the 64 RoPE dims
   chained on one accumulator (Eq. 6: both parts live in the scaled domain), then
   s = ((acc · σ_q) · σ_k) · scale·log2e. The tensor core's truncating adder is modelled bit
   for bit by ``reference.tensor_core_mma``.
2. V transposition in place: the content tile (64 tokens x 512 dims, K-major SW128) is
   rewritten chunk by chunk as Vᵀ (512 x 64, K-major SW64, tokens in the order π) through
   registers; tokens past the sequence are zeroed so NaN-filled unused slots never reach
   the PV GEMM.
3. Online softmax with V-scale fusion P' = P·σ_k and per-row block-wise P quantization
   (σ_p = rowmax(P')/448), implicit dequantization through γ = 2^(m-m_new)·σ_p/σ_p,cur.
4. P accumulator → e4m3 A-operand registers, one prmt per word inside each lane: Vᵀ and P
   hold their 64 tokens in the order π of the accumulator's columns (``layouts.transpose.pi``;
   ``DecodeConfig.pi_order``), so no quad shuffles; published through shared memory with
   the softmax state.
5. PV: FP8 WGMMA (Vᵀ from shared memory; P of the WG's own block from its registers, of
   the other WG's block from shared memory), each consumer WG owning 256 output dims,
   strictly in block order; each block's P·V lands in a zeroed accumulator and
   o = γ·o + P·V is done in fp32.

6. Epilogue: o/ℓ through a 1 KB shared buffer per warp, leaving as 16-byte stores of whole
   128-byte lines (bf16 ``out``, or the fp32 partial of a split request); splits are merged
   in the same launch by the splits that process the request last in their part and by
   the parts left without KV work (``finish_split``).

The two consumer WGs own alternate blocks and are software-pipelined (see ``consume``);
the producer warp streams Q and the KV blocks through a 4-stage TMA/mbarrier ring; a
transposer WG runs step 2 for every block once its owner's QK has read it
(``DecodeConfig.transposer``, ``transpose_blocks``). The launch is cooperative (the
in-kernel merge waits for other CTAs) and programmatic-dependent (``DecodeConfig.pdl``):
each CTA waits for the previous grid's writes before its first global access.

Everything is checked against ``reference.mla_decode_emulated``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator

from snapmla_cute.format import CONTENT_DIM, FP8_MAX, ROPE_DIM
from snapmla_cute.layouts import smem as L
from snapmla_cute.layouts import transpose as T
from snapmla_cute.kernels.decode_scheduler import MAX_BATCH, DecodeSchedulerKernel
from snapmla_cute.kernels import ptx
from snapmla_cute.kernels.ptx import ldsm_x4_trans, stsm_x4
from snapmla_cute.pipelines import roles

FP8 = cutlass.Float8E4M3FN
LN2 = math.log(2.0)
OOB_PAGE = 1 << 30  # TMA zero-fills coordinates past the cache
# Each consumer WG runs its 256 output dims as `pv_splits` GEMMs, each into a zeroed
# accumulator that is then added to O in fp32 (o = γ·o + P·V): FP8 WGMMA accumulates with a
# narrower adder than fp32, and adding every block into one long-lived accumulator loses
# about 2^-13 of |O| per block.


@dataclass(frozen=True)
class DecodeConfig:
    heads: int
    s_q: int
    page_size: int
    causal: bool
    kv_stages: int = 4
    # PV GEMMs per consumer WG (N = 256 / pv_splits), see the module note. 4 (N = 64) with
    # two 32-register temporaries, S in the first: S and the temporaries then have one
    # WGMMA shape. 2 (N = 128, S in the 64-register temporary) made ptxas serialize every
    # warpgroup MMA (C7511) in 27 of the 138 CI variants, the fifth session's default among
    # them until the softmax changed; unserialized, the two measured within noise (s_k4096
    # 209-231 vs 220-222 µs, s_q2, h64 and s_k640 equal)
    pv_splits: int = 4
    # PV temporaries: with 2 a GEMM is issued before the previous one is added
    pv_temps: int = 2
    qk_early: bool = True  # issue QK of block j+2 right after PV(j) instead of when j+2 starts
    # whole blocks (every block but a request's last) skip the per-element masking of the
    # softmax and the transposition; False sends every block through the masked code (A/B)
    whole_blocks: bool = True
    # a fourth warpgroup transposes V (after the owner's QK has read the block), taking the
    # transposition off the consumers' per-block chain (``roles.layout``); False: each
    # consumer transposes its own blocks (3 warpgroups, consumers at 240 registers)
    transposer: bool = True
    # this WG's barrier on its own P stores sits right before its PV of that block instead
    # of right after the stores (by then the four warps' skew is gone)
    late_p_sync: bool = True
    # parts with no KV work help merge the split requests (plan: helper k takes request
    # k mod b) instead of exiting: a short split's merge is bound by each merger's reads
    merge_helpers: bool = True
    # Profiling only (wrong results): stages left out to time the rest, e.g. ("transpose",).
    # METHOD.md's "time variants that leave one stage out"; never set by the library.
    skip: tuple = ()
    # Profiling only: %globaltimer stamps (low 32 bits) of each CTA's milestones written
    # over the last split slab of the fp32 partials (``TRACE_EVENTS``; see
    # ``profiles/experiments/trace_small.py``). Never set by the library.
    trace: bool = False
    # Profiling only: SM clock stamps of each consumer WG's first LOOP_ITERS owned blocks
    # (``LOOP_EVENTS``), of the producer's stage acquisitions and of the transposer, over the
    # second-to-last split slab (``profiles/experiments/trace_loop.py``). Never set by the library.
    trace_loop: bool = False
    # σ_k of a block loaded before the state wait (not in the softmax)
    ks_early: bool = True
    # S in the first PV temporary's registers (their lives do not overlap). Without it
    # ptxas keeps both and spills (~500 B); with it and a different WGMMA shape for S and
    # the temporary (pv_splits=2) ptxas serializes the warpgroup MMAs in some variants
    s_alias: bool = True
    # this WG's own block's PV takes P from its registers (RS WGMMA) instead of shared memory:
    # 16 KB less shared-memory traffic per block, no barrier on the own warps' P stores
    pv_own_rs: bool = True
    # batches of at most 32 requests plan with one warp (shuffle scans, no CTA barriers)
    warp_plan: bool = True
    # programmatic dependent launch: the next kernel in the stream may be scheduled once
    # every CTA of this one has started, and this one waits (griddepcontrol.wait) for the
    # previous grid only before its first global access, after its launch and prologue
    pdl: bool = True
    # Vᵀ and P in the token order π of the QK accumulator (``layouts.transpose.pi``): the
    # transposer's ldmatrix rows are plain tokens and P is packed into e4m3 words inside
    # each lane (one prmt per word), without the quad shuffles of ``make_acc_into_op``
    pi_order: bool = True
    # each consumer also waits for the TMA of the other WG's blocks (A/B). Not needed: it
    # reads only their Vᵀ (after the transposer's or the owner's handshake, which follow
    # the owner's own wait) and their P, and releases such a stage after that
    other_kv_wait: bool = False
    # before its PV of blocks j-1 and j a consumer also waits for the transposer's signal of
    # j-1 (A/B; implied by j's: the transposer works and signals in block order)
    vt_wait_both: bool = False
    # P published with two stmatrix.x4 per thread and block (the A-fragment words are
    # exactly stmatrix's: rows r / r+8 x 16-byte k-halves) instead of 8 scalar stores
    p_stsm: bool = True

    @property
    def pv_n(self) -> int:
        """N of one PV GEMM: a consumer WG's 256 output dims over ``pv_splits``."""
        return CONTENT_DIM // roles.NUM_CONSUMER_WGS // self.pv_splits

    @property
    def rows(self) -> int:
        return self.heads * self.s_q

    @property
    def m_tiles(self) -> int:
        return (self.rows + L.M_TILE - 1) // L.M_TILE

    @property
    def box_rows(self) -> int:
        return min(L.BLOCK_N, self.page_size)


# the part's plan in shared memory: begin req, begin blk, end req, end blk, begin split,
# then (first split row, splits) of the begin request and of the end request
PLAN_WORDS = 16
# A split waits at most this long (ns, %globaltimer) for the other splits' partials, then
# traps (the launch fails with an error): a correct wait lasts at most one part's work.
MERGE_WAIT_LIMIT_NS = 4_000_000_000
# The merge's scratch in the (idle) KV stages: final LSEs at 0, the group sums at 1024, the
# splits' weights at MERGE_W_OFFSET, (64 rows, MERGE_MAX_SPLITS) floats. A request has at
# most num_parts <= SMs splits.
MERGE_W_OFFSET = 16384
MERGE_MAX_SPLITS = 160
MERGE_BATCH = 16  # partial rows a merging thread loads at once
# P' below this is treated as 0 (the block's σ_p is kept): against the running max such a
# block is negligible, and 448/P'max would otherwise overflow (scores > ~100 log2 units
# below the max made NaN).
P_TINY = 2.0**-64
# σ_p = rowmax(P')·fp32(1/448) (a multiply, not a second IEEE division per row; the
# emulation uses the same constant)
INV_FP8_MAX = 1.0 / FP8_MAX
SM90_SMEM_BYTES = 232448  # dynamic shared memory a CTA may use (227 KB)
# the epilogue's shared buffer per consumer warp: 8 rows of 128 bytes (store_tile)
EPI_ROWS = 8
EPI_ROW_BYTES = 128
EPI_BYTES = EPI_ROWS * EPI_ROW_BYTES
# DecodeConfig.trace: word k of a CTA's 32 (consumer milestones at 16·wg + k)
TRACE_EVENTS = dict(
    start=0, planned=1, q_issued=2, kv_issued=3, q_arrived=4, qk_done=5, softmax_done=6, pv_done=7,
    epilogue_done=8, count_seen=9, merged=10, exit=11, lengths_read=12, splits_counted=13,
    part_planned=14, smid=15,
)
TRACE_WORDS = 32
# DecodeConfig.trace_loop: per CTA, [wg][owned iteration][event] then per block g < LOOP_BLOCKS
# the producer's acquire (KV stage free), the transposer's start (K read) and end (Vᵀ written)
LOOP_EVENTS = dict(
    top=0, qk_waited=1, state_waited=2, sm_max=3, sm_exp=4, softmax_done=5, p_published=6, vt_waited=7, pv_done=8,
    kv_waited=9, qk_issued=10,
)
LOOP_ITERS = 16
LOOP_BLOCKS = 32
LOOP_PROD = 2 * LOOP_ITERS * len(LOOP_EVENTS)
LOOP_WORDS = LOOP_PROD + 3 * LOOP_BLOCKS


class DecodeKernel:
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.roles = roles.layout(cfg.transposer)
        self.threads = self.roles.threads
        self.planner = DecodeSchedulerKernel()
        self.n_sub = L.BLOCK_N // cfg.box_rows
        self.scale_stride = max(cfg.box_rows, 32)  # floats between boxes of scales

    # ------------------------------------------------------------------ helpers (fmha.py)
    @staticmethod
    def _layout_separate(thr, src, ref):
        lt = cute.make_layout(())
        ge = cute.make_layout(())
        for k, v in enumerate(ref):
            if cutlass.const_expr(v < thr):
                lt = cute.append(lt, src[k])
            else:
                ge = cute.append(ge, src[k])
        r = None
        if cutlass.const_expr(cute.rank(lt) == 1):
            r = cute.append(lt, ge)
        else:
            r = cute.append(cute.append(cute.make_layout(()), lt), ge)
        return r

    @cute.jit
    def _layout_acc_mn(self, tiled_mma, acc):
        """Accumulator layout viewed as (rows of this thread, cols of this thread)."""
        separated = self._layout_separate(tiled_mma.shape_mnk[0], acc[0], tiled_mma.tv_layout_C.stride[1])
        v_m = separated[0]
        v_n = separated[1]
        v_m1 = None
        v_n1 = None
        if cutlass.const_expr(cute.rank(v_m) == 1):
            v_m1 = cute.append(v_m, acc[1])
        else:
            v_m1 = cute.append(cute.append(cute.make_layout(()), v_m), acc[1])
        if cutlass.const_expr(cute.rank(v_n) == 1):
            v_n1 = cute.append(v_n, acc[2])
        else:
            v_n1 = cute.append(cute.append(cute.make_layout(()), v_n), acc[2])
        r = None
        if cutlass.const_expr(cute.rank(v_m1) == 1):
            r = cute.append(v_m1, v_n1)
        else:
            r = cute.append(cute.append(cute.make_layout(()), v_m1), v_n1)
        return r

    @staticmethod
    def _c_to_a_layout(c, a):
        return cute.make_layout(
            (a, c.shape[1], (c.shape[2], cute.size(c, mode=[0]) // cute.size(a))),
            stride=(c.stride[0], c.stride[1], (c.stride[2], cute.size(a, mode=[2]) * c.stride[0][2])),
        )

    @cute.jit
    def _acc_to_fp8_operand(self, acc, operand_layout_tv):
        """fp32 P accumulator → e4m3 A-operand registers: cvt, then the quad byte permutation
        (``layouts.p_permute``); with ``DecodeConfig.pi_order`` one prmt per word inside the
        lane instead (K position k then holds column π(k), as Vᵀ does)."""
        operand = cute.make_rmem_tensor_like(self._c_to_a_layout(acc.layout, operand_layout_tv.shape[1]), FP8)
        operand_as_acc = cute.make_tensor(operand.iterator, acc.layout)
        operand_as_acc.store(acc.load().to(FP8))
        if cutlass.const_expr(self.cfg.pi_order):
            values = cute.recast_tensor(operand, Uint32)
            for n in cutlass.range_constexpr(cute.size(values, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(values, mode=[2])):
                    for ii in cutlass.range_constexpr(0, 4, 2):
                        # words ii, ii+1: rows (r, r+8) x columns (2q, 2q+1) of column groups
                        # 2g, 2g+1 → row r's four columns, then row r+8's
                        v0 = values[ii, n, k]
                        v1 = values[ii + 1, n, k]
                        values[ii, n, k] = cute.arch.prmt(v0, v1, 0x5410)
                        values[ii + 1, n, k] = cute.arch.prmt(v0, v1, 0x7632)
            return operand
        tidx, _, _ = cute.arch.thread_idx()
        tid = tidx % 4
        values = cute.recast_tensor(operand, Uint32)
        for n in cutlass.range_constexpr(cute.size(values, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(values, mode=[2])):
                for ii in cutlass.range_constexpr(0, 8, 4):
                    v0 = values[ii // 2 + 0, n, k]
                    v1 = values[ii // 2 + 1, n, k]
                    send = 1
                    if tid == 1 or tid == 2:
                        send = 0
                    src_lane = (0x3021 >> (tid * 4)) & 0xF
                    va = v1
                    if send == 0:
                        va = v0
                    va = cute.arch.shuffle_sync_op(va, src_lane, 0xFFFFFFFF, 7199)
                    send = 1 - send
                    src_lane = (0x2130 >> (tid * 4)) & 0xF
                    vb = v1
                    if send == 0:
                        vb = v0
                    vb = cute.arch.shuffle_sync_op(vb, src_lane, 0xFFFFFFFF, 7199)
                    order = 0x5410
                    if send == 0:
                        order = 0x1054
                    values[ii // 2 + 0, n, k] = cute.arch.prmt(va, vb, order)
                    order = 0x7632
                    if send == 0:
                        order = 0x3276
                    values[ii // 2 + 1, n, k] = cute.arch.prmt(va, vb, order)
        return operand

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        m_q_nope: cute.Tensor,  # uint8 (R, 512, b)
        m_q_rope: cute.Tensor,  # bf16 (R, 64, b)
        m_q_scale: cute.Tensor,  # fp32 (R, b)
        m_kv_content: cute.Tensor,  # uint8 (page_size, 512, P)
        m_kv_rope: cute.Tensor,  # bf16 (page_size, 64, P)
        m_kv_scale: cute.Tensor,  # fp32 (page_size, P)
        m_block_table: cute.Tensor,  # int32 (b, max_pages)
        m_seqlens: cute.Tensor,  # int32 (b,)
        m_sched: cute.Tensor,  # int32 (parts, 8)
        m_split_offsets: cute.Tensor,  # int32 (b + 1,)
        m_out: cute.Tensor,  # bf16 (R, 512, b)
        m_lse: cute.Tensor,  # fp32 (b, h, s_q)
        m_o_partial: cute.Tensor,  # fp32 (R, 512, splits)
        m_lse_partial: cute.Tensor,  # fp32 (R, splits)
        m_counters: cute.Tensor,  # int32 (b, 2 * m_tiles), zero between calls
        scale_log2: Float32,
        stream,
    ):
        cfg = self.cfg
        m_q_nope = cute.make_tensor(cute.recast_ptr(m_q_nope.iterator, dtype=FP8), m_q_nope.layout)
        m_kv_content = cute.make_tensor(cute.recast_ptr(m_kv_content.iterator, dtype=FP8), m_kv_content.layout)
        K = OperandMajorMode.K
        qk_mma = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (L.M_TILE, L.BLOCK_N))
        qk_rope_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K, K, Float32, (1, 1, 1), (L.M_TILE, L.BLOCK_N))
        pv_n = cfg.pv_n
        pv_mma_rs = sm90_utils.make_trivial_tiled_mma(
            FP8, FP8, K, K, Float32, (1, 1, 1), (L.M_TILE, pv_n), warpgroup.OperandSource.RMEM
        )
        pv_mma_ss = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (L.M_TILE, pv_n))
        # the first k-step of a chain runs with scale-d = 0 (zeroing the accumulator in
        # registers instead makes ptxas spill); one MMA object per accumulate mode, set once
        qk_mma0 = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (L.M_TILE, L.BLOCK_N))
        pv_mma0 = sm90_utils.make_trivial_tiled_mma(FP8, FP8, K, K, Float32, (1, 1, 1), (L.M_TILE, pv_n))
        pv_mma_rs0 = sm90_utils.make_trivial_tiled_mma(
            FP8, FP8, K, K, Float32, (1, 1, 1), (L.M_TILE, pv_n), warpgroup.OperandSource.RMEM
        )

        q_nope_sl = L.q_nope_layout()
        q_rope_sl = L.q_rope_layout()
        kv_sl = L.kv_content_layout(cfg.kv_stages)
        kr_sl = L.kv_rope_layout(cfg.kv_stages)
        vt_sl = L.vt_layout(cfg.kv_stages)
        p_sl = L.p_layout(2)
        br = cfg.box_rows

        tma_q_nope, g_q_nope = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_q_nope, cute.slice_(q_nope_sl, (None, None, 0)), (L.M_TILE, CONTENT_DIM)
        )
        tma_q_rope, g_q_rope = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_q_rope, cute.slice_(q_rope_sl, (None, None, 0)), (L.M_TILE, ROPE_DIM)
        )
        kv_box_sl = cute.slice_(cute.flat_divide(cute.slice_(kv_sl, (None, None, 0)), (br, CONTENT_DIM)), (None, None, 0, 0))
        kr_box_sl = cute.slice_(cute.flat_divide(cute.slice_(kr_sl, (None, None, 0)), (br, ROPE_DIM)), (None, None, 0, 0))
        tma_kv, g_kv = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_kv_content, kv_box_sl, (br, CONTENT_DIM))
        tma_kr, g_kr = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_kv_rope, kr_box_sl, (br, ROPE_DIM))
        tma_ks, g_ks = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_kv_scale, cute.make_layout((br,)), (br,)
        )
        self.q_bytes = L.M_TILE * CONTENT_DIM + L.M_TILE * ROPE_DIM * 2
        self.kv_bytes = L.BLOCK_N * CONTENT_DIM + L.BLOCK_N * ROPE_DIM * 2 + L.BLOCK_N * 4

        stages = cfg.kv_stages

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            qk_mbar: cute.struct.MemRange[cutlass.Int64, stages]  # transposer: owner's QK done
            vt_mbar: cute.struct.MemRange[cutlass.Int64, stages]  # transposer: Vᵀ written
            vt_valid: cute.struct.MemRange[Int32, stages]  # transposer: valid tokens of the block
            # (row, field, slot), a row's 4 fields contiguous (one 16-byte access)
            state: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 4 * L.M_TILE], 16]
            plan: cute.struct.MemRange[Int32, PLAN_WORDS]
            scan: cute.struct.MemRange[Int32, self.threads // 32]
            k_scale: cute.struct.Align[cute.struct.MemRange[Float32, self.scale_stride * self.n_sub * stages], 128]
            q_nope: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(q_nope_sl)], 1024]
            q_rope: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(q_rope_sl)], 1024]
            kv: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(kv_sl)], 1024]
            # right after kv: its address is kv's + kv_smem_bytes (the epilogue computes it)
            epi: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, roles.NUM_CONSUMER_WGS * 4 * EPI_BYTES], 128]
            k_rope: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kr_sl)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(p_sl)], 1024]

        self.shared_storage = SharedStorage
        self.kv_smem_bytes = cute.cosize(kv_sl)
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SM90_SMEM_BYTES):  # else the launch fails
            raise ValueError(f"decode: shared storage {SharedStorage.size_in_bytes()} B, at most {SM90_SMEM_BYTES} B")
        num_parts = m_sched.shape[0]
        self.kernel(
            qk_mma, qk_rope_mma, pv_mma_rs, pv_mma_ss, qk_mma0, pv_mma0, pv_mma_rs0,
            tma_q_nope, g_q_nope, tma_q_rope, g_q_rope, tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks,
            m_q_scale, m_block_table, m_seqlens, m_sched, m_split_offsets,
            m_out, m_lse, m_o_partial, m_lse_partial, m_counters, scale_log2,
            q_nope_sl, q_rope_sl, kv_sl, kr_sl, vt_sl, p_sl,
        ).launch(
            grid=[cfg.m_tiles, num_parts, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,  # fixes the register pool so ptxas honours setmaxnreg
            cooperative=True,  # every part resident: split requests are merged in-kernel
            use_pdl=cfg.pdl,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        qk_rope_mma: cute.TiledMma,
        pv_mma_rs: cute.TiledMma,
        pv_mma_ss: cute.TiledMma,
        qk_mma0: cute.TiledMma,
        pv_mma0: cute.TiledMma,
        pv_mma_rs0: cute.TiledMma,
        tma_q_nope: cute.CopyAtom,
        g_q_nope: cute.Tensor,
        tma_q_rope: cute.CopyAtom,
        g_q_rope: cute.Tensor,
        tma_kv: cute.CopyAtom,
        g_kv: cute.Tensor,
        tma_kr: cute.CopyAtom,
        g_kr: cute.Tensor,
        tma_ks: cute.CopyAtom,
        g_ks: cute.Tensor,
        m_q_scale: cute.Tensor,
        m_block_table: cute.Tensor,
        m_seqlens: cute.Tensor,
        m_sched: cute.Tensor,
        m_split_offsets: cute.Tensor,
        m_out: cute.Tensor,
        m_lse: cute.Tensor,
        m_o_partial: cute.Tensor,
        m_lse_partial: cute.Tensor,
        m_counters: cute.Tensor,
        scale_log2: Float32,
        q_nope_sl: cute.ComposedLayout,
        q_rope_sl: cute.ComposedLayout,
        kv_sl: cute.ComposedLayout,
        kr_sl: cute.ComposedLayout,
        vt_sl: cute.ComposedLayout,
        p_sl: cute.ComposedLayout,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, part, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // roles.THREADS_PER_WG)

        # profiling stamps (DecodeConfig.trace / trace_loop): one row per CTA over the last /
        # second-to-last split slab of the fp32 partials
        self._trace = self._stamp_rows(m_o_partial, m_sched, 1, TRACE_WORDS) if cfg.trace else None
        self._ltrace = self._stamp_rows(m_o_partial, m_sched, 2, LOOP_WORDS) if cfg.trace_loop else None
        if cutlass.const_expr(cfg.trace or cfg.trace_loop):
            self._trace_cta = part * cfg.m_tiles + m_tile
        if cutlass.const_expr(cfg.pdl):
            # safe this early: a dependent's griddepcontrol.wait still waits for this whole
            # grid, and it is scheduled only after every CTA of this grid has started
            cute.arch.griddepcontrol_launch_dependents()
        if tidx == 0:
            self.stamp("start")
        if warp_idx == 0:
            # the descriptors' first use is on the critical path of a short part
            for atom in (tma_q_nope, tma_q_rope, tma_kv, tma_kr, tma_ks):
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        consumer_warps = roles.NUM_CONSUMER_WGS * roles.THREADS_PER_WG // 32
        q_prod, q_cons = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=self.q_bytes, defer_sync=True,
        ).make_participants()
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(), num_stages=cfg.kv_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=self.kv_bytes, defer_sync=True,
        )
        kv_prod, _ = kv_pipe.make_participants()

        s_q_nope = storage.q_nope.get_tensor(q_nope_sl.outer, swizzle=q_nope_sl.inner)
        s_q_rope = storage.q_rope.get_tensor(q_rope_sl.outer, swizzle=q_rope_sl.inner)
        s_kv = storage.kv.get_tensor(kv_sl.outer, swizzle=kv_sl.inner)
        s_kr = storage.k_rope.get_tensor(kr_sl.outer, swizzle=kr_sl.inner)
        # TMA needs 128-byte aligned destinations: one 128-byte slot per box of scales
        s_ks = storage.k_scale.get_tensor(
            cute.make_layout(
                (cfg.box_rows, self.n_sub, cfg.kv_stages),
                stride=(1, self.scale_stride, self.scale_stride * self.n_sub),
            )
        )
        s_p = storage.p.get_tensor(p_sl.outer, swizzle=p_sl.inner)
        s_vt = cute.make_tensor(cute.recast_ptr(s_kv.iterator, vt_sl.inner), vt_sl.outer)
        s_state = storage.state.get_tensor(cute.make_layout((L.M_TILE, 4, 2), stride=(4, 1, 4 * L.M_TILE)))

        s_plan = storage.plan.get_tensor(cute.make_layout((PLAN_WORDS,)))

        qk_mbar = storage.qk_mbar.data_ptr()
        vt_mbar = storage.vt_mbar.data_ptr()
        s_valid = storage.vt_valid.get_tensor(cute.make_layout((cfg.kv_stages,)))
        if cutlass.const_expr(cfg.transposer):
            if tidx == 0:
                for st in cutlass.range_constexpr(cfg.kv_stages):
                    cute.arch.mbarrier_init(qk_mbar + st, roles.THREADS_PER_WG)
                    cute.arch.mbarrier_init(vt_mbar + st, roles.THREADS_PER_WG)
        cute.arch.mbarrier_init_fence()
        if tidx == 0:
            # the epilogue derives storage.epi's address from kv's (one register less)
            if storage.epi.data_ptr().toint() != storage.kv.data_ptr().toint() + self.kv_smem_bytes:
                ptx.trap()
        cute.arch.sync_threads()
        if cutlass.const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the previous grid's writes (lengths, KV, Q, counters)
        # this part's plan, computed here from the lengths (no scheduler launch); the KV
        # stages are its scratch until the producer starts
        self.plan(m_seqlens, m_sched, m_split_offsets, storage.kv.data_ptr(), storage.scan.get_tensor(
            cute.make_layout((self.threads // 32,))), s_plan, m_tile, part, tidx)
        if tidx == 0:
            self.stamp("planned")

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(roles.PRODUCER_REGS)
            if warp_idx == 0:
                begin_req, begin_blk, end_req, end_blk, _, n_reqs = self.read_plan(s_plan, m_seqlens)
                self.load(
                    tma_q_nope, g_q_nope, tma_q_rope, g_q_rope, tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks,
                    s_q_nope, s_q_rope, s_kv, s_kr, s_ks, m_block_table, m_seqlens,
                    q_prod, kv_prod, m_tile, begin_req, begin_blk, end_req, end_blk, n_reqs,
                )
        else:
            consumer_args = (
                qk_mma, qk_rope_mma, pv_mma_rs, pv_mma_ss, qk_mma0, pv_mma0, pv_mma_rs0,
                s_q_nope, s_q_rope, s_kv, s_kr, s_ks, s_p, s_vt, s_state, storage.kv.data_ptr().toint(),
                m_q_scale, m_seqlens, s_plan, m_out, m_lse, m_o_partial, m_lse_partial, m_counters,
                scale_log2, q_cons, kv_pipe, m_tile,
            )
            if cutlass.const_expr(cfg.transposer):
                # the consumers' branch comes last: ptxas spilled them at 224 registers when
                # the transposer's 40-register branch followed it
                if wg_idx == self.roles.transposer_wg:
                    cute.arch.setmaxregister_decrease(roles.TRANSPOSER_REGS)
                    self.transpose_blocks(
                        m_seqlens, s_plan, storage.kv.data_ptr().toint(), qk_mbar, vt_mbar, s_valid,
                        tidx % roles.THREADS_PER_WG,
                    )
                else:
                    self.consumer_role(consumer_args, m_seqlens, s_plan, wg_idx, qk_mbar, vt_mbar, s_valid)
            else:
                self.consumer_role(consumer_args, m_seqlens, s_plan, wg_idx, qk_mbar, vt_mbar, s_valid)

    @cute.jit
    def consumer_role(self, args, m_seqlens, s_plan, wg_idx, qk_mbar, vt_mbar, s_valid):
        """Consumer WGs: raise the register budget, read the plan, run ``consume``."""
        cute.arch.setmaxregister_increase(self.roles.consumer_regs)
        # read after setmaxnreg: values live across it would be spilled to local memory
        begin_req, begin_blk, end_req, end_blk, begin_split, n_reqs = self.read_plan(s_plan, m_seqlens)
        self.consume(
            *args, begin_req, begin_blk, end_req, end_blk, begin_split, n_reqs,
            wg_idx - self.roles.first_consumer_wg, qk_mbar, vt_mbar, s_valid,
        )

    def _stamp_rows(self, m_o_partial, m_sched, slab_from_end: int, words: int):
        """Int32 (CTAs, words) over split slab ``-slab_from_end`` of the fp32 partials."""
        slab = (m_o_partial.shape[2] - slab_from_end) * self.cfg.rows * CONTENT_DIM
        return cute.make_tensor(
            cute.recast_ptr(m_o_partial.iterator + slab, dtype=Int32),
            cute.make_layout((self.cfg.m_tiles * m_sched.shape[0], words), stride=(words, 1)),
        )

    @cute.jit
    def stamp(self, event: cutlass.Constexpr, wg=0):
        """DecodeConfig.trace: this CTA's %globaltimer (low 32 bits) at ``event``."""
        if cutlass.const_expr(self.cfg.trace):
            t = Int32(cute.arch.globaltimer())
            if cutlass.const_expr(event == "start"):
                self._trace[self._trace_cta, TRACE_EVENTS["smid"]] = Int32(cute.arch.smid())
            self._trace[self._trace_cta, TRACE_EVENTS[event] + 16 * wg] = t

    @cute.jit
    def lstamp(self, word):
        """DecodeConfig.trace_loop: this SM's clock at ``word`` of the CTA's loop trace (the
        caller guards: one thread, within the traced window)."""
        if cutlass.const_expr(self.cfg.trace_loop):
            self._ltrace[self._trace_cta, word] = Int32(cute.arch.clock())

    @cute.jit
    def lstamp_it(self, event: cutlass.Constexpr, wg, r, j, wg_tidx):
        """A consumer WG's loop event for its owned block j of the part's first request."""
        if cutlass.const_expr(self.cfg.trace_loop):
            it = j // 2
            if r == 0 and it < LOOP_ITERS and wg_tidx == 0:
                self.lstamp((wg * LOOP_ITERS + it) * len(LOOP_EVENTS) + LOOP_EVENTS[event])

    @cute.jit
    def plan(self, m_seqlens, m_sched, m_split_offsets, scratch_ptr, s_scan, s_plan, m_tile, part, tidx):
        """All threads: this part's row of the split-KV plan (``decode_scheduler``'s, same
        code) into ``s_plan``, plus the split rows of its first and last request. CTA (0, 0)
        also writes ``split_offsets`` and every m-tile-0 CTA its ``sched`` row, so the
        metadata shows the plan that ran."""
        batch = m_seqlens.shape[0]
        num_parts = m_sched.shape[0]
        words = cute.recast_ptr(scratch_ptr, dtype=Int32)
        s_pre = cute.make_tensor(words, cute.make_layout((MAX_BATCH + 1,)))
        s_split = cute.make_tensor(words + (MAX_BATCH + 1), cute.make_layout((MAX_BATCH + 1,)))
        total = Int32(0)
        width = Int32(1)
        small = batch <= 32
        if cutlass.const_expr(not self.cfg.warp_plan):
            small = batch < 0  # the CTA-wide scans for every batch (A/B)
        if small:
            # one warp, one request per lane: both prefix sums by shuffles, no CTA barrier
            # (the lengths' load and the two CTA-wide scans, four barriers, took ~1.6 µs of each CTA's plan)
            if tidx < 32:
                total, width = self.plan_warp(m_seqlens, s_pre, s_split, batch, num_parts, tidx)
        else:
            total = self.planner.unit_prefix(m_seqlens, s_pre, s_scan, tidx, self.threads)
            cute.arch.sync_threads()
            if tidx == 0:
                self.stamp("lengths_read")
            width = self.planner.width_of(total, num_parts)
            self.planner.split_prefix(s_pre, batch, width, s_split, s_scan, tidx, self.threads)
        if tidx == 0:
            self.stamp("splits_counted")
            b_req, b_blk, e_req, e_blk, split = self.planner.part_plan(s_pre, batch, total, width, part)
            self.stamp("part_planned")
            s_plan[0] = b_req
            s_plan[1] = b_blk
            s_plan[2] = e_req
            s_plan[3] = e_blk
            s_plan[4] = split
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
    def plan_warp(self, m_seqlens, s_pre, s_split, batch, num_parts, lane):
        """``plan``'s two prefix sums for batch ≤ 32 by warp 0 (lane r: request r), the same
        values as ``DecodeSchedulerKernel.unit_prefix`` / ``split_prefix``: returns (total
        units, units per part); ``s_pre`` and ``s_split`` are visible to lane 0 after."""
        ov = self.planner.cfg.fixed_overhead_blocks
        units = Int32(0)
        if lane < batch:
            units = self.planner.n_blocks(m_seqlens[lane]) + ov
        incl = self.planner.warp_inclusive_scan(units, lane)
        total = cute.arch.shuffle_sync(incl, 31)
        if lane == 0:
            self.stamp("lengths_read")
        width = self.planner.width_of(total, num_parts)
        splits = Int32(0)
        if lane < batch:
            s_pre[lane] = incl - units
            splits = self.planner.splits_of(incl - units, incl, width)  # S_r, S_r+1 on registers
        if lane == 0:
            s_pre[batch] = total
        incl2 = self.planner.warp_inclusive_scan(splits, lane)
        total2 = cute.arch.shuffle_sync(incl2, 31)
        if lane < batch:
            s_split[lane] = incl2 - splits
        if lane == 0:
            s_split[batch] = total2
        cute.arch.sync_warp()
        return total, width

    @cute.jit
    def merger_count(self, n_splits, helpers, req, batch):
        """Mergers of a split request: its splits 0..n-2, plus the idle parts k < ``helpers``
        with k mod b = req (the plan's helper assignment)."""
        n = n_splits - 1
        if helpers > req:
            n += (helpers - 1 - req) // batch + 1
        return n

    @cute.jit
    def read_plan(self, s_plan, m_seqlens):
        """This part's work: (begin request, begin block, end request, end block, begin split, n requests)."""
        begin_req = s_plan[0]
        n_reqs = Int32(0)
        if begin_req < m_seqlens.shape[0]:
            n_reqs = s_plan[2] - begin_req + 1
        return begin_req, s_plan[1], s_plan[2], s_plan[3], s_plan[4], n_reqs

    @cute.jit
    def block_range(self, m_seqlens, r, req, begin_blk, end_req, end_blk):
        """(length, first block, end block) of the r-th request segment of this part."""
        seqlen = m_seqlens[req]
        blk_lo = Int32(0)
        if r == 0:
            blk_lo = begin_blk
        blk_hi = (seqlen + L.BLOCK_N - 1) // L.BLOCK_N
        if req == end_req:
            blk_hi = end_blk
        return seqlen, blk_lo, blk_hi

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(
        self, tma_q_nope, g_q_nope, tma_q_rope, g_q_rope, tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks,
        s_q_nope, s_q_rope, s_kv, s_kr, s_ks, m_block_table, m_seqlens,
        q_prod, kv_prod, m_tile, begin_req, begin_blk, end_req, end_blk, n_reqs,
    ):
        cfg = self.cfg
        br = cfg.box_rows
        # Q tiles (64 rows x dims) per request
        tq_s, tq_g = cpasync.tma_partition(
            tma_q_nope, 0, cute.make_layout(1), cute.group_modes(s_q_nope, 0, 2),
            cute.group_modes(cute.flat_divide(g_q_nope, (L.M_TILE, CONTENT_DIM)), 0, 2),
        )
        tqr_s, tqr_g = cpasync.tma_partition(
            tma_q_rope, 0, cute.make_layout(1), cute.group_modes(s_q_rope, 0, 2),
            cute.group_modes(cute.flat_divide(g_q_rope, (L.M_TILE, ROPE_DIM)), 0, 2),
        )
        # KV boxes of `br` tokens: smem (box, sub, stage), gmem (box, tile in page, page)
        tkv_s, tkv_g = cpasync.tma_partition(
            tma_kv, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(s_kv, (br, CONTENT_DIM)), 0, 2),
            cute.group_modes(cute.flat_divide(g_kv, (br, CONTENT_DIM)), 0, 2),
        )
        tkr_s, tkr_g = cpasync.tma_partition(
            tma_kr, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(s_kr, (br, ROPE_DIM)), 0, 2),
            cute.group_modes(cute.flat_divide(g_kr, (br, ROPE_DIM)), 0, 2),
        )
        tks_s, tks_g = cpasync.tma_partition(
            tma_ks, 0, cute.make_layout(1),
            cute.group_modes(s_ks, 0, 1),
            cute.group_modes(cute.flat_divide(g_ks, (br,)), 0, 1),
        )
        lane = cute.arch.lane_idx()
        table_width = m_block_table.shape[1]
        for r in cutlass.range(n_reqs, unroll=1):
            req = begin_req + r
            seqlen, blk_lo, blk_hi = self.block_range(m_seqlens, r, req, begin_blk, end_req, end_blk)
            n_entries = (seqlen + cfg.page_size - 1) // cfg.page_size
            hq = q_prod.acquire_and_advance()
            cute.copy(tma_q_nope, tq_g[(None, m_tile, 0, req)], tq_s[(None, hq.index)], tma_bar_ptr=hq.barrier)
            cute.copy(tma_q_rope, tqr_g[(None, m_tile, 0, req)], tqr_s[(None, hq.index)], tma_bar_ptr=hq.barrier)
            if r == 0 and lane == 0:
                self.stamp("q_issued")
            # block-table entries 32 at a time, one per lane: one load latency per 32 pages
            # instead of one per KV block on the producer's critical path
            base = Int32(-64)
            cached = Int32(OOB_PAGE)
            for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                hk = kv_prod.acquire_and_advance()
                if cutlass.const_expr(cfg.trace_loop):
                    if r == 0 and blk - blk_lo < LOOP_BLOCKS and lane == 0:
                        self.lstamp(LOOP_PROD + blk - blk_lo)
                for sub in cutlass.range_constexpr(self.n_sub):
                    tok = blk * L.BLOCK_N + sub * br
                    entry = tok // cfg.page_size
                    if entry >= base + 32:
                        base = entry
                        cached = Int32(OOB_PAGE)
                        if base + lane < n_entries and base + lane < table_width:
                            cached = m_block_table[req, base + lane]
                    page = cute.arch.shuffle_sync(cached, entry - base)
                    if tok >= seqlen:
                        page = Int32(OOB_PAGE)
                    tile = (tok % cfg.page_size) // br
                    cute.copy(tma_kv, tkv_g[(None, tile, 0, page)], tkv_s[(None, sub, 0, hk.index)], tma_bar_ptr=hk.barrier)
                    cute.copy(tma_kr, tkr_g[(None, tile, 0, page)], tkr_s[(None, sub, 0, hk.index)], tma_bar_ptr=hk.barrier)
                    cute.copy(tma_ks, tks_g[(None, tile, page)], tks_s[(None, sub, hk.index)], tma_bar_ptr=hk.barrier)
                if r == 0 and blk == blk_lo and lane == 0:
                    self.stamp("kv_issued")

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def keep_bytes(self, n):
        """Mask of the low ``n`` bytes of a word (n clamped to 0..4): a word of 4 tokens
        of which ``n`` are inside the sequence."""
        keep = Uint32(0xFFFFFFFF)
        if n < 4:
            keep = Uint32(0)
            if n > 0:
                keep = (Uint32(1) << (8 * n)) - Uint32(1)
        return keep

    @staticmethod
    def pair_barrier(ids, slot):
        """The two consumer WGs' named barrier ``ids[slot]`` (roles.BARRIERS.state / pfree)."""
        return pipeline.NamedBarrier(barrier_id=ids[0] + slot, num_threads=roles.PAIR_THREADS)

    @cute.jit
    def wait_state(self, s_state, c_s_mn, slot, row_max, sigma_p, row_sum, gamma_o):
        """Waits for the other WG's block in ``slot`` and reads its softmax state."""
        self.pair_barrier(roles.BARRIERS.state, slot).arrive_and_wait()
        self.read_state(s_state, c_s_mn, slot, row_max, sigma_p, row_sum, gamma_o)

    @cute.jit
    def read_state(self, s_state, c_s_mn, slot, row_max, sigma_p, row_sum, gamma_o):
        """The softmax state published in ``slot`` (a WG's own slot is its WG index: blocks
        alternate owners and slots alike)."""
        for i in cutlass.range_constexpr(cute.size(c_s_mn, mode=[0])):
            lr = c_s_mn[i, 0][0]
            st = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(s_state[lr, None, slot], st)
            row_max[i] = st[0]
            sigma_p[i] = st[1]
            row_sum[i] = st[2]
            gamma_o[i] = st[3]

    @cute.jit
    def transpose_v(self, kv_addr: Int32, stage, valid_tokens, sync, wg_tidx, masked: cutlass.Constexpr):
        """Content tile → Vᵀ in place with ldmatrix.trans → prmt → stmatrix; ``masked`` (a
        request's last block) zeroes tokens ≥ valid (``layouts.transpose``: the lane maps,
        their step constants and a byte-exact CPU replay of this program). One warpgroup
        barrier per 8 KiB chunk, between its loads and its stores; both sides are
        bank-conflict free."""
        warp = wg_tidx // 32
        lane = wg_tidx % 32
        pi = self.cfg.pi_order
        base = kv_addr + stage * (L.BLOCK_N * CONTENT_DIM)
        src0 = T.ldsm_src(warp, lane, 0, pi)
        dst0 = base + T.stsm_dst(warp, lane, 0)
        q = lane & 3
        sel_even = Int32(0x6420)
        sel_odd = Int32(0x7531)
        if cutlass.const_expr(not pi):
            if q >= 2:
                sel_even = Int32(0x2064)
                sel_odd = Int32(0x3175)
        sel0 = sel_even
        sel1 = sel_odd
        if lane >= 16:  # c = lane / 4 >= 4: the two words swap dims
            sel0 = sel_odd
            sel1 = sel_even
        keep_lo = Uint32(0xFFFFFFFF)
        keep_hi = Uint32(0xFFFFFFFF)
        if cutlass.const_expr(masked):
            if cutlass.const_expr(pi):
                # words of tokens t0, t0+1, t0+8, t0+9 (``layouts.transpose.ldsm_keep_masks``):
                # the low two bytes of two 4-token masks
                first = (warp % 2) * 32 + 2 * q
                pair = Uint32(0xFFFF)

                def keep_pairs(t0):
                    return (self.keep_bytes(valid_tokens - t0) & pair) | (
                        (self.keep_bytes(valid_tokens - t0 - 8) & pair) << 16)

                keep_lo = keep_pairs(first)
                keep_hi = keep_pairs(first + 16)
            else:
                first = (warp % 2) * 32 + 4 * q
                keep_lo = self.keep_bytes(valid_tokens - first)
                keep_hi = self.keep_bytes(valid_tokens - first - 16)
        per_chunk = T.LDSM_STEPS // 4
        for c in cutlass.range_constexpr(4):
            regs = []
            for kk in cutlass.range_constexpr(per_chunk):
                k = c * per_chunk + kk
                regs.append(ldsm_x4_trans(base + ((src0 ^ T.SRC_XOR[k]) + T.SRC_ADD[k])))
            sync.arrive_and_wait()
            for kk in cutlass.range_constexpr(per_chunk):
                k = c * per_chunk + kk
                r0, r1, r2, r3 = regs[kk]
                if cutlass.const_expr(masked):
                    stsm_x4(
                        dst0 + T.DST_ADD[k],
                        Int32(Uint32(cute.arch.prmt(r0, r1, sel0)) & keep_lo),
                        Int32(Uint32(cute.arch.prmt(r0, r1, sel1)) & keep_lo),
                        Int32(Uint32(cute.arch.prmt(r2, r3, sel0)) & keep_hi),
                        Int32(Uint32(cute.arch.prmt(r2, r3, sel1)) & keep_hi),
                    )
                else:
                    stsm_x4(
                        dst0 + T.DST_ADD[k],
                        cute.arch.prmt(r0, r1, sel0),
                        cute.arch.prmt(r0, r1, sel1),
                        cute.arch.prmt(r2, r3, sel0),
                        cute.arch.prmt(r2, r3, sel1),
                    )

    @cute.jit
    def transpose_block(self, kv_addr: Int32, stage, valid, sync, wg_tidx):
        """``transpose_v`` of one block: the masking code only when some of its 64 tokens
        are past the sequence (every block with ``DecodeConfig.whole_blocks=False``)."""
        if valid >= (L.BLOCK_N if self.cfg.whole_blocks else 1 << 30):
            self.transpose_v(kv_addr, stage, valid, sync, wg_tidx, False)
        else:
            self.transpose_v(kv_addr, stage, valid, sync, wg_tidx, True)

    def stage_of(self, g):
        """g mod kv_stages for a block count g ≥ 0: a mask when the stage count is a power of
        two (Int32 % and // compile to signed-division fix-ups, per use, in the hot loop)."""
        S = self.cfg.kv_stages
        if S & (S - 1) == 0:
            return g & (S - 1)
        return g % S

    @cute.jit
    def wait_vt(self, vt_mbar, g):
        """Waits until the transposer has written Vᵀ of the g-th block."""
        cute.arch.mbarrier_wait(vt_mbar + self.stage_of(g), self.kv_state(g).phase)

    @cute.jit
    def transpose_blocks(self, m_seqlens, s_plan, kv_addr, qk_mbar, vt_mbar, s_valid, wg_tidx):
        """Transposer WG (``DecodeConfig.transposer``): the part's KV blocks in order, each
        once its owner's QK has read K (``qk_mbar``; the owner also left the block's valid
        token count in ``s_valid``): content → Vᵀ in place, tokens past the sequence zeroed,
        then a proxy fence and ``vt_mbar``. One loop over the part's block count, so the
        40-register budget holds without spills."""
        sync = pipeline.NamedBarrier(barrier_id=roles.BARRIERS.transposer_sync, num_threads=roles.THREADS_PER_WG)
        begin_req, begin_blk, end_req, end_blk, _, n_reqs = self.read_plan(s_plan, m_seqlens)
        total = Int32(0)
        for r in cutlass.range(n_reqs, unroll=1):
            _, blk_lo, blk_hi = self.block_range(m_seqlens, r, begin_req + r, begin_blk, end_req, end_blk)
            total += blk_hi - blk_lo
        for g in cutlass.range(total, unroll=1):
            stage = self.stage_of(g)
            cute.arch.mbarrier_wait(qk_mbar + stage, self.kv_state(g).phase)
            if cutlass.const_expr(self.cfg.trace_loop):
                if g < LOOP_BLOCKS and wg_tidx == 0:
                    self.lstamp(LOOP_PROD + LOOP_BLOCKS + g)
            valid = s_valid[stage]
            tid = ptx.launder(wg_tidx, g)  # lane addresses recomputed per block, not spilled
            if cutlass.const_expr("transpose" not in self.cfg.skip):
                self.transpose_block(kv_addr, stage, valid, sync, tid)
            cute.arch.fence_proxy("async.shared", space="cta")  # stmatrix, then WGMMA reads
            cute.arch.mbarrier_arrive(vt_mbar + stage)
            if cutlass.const_expr(self.cfg.trace_loop):
                if g < LOOP_BLOCKS and wg_tidx == 0:
                    self.lstamp(LOOP_PROD + 2 * LOOP_BLOCKS + g)

    @cute.jit
    def kv_state(self, g):
        """Pipeline state of the g-th KV block this CTA consumes (stage g % S, phase (g / S) % 2):
        each consumer WG waits the stages in order but holds up to three at once, so the
        states are computed instead of carried."""
        S = self.cfg.kv_stages
        if cutlass.const_expr(S & (S - 1) == 0):
            phase = (g >> (S.bit_length() - 1)) & 1
        else:
            phase = (g // S) % 2
        return pipeline.PipelineState(S, g, self.stage_of(g), phase)

    @cute.jit
    def issue_qk(self, qk_mma0, qk_mma, qk_rope_mma, acc_s, t_q, t_k, t_qr, t_kr, stage):
        """QK of one block, asynchronously: 16 e4m3 k-steps then 4 bf16 RoPE k-steps chained on
        one accumulator (Eq. 6). The tensor core's truncating adder is part of the spec
        (``reference.tensor_core_mma``), so no promotion waits are needed."""
        warpgroup.fence()
        if cutlass.const_expr("qk" not in self.cfg.skip):
            for kb in cutlass.range_constexpr(cute.size(t_q, mode=[2])):
                cute.gemm(qk_mma0 if kb == 0 else qk_mma, acc_s, t_q[None, None, kb, 0], t_k[None, None, kb, stage], acc_s)
            for kb in cutlass.range_constexpr(cute.size(t_qr, mode=[2])):
                cute.gemm(qk_rope_mma, acc_s, t_qr[None, None, kb, 0], t_kr[None, None, kb, stage], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def pv_blocks(self, pv_mma0, pv_mma, acc_o_mn, temps, temps_mn, t_p, t_v, blocks, sync=None, pv_rs=None):
        """This WG's 256 output dims of one or two blocks' P·V, in block order (order
        enforcement): each N = 256 / pv_splits GEMM lands in a zeroed temporary and
        o = γ·o + P·V is done in fp32. With two temporaries the next GEMM is issued before
        the previous one is waited for and added. ``blocks``: [(stage, γ, P slot, P
        registers or None), ...]: a block with P registers runs as RS WGMMAs (``pv_rs``:
        the first-k-step and accumulating MMAs), the others read P from shared memory;
        ``sync`` (a barrier) is passed before the last block's first GEMM: that block's P
        was stored by this WG's four warps."""
        work = [(st, g, sl, regs, h) for st, g, sl, regs in blocks for h in range(self.cfg.pv_splits)]
        n_t = len(temps)
        for w in cutlass.range_constexpr(len(work) + n_t - 1):
            if cutlass.const_expr(w < len(work)):
                st, _, sl, regs, h = work[w]
                if cutlass.const_expr(sync is not None and w == len(work) - self.cfg.pv_splits):
                    sync.arrive_and_wait()
                acc = temps[w % n_t]
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(t_p, mode=[2])):
                    if cutlass.const_expr(regs is not None):
                        mma = pv_rs[0] if kb == 0 else pv_rs[1]
                        cute.gemm(mma, acc, regs[None, None, kb], t_v[h][None, None, kb, st], acc)
                    else:
                        mma = pv_mma0 if kb == 0 else pv_mma
                        cute.gemm(mma, acc, t_p[None, None, kb, sl], t_v[h][None, None, kb, st], acc)
                warpgroup.commit_group()
            d = w - (n_t - 1)  # the GEMM to finish now
            if cutlass.const_expr(d >= 0):
                warpgroup.wait_group(min(n_t - 1, len(work) - 1 - d))
                _, g, _, _, h = work[d]
                self.rescale_add(acc_o_mn[h], temps_mn[d % n_t], g)

    @cute.jit
    def consume(
        self, qk_mma, qk_rope_mma, pv_mma_rs, pv_mma_ss, qk_mma0, pv_mma0, pv_mma_rs0,
        s_q_nope, s_q_rope, s_kv, s_kr, s_ks, s_p, s_vt, s_state, kv_addr,
        m_q_scale, m_seqlens, s_plan, m_out, m_lse, m_o_partial, m_lse_partial, m_counters,
        scale_log2, q_cons, kv_pipe, m_tile, begin_req, begin_blk, end_req, end_blk, begin_split,
        n_reqs, wg, qk_mbar, vt_mbar, s_valid,
    ):
        """Consumer WG ``wg``: Algorithm 1 software-pipelined (App. C).

        Within a request the WGs own alternate blocks. For each owned block j this WG: waits
        its QK (issued two blocks earlier), hands the block to the transposer WG (or, without
        it, transposes V_j in place itself), waits for the other WG's state of block j-1, runs
        the softmax of block j and publishes P_j and its state, then runs PV of block j-1 (P
        from shared memory) and of block j (P from registers), after their Vᵀ is written
        (the transposer's signal of j implies j-1's), and finally issues QK of block j+2.
        The chain between the WGs is softmax → state → softmax; QK and PV of one WG overlap
        the other's softmax."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        wg_tidx = tidx % roles.THREADS_PER_WG
        pv_n = cfg.pv_n
        # Accumulate modes are set once here: set() inside a staged branch would rebind the
        # MMA's state in that region (the DSL's dominance rule).
        for mma in (qk_mma, qk_rope_mma, pv_mma_rs, pv_mma_ss):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        for mma in (qk_mma0, pv_mma0, pv_mma_rs0):
            mma.set(warpgroup.Field.ACCUMULATE, False)
        pv_rs = (pv_mma_rs0, pv_mma_rs)
        qk_thr = qk_mma.get_slice(wg_tidx)
        qkr_thr = qk_rope_mma.get_slice(wg_tidx)
        pv_rs_thr = pv_mma_rs.get_slice(wg_tidx)
        pv_ss_thr = pv_mma_ss.get_slice(wg_tidx)

        t_q = qk_thr.make_fragment_A(qk_thr.partition_A(s_q_nope))
        t_k = qk_thr.make_fragment_B(qk_thr.partition_B(s_kv))
        t_qr = qkr_thr.make_fragment_A(qkr_thr.partition_A(s_q_rope))
        t_kr = qkr_thr.make_fragment_B(qkr_thr.partition_B(s_kr))
        s_vt_parts = cute.flat_divide(s_vt, (pv_n, L.BLOCK_N))  # (pv_n, 64, 512/pv_n, 1, stages)
        t_v_ss = [
            pv_ss_thr.make_fragment_B(pv_ss_thr.partition_B(cute.slice_(s_vt_parts, (None, None, wg * cfg.pv_splits + h, 0, None))))
            for h in range(cfg.pv_splits)
        ]
        t_p_ss = pv_ss_thr.make_fragment_A(pv_ss_thr.partition_A(s_p))
        t_p_store = pv_rs_thr.partition_A(s_p)  # this thread's register-layout view of sP
        p_addr = s_p.iterator.toint()  # (p_stsm)

        acc_o = [pv_rs_thr.make_fragment_C(pv_rs_thr.partition_shape_C((L.M_TILE, pv_n))) for _ in range(cfg.pv_splits)]
        acc_o_mn = [cute.make_tensor(a.iterator, self._layout_acc_mn(pv_mma_rs, a.layout)) for a in acc_o]
        temps = [pv_rs_thr.make_fragment_C(pv_rs_thr.partition_shape_C((L.M_TILE, pv_n))) for _ in range(cfg.pv_temps)]
        temps_mn = [cute.make_tensor(t.iterator, self._layout_acc_mn(pv_mma_rs, t.layout)) for t in temps]
        acc_t = temps[0]
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((L.M_TILE, L.BLOCK_N)))
        if cutlass.const_expr(cfg.s_alias and cute.size(acc_t) >= cute.size(acc_s)):
            # S and a PV temporary are never live together (QK(j+2) is issued after this
            # block's PV), so S may borrow the temporary's registers
            acc_s = cute.make_tensor(acc_t.iterator, acc_s.layout)
        acc_s_mn = cute.make_tensor(acc_s.iterator, self._layout_acc_mn(qk_mma, acc_s.layout))
        c_s = qk_thr.partition_C(cute.make_identity_tensor((L.M_TILE, L.BLOCK_N)))
        c_s_mn = cute.make_tensor(c_s.iterator, self._layout_acc_mn(qk_mma, c_s.layout))
        rows_per_thr = cute.size(c_s_mn, mode=[0])

        wg_sync = pipeline.NamedBarrier(barrier_id=roles.BARRIERS.wg_sync[0] + wg, num_threads=roles.THREADS_PER_WG)

        row_max = cute.make_rmem_tensor((rows_per_thr,), Float32)
        row_sum = cute.make_rmem_tensor((rows_per_thr,), Float32)
        sigma_p = cute.make_rmem_tensor((rows_per_thr,), Float32)
        gamma = cute.make_rmem_tensor((rows_per_thr,), Float32)  # of my block
        gamma_o = cute.make_rmem_tensor((rows_per_thr,), Float32)  # of the other WG's block
        q_fac = cute.make_rmem_tensor((rows_per_thr,), Float32)
        n_vis = cute.make_rmem_tensor((rows_per_thr,), Int32)

        k_global = Int32(0)
        for r in cutlass.range(n_reqs, unroll=1):
            req = begin_req + r
            seqlen, blk_lo, blk_hi = self.block_range(m_seqlens, r, req, begin_blk, end_req, end_blk)
            n = blk_hi - blk_lo
            k0 = k_global
            for i in cutlass.range_constexpr(rows_per_thr):
                # laundered: row // heads is recomputed per request, not kept live (spilled)
                row = ptx.launder(m_tile * L.M_TILE + c_s_mn[i, 0][0], req)
                row_max[i] = -Float32.inf
                row_sum[i] = 0.0
                sigma_p[i] = 1.0
                q_fac[i] = scale_log2
                n_vis[i] = seqlen
                if row < cfg.rows:
                    q_fac[i] = m_q_scale[row, req] * scale_log2  # σ_q·scale·log2e, once per row
                    if cutlass.const_expr(cfg.causal):
                        n_vis[i] = seqlen - cfg.s_q + row // cfg.heads + 1
            for h in cutlass.range_constexpr(cfg.pv_splits):
                acc_o[h].fill(0.0)
            hq = q_cons.wait_and_advance()
            if r == 0 and wg_tidx == 0:
                self.stamp("q_arrived", wg)
            first = (wg + k0) & 1  # my first block in this request (blocks alternate owners)
            if cutlass.const_expr(cfg.other_kv_wait):
                if first == 1 and n >= 1:
                    kv_pipe.consumer_wait(self.kv_state(k0))
            if first < n:
                kv_pipe.consumer_wait(self.kv_state(k0 + first))
                if cutlass.const_expr(cfg.qk_early):
                    self.issue_qk(qk_mma0, qk_mma, qk_rope_mma, acc_s, t_q, t_k, t_qr, t_kr, self.stage_of(k0 + first))
            for j in cutlass.range(first, n, 2, unroll=1):
                g = k0 + j
                stage = self.stage_of(g)
                slot = g & 1
                blk = blk_lo + j
                self.lstamp_it("top", wg, r, j, wg_tidx)
                if cutlass.const_expr(not cfg.qk_early):
                    self.issue_qk(qk_mma0, qk_mma, qk_rope_mma, acc_s, t_q, t_k, t_qr, t_kr, stage)
                warpgroup.wait_group(0)
                self.lstamp_it("qk_waited", wg, r, j, wg_tidx)
                ks_pre = None
                if cutlass.const_expr(cfg.ks_early):
                    # σ_k of this thread's columns, loaded before the state wait (in the
                    # softmax the loads' latency was on the chain); after the QK wait, so
                    # these 16 registers are not live beside the QK in flight
                    ks_pre = cute.make_rmem_tensor((cute.size(c_s_mn, mode=[1]),), Float32)
                    for jj in cutlass.range_constexpr(cute.size(c_s_mn, mode=[1])):
                        c = c_s_mn[0, jj][1]
                        ks_pre[jj] = s_ks[c % cfg.box_rows, c // cfg.box_rows, stage]
                if r == 0 and j == first and wg_tidx == 0:
                    self.stamp("qk_done", wg)
                valid = seqlen - blk * L.BLOCK_N
                if cutlass.const_expr(cfg.transposer):
                    if wg_tidx == 0:
                        s_valid[stage] = valid  # released by the arrive below
                    cute.arch.mbarrier_arrive(qk_mbar + stage)  # K read: the transposer may go
                # ---- V transposition in place (tokens past the sequence zeroed), then the
                # other WG's state of block j-1. Every block but a request's last is whole
                # (all 64 tokens valid, and visible to every row): no masking code there.
                if cutlass.const_expr("transpose" not in cfg.skip and not cfg.transposer):
                    self.transpose_block(kv_addr, stage, valid, wg_sync, wg_tidx)
                if j >= 1:
                    self.wait_state(s_state, c_s_mn, 1 - slot, row_max, sigma_p, row_sum, gamma_o)
                else:
                    # defined on every path: the state is not carried across iterations (it
                    # is re-read from s_state, the WG's own at the end), so its registers are
                    # free outside the softmax
                    for i in cutlass.range_constexpr(rows_per_thr):
                        row_max[i] = -Float32.inf
                        row_sum[i] = 0.0
                        sigma_p[i] = 1.0
                self.lstamp_it("state_waited", wg, r, j, wg_tidx)
                # ---- softmax with V-scale fusion and block-wise P quantization
                if cutlass.const_expr("softmax" not in cfg.skip):
                    if valid - (cfg.s_q - 1 if cfg.causal else 0) >= (L.BLOCK_N if cfg.whole_blocks else 1 << 30):
                        self.softmax(
                            acc_s_mn, c_s_mn, s_ks, stage, blk, valid, j == 0, q_fac, n_vis, row_max, row_sum, sigma_p,
                            gamma, False, (lambda ev: self.lstamp_it(ev, wg, r, j, wg_tidx)) if cfg.trace_loop else None,
                            ks_pre,
                        )
                    else:
                        self.softmax(
                            acc_s_mn, c_s_mn, s_ks, stage, blk, valid, j == 0, q_fac, n_vis, row_max, row_sum, sigma_p,
                            gamma, True, None, ks_pre,
                        )
                t_p = self._acc_to_fp8_operand(acc_s, pv_mma_rs.tv_layout_A)
                self.lstamp_it("softmax_done", wg, r, j, wg_tidx)
                if r == 0 and j == first and wg_tidx == 0:
                    self.stamp("softmax_done", wg)
                # ---- publish P and the softmax state (and, without the transposer, Vᵀ)
                if g >= 2:
                    self.pair_barrier(roles.BARRIERS.pfree, slot).arrive_and_wait()
                if cutlass.const_expr(cfg.p_stsm):
                    words = cute.recast_tensor(t_p, Uint32)
                    for kb in cutlass.range_constexpr(cute.size(words, mode=[2])):
                        off = L.p_stsm_offset(wg_tidx // 32, wg_tidx % 32, kb)
                        addr = p_addr + slot * (L.M_TILE * L.BLOCK_N) + off
                        stsm_x4(addr, *[Int32(words[i, 0, kb]) for i in range(4)])
                else:
                    cute.autovec_copy(t_p, t_p_store[None, None, None, slot])
                if wg_tidx % 4 == 0:
                    for i in cutlass.range_constexpr(rows_per_thr):
                        lr = c_s_mn[i, 0][0]
                        st = cute.make_rmem_tensor((4,), Float32)
                        st[0] = row_max[i]
                        st[1] = sigma_p[i]
                        st[2] = row_sum[i]
                        st[3] = gamma[i]
                        cute.autovec_copy(st, s_state[lr, None, slot])
                cute.arch.fence_proxy("async.shared", space="cta")
                # each thread releases its own P and state to the other WG; this WG's own
                # warps meet only before their PV of this block (``late_p_sync``), by when
                # the warps' skew is gone
                if cutlass.const_expr(not cfg.late_p_sync):
                    wg_sync.arrive_and_wait()
                self.pair_barrier(roles.BARRIERS.state, slot).arrive()
                self.lstamp_it("p_published", wg, r, j, wg_tidx)
                # ---- PV of block j-1 (P from the other WG), then of block j (own P: from
                # registers with pv_own_rs, else from shared memory after this WG's barrier)
                own_p = t_p if cfg.pv_own_rs else None
                own_sync = wg_sync if cfg.late_p_sync and not cfg.pv_own_rs else None
                if cutlass.const_expr(cfg.transposer):
                    # the transposer finishes blocks in order, each thread arriving after
                    # its stores and fence: Vᵀ of g ready means Vᵀ of g-1 too
                    if cutlass.const_expr(cfg.vt_wait_both):
                        if j >= 1:
                            self.wait_vt(vt_mbar, g - 1)
                    self.wait_vt(vt_mbar, g)
                self.lstamp_it("vt_waited", wg, r, j, wg_tidx)
                if j >= 1:
                    if cutlass.const_expr("pv" not in cfg.skip):
                        self.pv_blocks(
                            pv_mma0, pv_mma_ss, acc_o_mn, temps, temps_mn, t_p_ss, t_v_ss,
                            [(self.stage_of(g - 1), gamma_o, 1 - slot, None), (stage, gamma, slot, own_p)],
                            own_sync, pv_rs,
                        )
                    self.pair_barrier(roles.BARRIERS.pfree, 1 - slot).arrive()
                    kv_pipe.consumer_release(self.kv_state(g - 1))
                else:
                    if cutlass.const_expr("pv" not in cfg.skip):
                        self.pv_blocks(
                            pv_mma0, pv_mma_ss, acc_o_mn, temps, temps_mn, t_p_ss, t_v_ss, [(stage, gamma, slot, own_p)],
                            own_sync, pv_rs,
                        )
                kv_pipe.consumer_release(self.kv_state(g))
                self.lstamp_it("pv_done", wg, r, j, wg_tidx)
                # ---- next owned block: its QK runs while this WG waits for the other's state
                if cutlass.const_expr(cfg.other_kv_wait):
                    if j + 1 < n:
                        kv_pipe.consumer_wait(self.kv_state(g + 1))
                if j + 2 < n:
                    kv_pipe.consumer_wait(self.kv_state(g + 2))
                    self.lstamp_it("kv_waited", wg, r, j, wg_tidx)
                    if cutlass.const_expr(cfg.qk_early):
                        self.issue_qk(qk_mma0, qk_mma, qk_rope_mma, acc_s, t_q, t_k, t_qr, t_kr, self.stage_of(g + 2))
                self.lstamp_it("qk_issued", wg, r, j, wg_tidx)
            warpgroup.wait_group(0)  # nothing is in flight here; tells ptxas acc_s is free
            # the other WG's last block comes after my last one
            if n >= 1 and (k0 + n - 1) & 1 == wg:
                # this WG's last softmax state, as it published it (visible to its own warps
                # after the barrier before its last PV, or this one)
                if cutlass.const_expr(cfg.pv_own_rs and cfg.late_p_sync):
                    wg_sync.arrive_and_wait()
                self.read_state(s_state, c_s_mn, wg, row_max, sigma_p, row_sum, gamma_o)
            if n >= 1 and (k0 + n - 1) & 1 != wg:
                g = k0 + n - 1
                slot = g & 1
                self.wait_state(s_state, c_s_mn, slot, row_max, sigma_p, row_sum, gamma_o)
                if cutlass.const_expr(cfg.transposer):
                    self.wait_vt(vt_mbar, g)
                self.pv_blocks(pv_mma0, pv_mma_ss, acc_o_mn, temps, temps_mn, t_p_ss, t_v_ss, [(self.stage_of(g), gamma_o, slot, None)])
                self.pair_barrier(roles.BARRIERS.pfree, slot).arrive()
                kv_pipe.consumer_release(self.kv_state(g))
            k_global = k0 + n
            hq.release()
            if r == 0 and wg_tidx == 0:
                self.stamp("pv_done", wg)
            # where this request's result goes: split rows of a request cut by a part boundary
            first = Int32(0)
            n_splits = Int32(1)
            split = Int32(0)
            if r == 0:
                first = s_plan[5]
                n_splits = s_plan[6]
                split = begin_split
            elif req == end_req:
                first = s_plan[7]
                n_splits = s_plan[8]
            self.epilogue(
                pv_mma_rs, acc_o_mn, row_max, sigma_p, row_sum, m_out, m_lse, m_o_partial, m_lse_partial,
                m_tile, req, first + split, n_splits, n > 0, wg, wg_tidx, kv_addr,
            )
            if r == 0 and wg_tidx == 0:
                self.stamp("epilogue_done", wg)
            if n_splits > 1:
                helpers = s_plan[9] if cutlass.const_expr(cfg.merge_helpers) else Int32(0)
                n_mergers = self.merger_count(n_splits, helpers, req, m_seqlens.shape[0])
                self.finish_split(
                    m_out, m_lse, m_o_partial, m_lse_partial, m_counters, kv_addr, m_tile, req, first, split,
                    n_splits, n_mergers, tidx - self.roles.first_consumer_wg * roles.THREADS_PER_WG, True,
                )
        if cutlass.const_expr(cfg.merge_helpers):
            if s_plan[10] >= 0:
                # an idle part: merge a share of a split request's rows (plan)
                self.finish_split(
                    m_out, m_lse, m_o_partial, m_lse_partial, m_counters, kv_addr, m_tile, s_plan[10], s_plan[11],
                    s_plan[12], s_plan[13], s_plan[14], tidx - self.roles.first_consumer_wg * roles.THREADS_PER_WG,
                    False,
                )
        if wg_tidx == 0:
            self.stamp("exit", wg)

    @cute.jit
    def softmax(
        self, acc_s_mn, c_s_mn, s_ks, stage, blk, valid, first_blk, q_fac, n_vis, row_max, row_sum, sigma_p, gamma,
        masked: cutlass.Constexpr, mark=None, ks_pre=None,
    ):
        """Alg. 1 lines 4-9 for this thread's rows: scores in the log2 domain, P = 2^(s-m),
        P' = P·σ_k, σ_p = rowmax(P')/448, P'/σ_p left in ``acc_s_mn`` for the e4m3 cast;
        updates (m, σ_p, ℓ) and this block's γ. ``q_fac``: σ_q·scale·log2e per row.

        s = t·q_fac with t = acc·σ_k: the row max is q_fac·max(t) (rounding is monotone, so
        bit-equal to the max of the rounded s) and 2^(s-m) takes t·q_fac - m as one FFMA.
        ``masked`` (a request's last block, or causal rows): columns past a row's visible
        length get t = -inf and σ_k = 0; whole blocks skip both tests. ``ks_pre``: σ_k of
        this thread's columns loaded by the caller (``DecodeConfig.ks_early``); ``mark``:
        ``DecodeConfig.trace_loop``'s stamp for the phases."""
        cfg = self.cfg
        rows_per_thr = cute.size(c_s_mn, mode=[0])
        cols_per_thr = cute.size(c_s_mn, mode=[1])
        # σ_k of this thread's columns; in a masked block 0 past the sequence (those slots
        # may hold NaN; their P is 0, and 0·0 keeps P' clean without a per-element test)
        ks = cute.make_rmem_tensor((cols_per_thr,), Float32)
        for j in cutlass.range_constexpr(cols_per_thr):
            c = c_s_mn[0, j][1]
            if cutlass.const_expr(ks_pre is not None):
                ks[j] = ks_pre[j]
                if cutlass.const_expr(masked):
                    if c >= valid:
                        ks[j] = 0.0
            elif cutlass.const_expr(masked):
                ks[j] = 0.0
                if c < valid:
                    ks[j] = s_ks[c % cfg.box_rows, c // cfg.box_rows, stage]
            else:
                ks[j] = s_ks[c % cfg.box_rows, c // cfg.box_rows, stage]
        # Phases over all of this thread's rows (not row after row), reductions as trees:
        # the rows' chains interleave and no reduction is a 16-deep dependent chain (the
        # row-by-row form ran ~2300 cycles per block for ~440 instructions, latency-bound).
        t_max = [None] * rows_per_thr
        for i in cutlass.range_constexpr(rows_per_thr):
            lim = n_vis[i] - blk * L.BLOCK_N  # visible columns of this row in the block
            ts = []
            for j in cutlass.range_constexpr(cols_per_thr):
                t = acc_s_mn[i, j] * ks[j]
                if cutlass.const_expr(masked):
                    if c_s_mn[i, j][1] >= lim:
                        t = -Float32.inf
                acc_s_mn[i, j] = t
                ts.append(t)
            t_max[i] = self._tree(ts, cute.arch.fmax)
        for off in (2, 1):  # the quad's max, rows interleaved
            for i in cutlass.range_constexpr(rows_per_thr):
                t_max[i] = cute.arch.fmax(t_max[i], cute.arch.shuffle_sync_bfly(t_max[i], offset=off))
        if cutlass.const_expr(mark is not None):
            mark("sm_max")
        m_prev = [None] * rows_per_thr
        m_new = [None] * rows_per_thr
        m_safe = [None] * rows_per_thr
        sums = [None] * rows_per_thr
        p_max = [None] * rows_per_thr
        for i in cutlass.range_constexpr(rows_per_thr):
            mp = row_max[i]
            if first_blk:
                mp = -Float32.inf
            m_prev[i] = mp
            mn = cute.arch.fmax(mp, t_max[i] * q_fac[i])
            ms = mn
            if mn == -Float32.inf:
                ms = 0.0
            m_new[i] = mn
            m_safe[i] = ms
        for i in cutlass.range_constexpr(rows_per_thr):
            ps = []
            pfs = [Float32(0.0)]
            for j in cutlass.range_constexpr(cols_per_thr):
                p = cute.math.exp2(acc_s_mn[i, j] * q_fac[i] - m_safe[i], fastmath=True)  # one FFMA
                pf = p * ks[j]  # P' = P·σ_k
                acc_s_mn[i, j] = pf
                ps.append(p)
                pfs.append(pf)
            sums[i] = self._tree(ps, lambda a, b: a + b)
            p_max[i] = self._tree(pfs, cute.arch.fmax)
        for off in (2, 1):
            for i in cutlass.range_constexpr(rows_per_thr):
                sums[i] = sums[i] + cute.arch.shuffle_sync_bfly(sums[i], offset=off)
                p_max[i] = cute.arch.fmax(p_max[i], cute.arch.shuffle_sync_bfly(p_max[i], offset=off))
        if cutlass.const_expr(mark is not None):
            mark("sm_exp")
        for i in cutlass.range_constexpr(rows_per_thr):
            sig_prev = sigma_p[i]
            if first_blk:
                sig_prev = 1.0
            # one division either way: 448/P'max, or 1/σ_p,prev for a negligible block
            num = Float32(1.0)
            den = sig_prev
            sig_cur = sig_prev
            if p_max[i] > Float32(P_TINY):
                num = Float32(FP8_MAX)
                den = p_max[i]
                sig_cur = p_max[i] * Float32(INV_FP8_MAX)  # one FMUL: σ_p's definition
            inv = num / den
            for j in cutlass.range_constexpr(cols_per_thr):
                acc_s_mn[i, j] = acc_s_mn[i, j] * inv
            g = Float32(0.0)
            if m_prev[i] != -Float32.inf:
                g = cute.math.exp2(m_prev[i] - m_safe[i], fastmath=True) * sig_prev * inv
            ell = row_sum[i]
            if first_blk:
                ell = 0.0
            row_sum[i] = g * ell + sums[i] * inv
            row_max[i] = m_new[i]
            sigma_p[i] = sig_cur
            gamma[i] = g

    @staticmethod
    def _tree(vals, op):
        """op over vals as a balanced tree (depth log2 n instead of an n-deep chain)."""
        vals = list(vals)
        while len(vals) > 1:
            nxt = [op(vals[k], vals[k + 1]) for k in range(0, len(vals) - 1, 2)]
            if len(vals) % 2:
                nxt.append(vals[-1])
            vals = nxt
        return vals[0]

    @cute.jit
    def rescale_add(self, acc_mn, blk_mn, gamma):
        """o = γ·o + (this block's P·V), in fp32 on the CUDA cores."""
        for i in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                acc_mn[i, j] = acc_mn[i, j] * gamma[i] + blk_mn[i, j]

    @cute.jit
    def epilogue(
        self, pv_mma_rs, acc_o_mn, row_max, sigma_p, row_sum, m_out, m_lse, m_o_partial, m_lse_partial,
        m_tile, req, split_row, n_splits, any_blocks, wg, wg_tidx, kv_addr,
    ):
        """This WG's 256 output columns, normalized by ℓ: bf16 into ``out`` (an unsplit
        request) or fp32 into its split's partial row; and the LSE."""
        cfg = self.cfg
        # this thread's coordinates from a laundered index: derived from the thread index
        # before the block loop, ptxas kept (and, in causal variants, spilled) them
        wg_tidx = ptx.launder(wg_tidx, req)
        pv_n = cfg.pv_n
        c_o = pv_mma_rs.get_slice(wg_tidx).partition_C(cute.make_identity_tensor((L.M_TILE, pv_n)))
        c_o_mn = cute.make_tensor(c_o.iterator, self._layout_acc_mn(pv_mma_rs, c_o.layout))
        rows_per_thr = cute.size(c_o_mn, mode=[0])
        inv = cute.make_rmem_tensor((rows_per_thr,), Float32)
        for i in cutlass.range_constexpr(rows_per_thr):
            row = m_tile * L.M_TILE + c_o_mn[i, 0][0]
            ell = row_sum[i]
            if not any_blocks:
                ell = 0.0
            inv[i] = Float32(0.0)
            lse = -Float32.inf
            if ell > 0.0:
                inv[i] = Float32(1.0) / ell
                lse = (row_max[i] + cute.math.log2(sigma_p[i] * ell, fastmath=False)) * Float32(LN2)
            # a split's LSE is written by both WGs (the same value); the CTA counts its
            # split only after both WGs' writes (finish_split)
            if row < cfg.rows and wg_tidx % 4 == 0:
                if n_splits == 1:
                    if wg == 0:
                        m_lse[req, row % cfg.heads, row // cfg.heads] = lse
                else:
                    m_lse_partial[row, split_row] = lse
        warp = wg * (roles.THREADS_PER_WG // 32) + wg_tidx // 32
        buf = kv_addr + self.kv_smem_bytes + warp * EPI_BYTES  # storage.epi (checked at launch)
        if n_splits == 1:
            self.store_tile(acc_o_mn, c_o_mn, inv, m_out, req, BFloat16, m_tile, wg, wg_tidx, buf)
        else:
            self.store_tile(acc_o_mn, c_o_mn, inv, m_o_partial, split_row, Float32, m_tile, wg, wg_tidx, buf)

    @cute.jit
    def store_tile(self, acc_o_mn, c_o_mn, inv, m_dst, idx, dtype: cutlass.Constexpr, m_tile, wg, wg_tidx, buf):
        """o·inv (per row) as ``dtype`` into ``m_dst[row, wg's columns, idx]`` through a
        1 KB shared buffer per warp (8 rows x 128 bytes): a warp's accumulator holds 16
        rows, 8 per pass (lane // 4, plus 8 in the second). Pairs of columns go to shared
        memory (16-byte units XOR-swizzled by row: no bank conflicts either way) and leave
        as 16-byte stores covering whole 128-byte lines. Stored straight from the
        accumulator, a warp's store touches 8 rows' lines for 8 (4) bytes a lane, and the
        per-line cost of the store path made the tile's writes the tail of a short split."""
        cfg = self.cfg
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
        for h in cutlass.range_constexpr(cfg.pv_splits):
            for ch in cutlass.range_constexpr(pv_n // chunk_cols):
                col0 = (wg * cfg.pv_splits + h) * pv_n + ch * chunk_cols
                for i in cutlass.range_constexpr(cute.size(c_o_mn, mode=[0])):
                    for j in cutlass.range_constexpr(ch * vals, (ch + 1) * vals, 2):
                        lr = c_o_mn[i, j][0] % EPI_ROWS
                        lc = c_o_mn[i, j][1] - ch * chunk_cols
                        sc = ((lc // per_unit) ^ lr) * per_unit + lc % per_unit
                        pair = cute.make_rmem_tensor((2,), dtype)
                        pair[0] = (acc_o_mn[h][i, j] * inv[i]).to(dtype)
                        pair[1] = (acc_o_mn[h][i, j + 1] * inv[i]).to(dtype)
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
                        if row0 + lr < cfg.rows and not cutlass.const_expr("store" in cfg.skip):
                            cute.autovec_copy(
                                v, cute.local_tile(m_dst[row0 + lr, None, idx], (per_unit,), (col0 // per_unit + u,))
                            )
                    cute.arch.sync_warp()

    @cute.jit
    def finish_split(
        self, m_out, m_lse, m_o_partial, m_lse_partial, m_counters, kv_addr, m_tile, req, first, split,
        n_splits, n_mergers, ctid, is_split: cutlass.Constexpr,
    ):
        """Split-KV merge without a second kernel (the launch is cooperative, so every
        part's CTA is resident). Each split counts itself once its partial result is
        written. Splits 0..n-2 process the request last in their part; they, and the idle
        parts the plan sends to help (``is_split`` False; ``split`` is then the merger
        index), wait for the count and merge a share of its rows each (the last split
        processes it first in its part and goes on): lse = max + log Σ exp(lse_s - max),
        out = Σ exp(lse_s - lse)·O_s. ``n_mergers`` share the rows; ``ctid``: 0..255 over
        both consumer WGs. The last merger resets the counters."""
        cfg = self.cfg
        ctid = ptx.launder(ctid, req)  # its index math is not hoisted into the block loop (spills)
        pair = pipeline.NamedBarrier(barrier_id=roles.BARRIERS.pair_sync, num_threads=roles.PAIR_THREADS)
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
                self.stamp("count_seen")
            pair.arrive_and_wait()
            n_p = n_mergers
            r0 = split * L.M_TILE // n_p
            r1 = (split + 1) * L.M_TILE // n_p
            r1 = cutlass.min(r1, cfg.rows - m_tile * L.M_TILE)
            nrows = r1 - r0
            # the KV stages are idle now (this is the part's last request): scratch
            s_lse = cute.make_tensor(cute.make_ptr(Float32, kv_addr, cute.AddressSpace.smem, assumed_align=16), cute.make_layout((L.M_TILE,)))
            # 1. final LSE of each row of the share, a warp per row and a lane per split (all
            # of a row's loads in flight at once); the splits' weights exp(lse_s - lse) go to
            # shared memory for step 2, so its loads do not wait on an exp
            s_w = cute.make_tensor(
                cute.make_ptr(Float32, kv_addr + MERGE_W_OFFSET, cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((L.M_TILE, MERGE_MAX_SPLITS), stride=(MERGE_MAX_SPLITS, 1)),
            )
            warp = ctid // 32
            lane = ctid % 32
            for lr in cutlass.range(warp, nrows, roles.PAIR_THREADS // 32, unroll=1):
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
            if n_items * 2 <= roles.PAIR_THREADS:
                G = 2
            if n_items * 4 <= roles.PAIR_THREADS:
                G = 4
            if n_items * 8 <= roles.PAIR_THREADS:
                G = 8
            per_g = roles.PAIR_THREADS // G
            g = ctid // per_g
            s_acc = cute.make_tensor(
                cute.make_ptr(Float32, kv_addr + 1024, cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((8, roles.PAIR_THREADS), stride=(1, 8)),
            )
            for it in cutlass.range(ctid % per_g, n_items, per_g, unroll=1):
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
                self.stamp("merged")
                old = cute.arch.atomic_add(done_ptr, Int32(1), sem="acq_rel", scope="gpu")
                if old == n_p - 1:
                    m_counters[req, 2 * m_tile] = 0
                    m_counters[req, 2 * m_tile + 1] = 0
