"""Role: the two consumer warpgroups — QK, softmax, P hand-off and PV, block by block.

Within a request the consumer WGs own alternate 64-token blocks (App. C Algorithm 1) and
each owns 256 of the 512 output dims. For its block j a consumer waits for its QK (issued
two blocks earlier), signals the transposer that K is read, waits for the other WG's
softmax state of block j-1, runs the softmax of block j, publishes P_j and its state, then
runs its half of PV for block j-1 (P from shared memory) and block j (P from registers)
once Vᵀ of j is written, and issues QK of block j+2. The chain between the WGs is softmax
→ state → softmax; QK and PV of one WG overlap the other's softmax. Every block's P·V lands
in a zeroed temporary and o = γ·o + P·V is done in fp32 (``config.PV_SPLITS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import warpgroup

from snapmla_cute.kernels.decode.args import ConsumerSync, DecodeInputs, DecodeMmas, RequestEnd
from snapmla_cute.kernels.decode.config import FP8, PV_SPLITS, PV_TEMPS, DecodeConfig
from snapmla_cute.kernels.decode.epilogue import Epilogue
from snapmla_cute.kernels.decode.merge import Merger
from snapmla_cute.kernels.decode.plan import PartWork
from snapmla_cute.kernels.decode.softmax import OnlineSoftmax
from snapmla_cute.kernels.decode.storage import SmemTensors
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.layouts import mma as M
from snapmla_cute.layouts import p_permute as PP
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles
from snapmla_cute.ptx import stsm_x4


@dataclass(frozen=True)
class ConsumerTiles:
    """A consumer thread's MMA partitions and register fragments (built once per CTA).
    Accumulate modes are set in ``make``, once: set() inside a staged branch would rebind
    the MMA's state in that region (the DSL's dominance rule). Frozen: passed unchanged
    through the block loop."""

    mmas: DecodeMmas
    t_q: cute.Tensor  # Q content, A operand (shared; with ``q_split`` hi, then lo: stages 0, 1)
    t_k: cute.Tensor  # K content per stage, B operand (shared)
    t_qr: cute.Tensor  # Q RoPE, A operand (shared)
    t_kr: cute.Tensor  # K RoPE per stage, B operand (shared)
    t_v: list  # per PV split: Vᵀ per stage, B operand (shared)
    t_p: cute.Tensor  # P per slot, A operand (shared: the other WG's P)
    p_addr: Int32  # the P slots' shared address (stmatrix)
    acc_o: list  # per PV split: O accumulator
    acc_o_mn: list  # the same as (row, column)
    temps: list  # PV temporaries (each block's P·V)
    temps_mn: list
    acc_s: cute.Tensor  # S, aliased into temps[0]
    acc_s_mn: cute.Tensor
    c_s_mn: cute.Tensor  # S's (row, column) coordinates per register
    rows_per_thr: int

    @classmethod
    def make(cls, cfg: DecodeConfig, mmas: DecodeMmas, smem: SmemTensors, wg: Int32, wg_tidx: Int32):
        pv_n = cfg.pv_n
        for mma in (mmas.qk, mmas.qk_rope, mmas.pv_rs, mmas.pv_ss):
            mma.set(warpgroup.Field.ACCUMULATE, True)
        for mma in (mmas.qk0, mmas.pv0, mmas.pv_rs0):
            mma.set(warpgroup.Field.ACCUMULATE, False)
        qk_thr = mmas.qk.get_slice(wg_tidx)
        qkr_thr = mmas.qk_rope.get_slice(wg_tidx)
        pv_rs_thr = mmas.pv_rs.get_slice(wg_tidx)
        pv_ss_thr = mmas.pv_ss.get_slice(wg_tidx)

        t_q = qk_thr.make_fragment_A(qk_thr.partition_A(smem.q_nope))
        t_k = qk_thr.make_fragment_B(qk_thr.partition_B(smem.kv))
        t_qr = qkr_thr.make_fragment_A(qkr_thr.partition_A(smem.q_rope))
        t_kr = qkr_thr.make_fragment_B(qkr_thr.partition_B(smem.kr))
        s_vt_parts = cute.flat_divide(smem.vt, (pv_n, L.BLOCK_N))  # (pv_n, 64, 512/pv_n, 1, stages)
        t_v = [
            pv_ss_thr.make_fragment_B(pv_ss_thr.partition_B(cute.slice_(s_vt_parts, (None, None, wg * PV_SPLITS + h, 0, None))))
            for h in range(PV_SPLITS)
        ]
        t_p = pv_ss_thr.make_fragment_A(pv_ss_thr.partition_A(smem.p))
        p_addr = smem.p.iterator.toint()  # (stmatrix)

        acc_o = [pv_rs_thr.make_fragment_C(pv_rs_thr.partition_shape_C((L.M_TILE, pv_n))) for _ in range(PV_SPLITS)]
        acc_o_mn = [cute.make_tensor(a.iterator, M.acc_mn_layout(mmas.pv_rs, a.layout)) for a in acc_o]
        temps = [pv_rs_thr.make_fragment_C(pv_rs_thr.partition_shape_C((L.M_TILE, pv_n))) for _ in range(PV_TEMPS)]
        temps_mn = [cute.make_tensor(t.iterator, M.acc_mn_layout(mmas.pv_rs, t.layout)) for t in temps]
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((L.M_TILE, L.BLOCK_N)))
        # S and the first PV temporary are never live together (QK(j+2) is issued after this
        # block's PV), so S borrows its registers (else ptxas keeps both and spills ~500 B)
        assert cute.size(temps[0]) >= cute.size(acc_s)
        acc_s = cute.make_tensor(temps[0].iterator, acc_s.layout)
        acc_s_mn = cute.make_tensor(acc_s.iterator, M.acc_mn_layout(mmas.qk, acc_s.layout))
        c_s = qk_thr.partition_C(cute.make_identity_tensor((L.M_TILE, L.BLOCK_N)))
        c_s_mn = cute.make_tensor(c_s.iterator, M.acc_mn_layout(mmas.qk, c_s.layout))
        rows_per_thr = cute.size(c_s_mn, mode=[0])
        return cls(
            mmas, t_q, t_k, t_qr, t_kr, t_v, t_p, p_addr, acc_o, acc_o_mn, temps, temps_mn, acc_s,
            acc_s_mn, c_s_mn, rows_per_thr,
        )


@dataclass(frozen=True)
class Segment:
    """One request segment of the part, as a consumer walks it: the r-th, request ``req`` of
    length ``seqlen``, ``n`` blocks from ``blk_lo``; ``k0`` blocks of the part before it;
    ``first``: this WG's first owned block (blocks alternate owners across requests)."""

    r: Int32
    req: Int32
    seqlen: Int32
    blk_lo: Int32
    n: Int32
    k0: Int32
    first: Int32


