"""Role: the transposer warpgroup rewrites each KV block's content as Vᵀ in place.

Once a block's owner has read it as K (its QK waited: ``TransposerHandshake.k_read``), the
transposer (40 registers) turns the K-major SW128 content tile
(64 tokens x 512 dims) into the K-major SW64 Vᵀ tile (512 dims x 64 tokens, tokens in the
order π) over the same bytes, 8 KiB chunk by chunk: ``ldmatrix.trans`` → ``prmt`` →
``stmatrix``, one warpgroup barrier per chunk between its loads and its stores, both sides
bank-conflict free (``layouts.transpose`` holds the lane maps, their step constants and a
byte-exact CPU replay). Tokens past the sequence are zeroed, so NaN in unused cache slots
never reaches the PV GEMM. (The layout without a transposer warpgroup, each consumer
transposing its own blocks, and the natural token order are at cc70d70.)
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Uint32

from snapmla_cute import ptx
from snapmla_cute.format import CONTENT_DIM
from snapmla_cute.kernels.decode.config import DecodeConfig
from snapmla_cute.kernels.decode.plan import PartWork
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.layouts import smem as L
from snapmla_cute.layouts import transpose as T
from snapmla_cute.pipelines import roles
from snapmla_cute.pipelines.handshakes import TransposerHandshake
from snapmla_cute.ptx import ldsm_x4_trans, stsm_x4


@dataclass(frozen=True)
class Transposer:
    """The transposer role (``transpose_blocks``) and the in-place V transposition itself
    (``transpose_block``)."""

    cfg: DecodeConfig
    tracer: Tracer

    @cute.jit
    def transpose_blocks(self, work: PartWork, kv_addr: Int32, handshake: TransposerHandshake, wg_tidx: Int32):
        """Transposer WG: the part's KV blocks in order, each once its owner's QK has read K:
        content → Vᵀ in place, tokens past the sequence zeroed, then ``vt_ready``. One loop
        over the part's block count, so the 40-register budget holds without spills."""
        sync = pipeline.NamedBarrier(barrier_id=int(roles.Barrier.TRANSPOSER_SYNC), num_threads=roles.THREADS_PER_WG)
        total = work.total_blocks()
        for g in cutlass.range(total, unroll=1):
            stage = handshake.ring.stage_of(g)
            handshake.wait_k_read(stage, g)
            valid = handshake.valid_tokens(stage)
            tid = ptx.launder(wg_tidx, g)  # lane addresses recomputed per block, not spilled
            if cutlass.const_expr("transpose" not in self.cfg.skip):
                self.transpose_block(kv_addr, stage, valid, sync, tid)
            handshake.vt_ready(stage)  # stmatrix, then WGMMA reads

    @cute.jit
    def transpose_block(self, kv_addr: Int32, stage: Int32, valid: Int32, sync: pipeline.NamedBarrier, wg_tidx: Int32):
        """``transpose_v`` of one block: the masking code only when some of its 64 tokens
        are past the sequence."""
        if valid >= L.BLOCK_N:
            self.transpose_v(kv_addr, stage, valid, sync, wg_tidx, False)
        else:
            self.transpose_v(kv_addr, stage, valid, sync, wg_tidx, True)

    @cute.jit
    def keep_bytes(self, n: Int32) -> Uint32:
        """Mask of the low ``n`` bytes of a word (n clamped to 0..4): a word of 4 tokens
        of which ``n`` are inside the sequence."""
        keep = Uint32(0xFFFFFFFF)
        if n < 4:
            keep = Uint32(0)
            if n > 0:
                keep = (Uint32(1) << (8 * n)) - Uint32(1)
        return keep

    @cute.jit
    def transpose_v(self, kv_addr: Int32, stage: Int32, valid_tokens: Int32, sync: pipeline.NamedBarrier, wg_tidx: Int32,
                    masked: cutlass.Constexpr):
        """Content tile → Vᵀ in place with ldmatrix.trans → prmt → stmatrix; ``masked`` (a
        request's last block) zeroes tokens ≥ valid (``layouts.transpose``). One warpgroup
        barrier per 8 KiB chunk, between its loads and its stores."""
        warp = wg_tidx // 32
        lane = wg_tidx % 32
        base = kv_addr + stage * (L.BLOCK_N * CONTENT_DIM)
        src0 = T.ldsm_src(warp, lane, 0, True)
        dst0 = base + T.stsm_dst(warp, lane, 0)
        q = lane & 3
        # The selectors and keep masks below are ``T.prmt_selectors`` and
        # ``T.ldsm_keep_masks`` (same constants), written twice: the lane-dependent choices
        # are run-time branches, which only a @cute.jit body may take on a DSL value, and the
        # CPU replay needs them on Python ints. The GPU tests check this copy at every block
        # edge, the CPU tests the replay byte for byte.
        sel_even = Int32(T.SEL_WORDS[0])
        sel_odd = Int32(T.SEL_WORDS[1])
        sel0 = sel_even
        sel1 = sel_odd
        if lane >= 16:  # c = lane / 4 >= 4: the two words swap dims
            sel0 = sel_odd
            sel1 = sel_even
        keep_lo = Uint32(0xFFFFFFFF)
        keep_hi = Uint32(0xFFFFFFFF)
        if cutlass.const_expr(masked):
            # words of tokens t0, t0+1, t0+8, t0+9 (``layouts.transpose.ldsm_keep_masks``):
            # the low two bytes of two 4-token masks
            first = (warp % 2) * 32 + 2 * q
            pair = Uint32(0xFFFF)

            def keep_pairs(t0):
                return (self.keep_bytes(valid_tokens - t0) & pair) | (
                    (self.keep_bytes(valid_tokens - t0 - 8) & pair) << 16)

            keep_lo = keep_pairs(first)
            keep_hi = keep_pairs(first + 16)
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