@dataclass(frozen=True)
class Consumer:
    """The consumer role (two warpgroups under ``layout``'s register budget). It reads Q and
    the KV ring through ``smem`` with the ``mmas``, waits and signals through ``sync``,
    scales logits by ``inputs.q_scale`` and ``scale_log2`` (``visible``: a causal shard's
    key counts, or None), and ends each request with the ``epilogue`` and, when split, the
    ``merger``."""

    cfg: DecodeConfig
    layout: roles.Layout
    tracer: Tracer
    mmas: DecodeMmas
    smem: SmemTensors
    sync: ConsumerSync
    inputs: DecodeInputs
    scale_log2: Float32
    visible: cute.Tensor
    epilogue: Epilogue
    merger: Merger

    @cute.jit
    def run(self, m_tile: Int32, wg_idx: Int32, kv_addr: Int32):
        """Consumer WGs: raise the register budget, read the plan, run ``consume``.
        ``kv_addr``: the KV stages' shared address (``SmemTensors.kv_addr``)."""
        cute.arch.setmaxregister_increase(self.layout.consumer_regs)
        # read after setmaxnreg: values live across it would be spilled to local memory
        work = PartWork.read(self.smem.plan, self.inputs.seqlens)
        self.consume(work, m_tile, wg_idx - self.layout.first_consumer_wg, kv_addr)

    @cute.jit
    def consume(self, work: PartWork, m_tile: Int32, wg: Int32, kv_addr: Int32):
        """Consumer WG ``wg`` over the part's request segments: per request the owned blocks
        (``consume_block``), the other WG's last block, the epilogue and, for a split
        request, the merge; then an idle part's merge share."""
        cfg = self.cfg
        mmas, smem = self.mmas, self.smem
        ring, q_cons = self.sync.ring, self.sync.q_pipe
        tidx, _, _ = cute.arch.thread_idx()
        wg_tidx = tidx % roles.THREADS_PER_WG
        tiles = ConsumerTiles.make(cfg, mmas, smem, wg, wg_tidx)
        wg_sync = pipeline.NamedBarrier(barrier_id=int(roles.Barrier.WG_SYNC) + wg, num_threads=roles.THREADS_PER_WG)
        softmax = OnlineSoftmax.create(cfg, tiles.rows_per_thr)

        k_global = Int32(0)
        for r in cutlass.range(work.n_reqs, unroll=1):
            req = work.begin_req + r
            seqlen, blk_lo, blk_hi = work.block_range(r, req)
            n = blk_hi - blk_lo
            k0 = k_global
            softmax.start_request(tiles.c_s_mn, self.inputs.q_scale, m_tile, req, seqlen, self.scale_log2, self.visible)
            for h in cutlass.range_constexpr(PV_SPLITS):
                tiles.acc_o[h].fill(0.0)
            hq = q_cons.wait_and_advance()
            if r == 0 and wg_tidx == 0:
                self.tracer.stamp("q_arrived", wg)
            first = (wg + k0) & 1  # my first block in this request (blocks alternate owners)
            if first < n:
                ring.wait(k0 + first)
                if cutlass.const_expr(cfg.issue_qk_early):
                    self.issue_qk(tiles, ring.stage_of(k0 + first))
            seg = Segment(r, req, seqlen, blk_lo, n, k0, first)
            for j in cutlass.range(first, n, 2, unroll=1):
                self.consume_block(tiles, softmax, seg, j, wg, wg_tidx)
            self.finish_blocks(tiles, softmax, seg, wg_sync, wg)
            k_global = k0 + n
            hq.release()
            if r == 0 and wg_tidx == 0:
                self.tracer.stamp("pv_done", wg)
            first, n_splits, split = work.split_rows(r, req)
            end = RequestEnd(tiles.acc_o_mn, (softmax.row_max, softmax.sigma_p, softmax.row_sum), n > 0, m_tile, req,
                             wg, wg_tidx, kv_addr)
            if cutlass.const_expr(cfg.cluster > 1):
                if work.clustered():
                    self.epilogue.cluster_epilogue(end, smem.cl_mbar_addr())
                else:
                    self.epilogue.epilogue(end, first + split, n_splits, smem.storage.amax.data_ptr().toint())
            else:
                self.epilogue.epilogue(end, first + split, n_splits, smem.storage.amax.data_ptr().toint())
            if r == 0 and wg_tidx == 0:
                self.tracer.stamp("epilogue_done", wg)
            if n_splits > 1:
                # finish_split's first pair barrier also orders the f16 epilogue's s_amax reads
                # before the next split's writes (Epilogue.epilogue has no barrier of its own)
                n_mergers = self.merger.merger_count(n_splits, work.helpers(), req, cute.size(work.m_seqlens))
                self.merger.finish_split(
                    kv_addr, m_tile, req, first, split, n_splits, n_mergers,
                    tidx - self.layout.first_consumer_wg * roles.THREADS_PER_WG, True,
                )
        if work.helper_request() >= 0:
            # an idle part: merge a share of a split request's rows (plan)
            self.merger.finish_split(
                kv_addr, m_tile, *work.helper_share(), tidx - self.layout.first_consumer_wg * roles.THREADS_PER_WG,
                False,
            )
        if wg_tidx == 0:
            self.tracer.stamp("exit", wg)

    @cute.jit
    def consume_block(self, tiles: ConsumerTiles, softmax: OnlineSoftmax, seg: Segment, j: Int32, wg: Int32,
                      wg_tidx: Int32):
        """This WG's owned block j of the segment ``seg``, its QK issued two blocks earlier."""
        cfg = self.cfg
        smem = self.smem
        ring, handshake, exchange = self.sync.ring, self.sync.handshake, self.sync.exchange
        r = seg.r
        g = seg.k0 + j
        stage = ring.stage_of(g)
        slot = g & 1
        blk = seg.blk_lo + j
        if cutlass.const_expr(not cfg.issue_qk_early):
            self.issue_qk(tiles, stage)
        warpgroup.wait_group(0)
        # σ_k of this thread's columns, loaded before the state wait (in the softmax the
        # loads' latency was on the chain); after the QK wait, so these 16 registers are
        # not live beside the QK in flight
        ks_pre = cute.make_rmem_tensor((cute.size(tiles.c_s_mn, mode=[1]),), Float32)
        for jj in cutlass.range_constexpr(cute.size(tiles.c_s_mn, mode=[1])):
            c = tiles.c_s_mn[0, jj][1]
            ks_pre[jj] = smem.ks[c % cfg.scale_box, c // cfg.scale_box, stage]
        if r == 0 and j == seg.first and wg_tidx == 0:
            self.tracer.stamp("qk_done", wg)
        valid = seg.seqlen - blk * L.BLOCK_N
        handshake.k_read(stage, valid, wg_tidx)  # the transposer may go
        # ---- the other WG's state of block j-1. Every block but a request's last is whole
        # (all 64 tokens valid, and visible to every row): no masking code there.
        if j >= 1:
            exchange.wait_state(1 - slot, tiles.c_s_mn, softmax.other_state())
        else:
            # defined on every path: the state is not carried across iterations (it is
            # re-read from the exchange, the WG's own at the end), so its registers are
            # free outside the softmax
            softmax.reset()
        # ---- softmax with V-scale fusion and block-wise P quantization
        if cutlass.const_expr("softmax" not in cfg.skip):
            if valid - (cfg.s_q - 1 if cfg.causal else 0) >= L.BLOCK_N:
                softmax.step(tiles.acc_s_mn, tiles.c_s_mn, ks_pre, blk, valid, j == 0, False)
            else:
                softmax.step(tiles.acc_s_mn, tiles.c_s_mn, ks_pre, blk, valid, j == 0, True)
        else:
            softmax.stand_in()
        t_p = self.acc_to_fp8_operand(tiles.acc_s, tiles.mmas.pv_rs.tv_layout_A)
        if r == 0 and j == seg.first and wg_tidx == 0:
            self.tracer.stamp("softmax_done", wg)
        # ---- publish P and the softmax state
        if g >= 2:
            exchange.wait_p_free(slot)
        self.publish_p(tiles, t_p, slot, wg_tidx)
        exchange.write_state(slot, tiles.c_s_mn, softmax.own_state(), wg_tidx)
        cute.arch.fence_proxy("async.shared", space="cta")
        # each thread releases its own P and state to the other WG; this WG's own warps meet
        # only before reading their last state back (``finish_blocks``)
        exchange.signal_state(slot)
        # ---- PV of block j-1 (P from the other WG), then of block j (own P from registers)
        # the transposer finishes blocks in order, each thread arriving after its stores and
        # fence: Vᵀ of g ready means Vᵀ of g-1 too
        handshake.wait_vt(g)
        if j >= 1:
            if cutlass.const_expr("pv" not in cfg.skip):
                self.pv_blocks(
                    tiles, [(ring.stage_of(g - 1), softmax.gamma_o, 1 - slot, None), (stage, softmax.gamma, slot, t_p)]
                )
            exchange.free_p(1 - slot)
            ring.release(g - 1)
        else:
            if cutlass.const_expr("pv" not in cfg.skip):
                self.pv_blocks(tiles, [(stage, softmax.gamma, slot, t_p)])
        ring.release(g)
        # ---- next owned block: its QK runs while this WG waits for the other's state
        if j + 2 < seg.n:
            ring.wait(g + 2)
            if cutlass.const_expr(cfg.issue_qk_early):
                self.issue_qk(tiles, ring.stage_of(g + 2))

    @cute.jit
    def finish_blocks(self, tiles: ConsumerTiles, softmax: OnlineSoftmax, seg: Segment, wg_sync: pipeline.NamedBarrier,
                      wg: Int32):
        """After the owned blocks: the request's final state, and PV of the other WG's last
        block when it comes after this WG's last one."""
        ring, handshake, exchange = self.sync.ring, self.sync.handshake, self.sync.exchange
        warpgroup.wait_group(0)  # nothing is in flight here; tells ptxas acc_s is free
        n = seg.n
        k0 = seg.k0
        if n >= 1 and (k0 + n - 1) & 1 == wg:
            # this WG's last softmax state, as it published it (visible to its own warps
            # after this barrier)
            wg_sync.arrive_and_wait()
            exchange.read_state(wg, tiles.c_s_mn, softmax.other_state())
        if n >= 1 and (k0 + n - 1) & 1 != wg:
            g = k0 + n - 1
            slot = g & 1
            exchange.wait_state(slot, tiles.c_s_mn, softmax.other_state())
            handshake.wait_vt(g)
            self.pv_blocks(tiles, [(ring.stage_of(g), softmax.gamma_o, slot, None)])
            exchange.free_p(slot)
            ring.release(g)

    @cute.jit
    def issue_qk(self, tiles: ConsumerTiles, stage: Int32):
        """QK of one block, asynchronously: 16 e4m3 k-steps (with ``q_split`` 16 more with
        Q's residual codes) then 4 bf16 RoPE k-steps chained on one accumulator (Eq. 6). The
        tensor core's truncating adder is part of the spec (``tensor_core.tensor_core_mma``),
        so no promotion waits are needed."""
        m = tiles.mmas
        warpgroup.fence()
        if cutlass.const_expr("qk" not in self.cfg.skip):
            n_kb = cute.size(tiles.t_q, mode=[2])
            if cutlass.const_expr(self.cfg.q_split):
                # per k-step hi then lo: one K descriptor for both (the emulation's order)
                for i in cutlass.range_constexpr(2 * n_kb):
                    cute.gemm(m.qk0 if i == 0 else m.qk, tiles.acc_s, tiles.t_q[None, None, i // 2, i % 2],
                              tiles.t_k[None, None, i // 2, stage], tiles.acc_s)
            else:
                for kb in cutlass.range_constexpr(n_kb):
                    cute.gemm(m.qk0 if kb == 0 else m.qk, tiles.acc_s, tiles.t_q[None, None, kb, 0],
                              tiles.t_k[None, None, kb, stage], tiles.acc_s)
            for kb in cutlass.range_constexpr(cute.size(tiles.t_qr, mode=[2])):
                cute.gemm(m.qk_rope, tiles.acc_s, tiles.t_qr[None, None, kb, 0], tiles.t_kr[None, None, kb, stage],
                          tiles.acc_s)
        warpgroup.commit_group()

    @cute.jit
    def pv_blocks(self, tiles: ConsumerTiles, blocks: list):
        """This WG's 256 output dims of one or two blocks' P·V, in block order (order
        enforcement): each N = 64 GEMM lands in a zeroed temporary and o = γ·o + P·V is done
        in fp32. With two temporaries the next GEMM is issued before the previous one is
        waited for and added. ``blocks``: [(stage, γ, P slot, P registers or None), ...]: a
        block with P registers (this WG's own) runs as RS WGMMAs, the others read P from
        shared memory."""
        m = tiles.mmas
        temps = tiles.temps
        work = [(st, g, sl, regs, h) for st, g, sl, regs in blocks for h in range(PV_SPLITS)]
        n_t = len(temps)
        for w in cutlass.range_constexpr(len(work) + n_t - 1):
            if cutlass.const_expr(w < len(work)):
                st, _, sl, regs, h = work[w]
                acc = temps[w % n_t]
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tiles.t_p, mode=[2])):
                    if cutlass.const_expr(regs is not None):
                        mma = m.pv_rs0 if kb == 0 else m.pv_rs
                        cute.gemm(mma, acc, regs[None, None, kb], tiles.t_v[h][None, None, kb, st], acc)
                    else:
                        mma = m.pv0 if kb == 0 else m.pv_ss
                        cute.gemm(mma, acc, tiles.t_p[None, None, kb, sl], tiles.t_v[h][None, None, kb, st], acc)
                warpgroup.commit_group()
            d = w - (n_t - 1)  # the GEMM to finish now
            if cutlass.const_expr(d >= 0):
                warpgroup.wait_group(min(n_t - 1, len(work) - 1 - d))
                _, g, _, _, h = work[d]
                self.rescale_add(tiles.acc_o_mn[h], tiles.temps_mn[d % n_t], g)

    @cute.jit
    def rescale_add(self, acc_mn, blk_mn, gamma):
        """o = γ·o + (this block's P·V), in fp32 on the CUDA cores."""
        for i in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                acc_mn[i, j] = acc_mn[i, j] * gamma[i] + blk_mn[i, j]

    @cute.jit
    def publish_p(self, tiles: ConsumerTiles, t_p: cute.Tensor, slot: Int32, wg_tidx: Int32):
        """P of this WG's block into ``sP[slot]`` for the other WG's PV: two stmatrix.x4 per
        thread (the A-fragment words are exactly stmatrix's: rows r / r+8 x 16-byte k-halves;
        ``layouts.smem.p_stsm_offset``)."""
        words = cute.recast_tensor(t_p, Uint32)
        for kb in cutlass.range_constexpr(cute.size(words, mode=[2])):
            off = L.p_stsm_offset(wg_tidx // 32, wg_tidx % 32, kb)
            addr = tiles.p_addr + slot * (L.M_TILE * L.BLOCK_N) + off
            stsm_x4(addr, *[Int32(words[i, 0, kb]) for i in range(4)])

    @cute.jit
    def acc_to_fp8_operand(self, acc: cute.Tensor, operand_layout_tv):
        """fp32 P accumulator → e4m3 A-operand registers: cvt, then one prmt per word inside
        the lane (K position k then holds column π(k), as Vᵀ does;
        ``layouts.p_permute.pi_packed_labels``). The natural token order, P permuted across
        each quad with shuffles (CUTLASS's ``make_acc_into_op``), is at cc70d70."""
        operand = cute.make_rmem_tensor_like(M.c_to_a_layout(acc.layout, operand_layout_tv.shape[1]), FP8)
        operand_as_acc = cute.make_tensor(operand.iterator, acc.layout)
        operand_as_acc.store(acc.load().to(FP8))
        values = cute.recast_tensor(operand, Uint32)
        for n in cutlass.range_constexpr(cute.size(values, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(values, mode=[2])):
                for ii in cutlass.range_constexpr(0, 4, 2):
                    # the same function the CPU tests run on byte labels
                    values[ii, n, k], values[ii + 1, n, k] = PP.pi_pack(
                        values[ii, n, k], values[ii + 1, n, k], cute.arch.prmt)
        return operand
