"""The decode kernel class: compile-time choices, the launch, and the wiring of the roles.

One CTA computes one 64-row query tile (rows = s_q·h packed, row r = i·h + head) over the KV
blocks of its split-KV part, with four warpgroups (``pipelines.roles``): the producer
(``producer``), the transposer (``transposer``) and two consumers (``consumer``, with
``softmax``, ``epilogue`` and ``merge``); every thread first plans its part (``plan``).
The launch is cooperative (the in-kernel merge waits for other CTAs) and
programmatic-dependent: each CTA waits for the previous grid's writes before its first
global access, after its launch and prologue. With ``DecodeConfig.cluster`` k > 1 it is in
clusters of k parts, so the cluster plan can merge a request's portions on-chip.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator

from snapmla_cute import ptx
from snapmla_cute.format import CONTENT_DIM, ROPE_DIM
from snapmla_cute.kernels.decode.args import (
    ConsumerSync, DecodeInputs, DecodeMmas, DecodeOutputs, SmemLayouts, TmaLoads,
)
from snapmla_cute.kernels.decode.config import (
    CLUSTER_SIZES, EPI_BUFFER_BYTES, FP8, Q_SPLIT_KV_STAGES, SM90_SMEM_BYTES, DecodeConfig,
)
from snapmla_cute.kernels.decode.consumer import Consumer
from snapmla_cute.kernels.decode.epilogue import Epilogue
from snapmla_cute.kernels.decode.launch import KernelArgs, entry_signature, from_entry
from snapmla_cute.kernels.decode.merge import Merger
from snapmla_cute.kernels.decode.plan import PartWork, Planner
from snapmla_cute.kernels.decode.producer import Producer
from snapmla_cute.kernels.decode.storage import SmemTensors, shared_storage
from snapmla_cute.kernels.decode.trace import Tracer
from snapmla_cute.kernels.decode.transposer import Transposer
from snapmla_cute.kernels.decode_scheduler import DecodeSchedulerKernel
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles
from snapmla_cute.pipelines.handshakes import ClusterExchange, PairExchange, TransposerHandshake
from snapmla_cute.pipelines.kv_ring import KVRing


class DecodeKernel:
    """The decode's compile-time choices (``cfg``), its launch (``__call__``: MMAs, layouts,
    TMA atoms, shared storage) and its wiring (``kernel``: pipelines, views, plan, then each
    warpgroup's role object)."""

    def __init__(self, cfg: DecodeConfig):
        if cfg.sparse and (cfg.page_size != 1 or cfg.causal or cfg.s_q != 1):
            raise ValueError(f"DecodeConfig: sparse needs page_size 1, s_q 1, not causal; got {cfg}")
        if cfg.visible and not cfg.causal:
            raise ValueError(f"DecodeConfig: visible needs causal; got {cfg}")
        if cfg.q_split and cfg.kv_stages > Q_SPLIT_KV_STAGES:
            raise ValueError(f"DecodeConfig: q_split fits at most {Q_SPLIT_KV_STAGES} KV stages beside Q's two "
                             f"content tiles; got {cfg}")
        if cfg.cluster not in CLUSTER_SIZES:
            raise ValueError(f"DecodeConfig: cluster must be one of {CLUSTER_SIZES}; got {cfg}")
        self.cfg = cfg
        self.roles = roles.LAYOUT
        self.threads = self.roles.threads
        self.scheduler = DecodeSchedulerKernel(cfg.scheduler)
        self.n_scale = L.BLOCK_N // cfg.scale_box  # scale slots per block
        self.scale_stride = max(cfg.scale_box, 32)  # floats between slots of scales

    # ------------------------------------------------------------------ host side
    def _call(self, *entry):
        """The compiled entry of the kernel alone (the compile report's ``decode`` variants):
        ``launch.KernelArgs``'s fields and the stream."""
        args, stream = from_entry(KernelArgs, entry)
        self.launch(args, stream)

    _call.__signature__ = entry_signature(KernelArgs)
    __call__ = cute.jit(_call)

    @cute.jit
    def launch(self, args: KernelArgs, stream):
        """MMAs, layouts, TMA atoms and shared storage for ``args`` (``launch.KernelArgs``),
        then the launch: a CTA per (query tile, part)."""
        cfg = self.cfg
        if cutlass.const_expr((args.q_lo is not None) != cfg.q_split):
            raise ValueError(f"decode: q_lo given: {args.q_lo is not None}, but the config says q_split={cfg.q_split}")
        m_q_nope = cute.make_tensor(cute.recast_ptr(args.q_nope.iterator, dtype=FP8), args.q_nope.layout)
        m_kv_content = cute.make_tensor(cute.recast_ptr(args.kv_content.iterator, dtype=FP8), args.kv_content.layout)
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

        q_nope_sl = L.q_nope_layout(2 if cfg.q_split else 1)  # q_split: hi, then lo
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
            cpasync.CopyBulkTensorTileG2SOp(), args.q_rope, cute.slice_(q_rope_sl, (None, None, 0)), (L.M_TILE, ROPE_DIM)
        )
        self.q_bytes = L.M_TILE * CONTENT_DIM + L.M_TILE * ROPE_DIM * 2
        q_lo = None
        if cutlass.const_expr(cfg.q_split):
            m_q_lo = cute.make_tensor(cute.recast_ptr(args.q_lo.iterator, dtype=FP8), args.q_lo.layout)
            tma_q_lo, g_q_lo = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), m_q_lo, cute.slice_(q_nope_sl, (None, None, 0)), (L.M_TILE, CONTENT_DIM)
            )
            q_lo = (tma_q_lo, g_q_lo)
            self.q_bytes += L.M_TILE * CONTENT_DIM
        if cutlass.const_expr(cfg.sparse):
            # the producer gathers the KV rows with cp.async (``Producer.load_sparse``): the
            # cache tensors go as they are, beside Q's atom in the unused atom slots
            tma_kv, g_kv, tma_kr, g_kr, tma_ks, g_ks = (
                tma_q_nope, m_kv_content, tma_q_nope, args.kv_rope, tma_q_nope, args.kv_scale
            )
            self.kv_bytes = 0
        else:
            kv_box_sl = cute.slice_(cute.flat_divide(cute.slice_(kv_sl, (None, None, 0)), (br, CONTENT_DIM)), (None, None, 0, 0))
            kr_box_sl = cute.slice_(cute.flat_divide(cute.slice_(kr_sl, (None, None, 0)), (br, ROPE_DIM)), (None, None, 0, 0))
            tma_kv, g_kv = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_kv_content, kv_box_sl, (br, CONTENT_DIM))
            tma_kr, g_kr = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), args.kv_rope, kr_box_sl, (br, ROPE_DIM))
            tma_ks, g_ks = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), args.kv_scale, cute.make_layout((br,)), (br,)
            )
            self.kv_bytes = L.BLOCK_N * CONTENT_DIM + L.BLOCK_N * ROPE_DIM * 2 + L.BLOCK_N * 4

        SharedStorage = shared_storage(cfg, self.threads, self.scale_stride, self.n_scale, q_nope_sl, q_rope_sl, kv_sl,
                                       kr_sl, p_sl)
        self.shared_storage = SharedStorage
        self.kv_smem_bytes = cute.cosize(kv_sl)
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SM90_SMEM_BYTES):  # else the launch fails
            raise ValueError(f"decode: shared storage {SharedStorage.size_in_bytes()} B, at most {SM90_SMEM_BYTES} B")
        # the epilogue's staging buffers follow the stages; the spread merge, which does not
        # stage its stores, may use them too
        merge_room = self.kv_smem_bytes + (EPI_BUFFER_BYTES if cfg.cluster_merge_spread else 0)
        if cutlass.const_expr(cfg.cluster_recv_bytes[1] > merge_room):
            raise ValueError(f"decode: the cluster merge of {cfg.cluster} needs {cfg.cluster_recv_bytes[1]} B of KV "
                             f"stages, {cfg.kv_stages} stages have {merge_room} B")
        num_parts = args.sched.shape[0]
        # the bundles flatten, in this order, into the kernel's parameters
        self.kernel(
            DecodeMmas(qk_mma, qk_rope_mma, pv_mma_rs, pv_mma_ss, qk_mma0, pv_mma0, pv_mma_rs0),
            TmaLoads((tma_q_nope, g_q_nope), (tma_q_rope, g_q_rope), (tma_kv, g_kv), (tma_kr, g_kr), (tma_ks, g_ks)),
            DecodeInputs(args.q_scale, args.block_table, args.seqlens, args.sched, args.split_offsets),
            DecodeOutputs(args.out, args.lse, args.o_partial, args.lse_partial, args.counters),
            args.scale_log2,
            SmemLayouts(q_nope_sl, q_rope_sl, kv_sl, kr_sl, vt_sl, p_sl),
            args.visible,
            q_lo,
        ).launch(
            grid=[cfg.m_tiles, num_parts, 1],
            block=[self.threads, 1, 1],
            **({"cluster": [1, cfg.cluster, 1]} if cfg.cluster > 1 else {}),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,  # fixes the register pool so ptxas honours setmaxnreg
            cooperative=True,  # every part resident: split requests are merged in-kernel
            use_pdl=True,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mmas: DecodeMmas,
        tma: TmaLoads,
        inputs: DecodeInputs,
        io: DecodeOutputs,
        scale_log2: Float32,
        layouts: SmemLayouts,
        m_visible: cute.Tensor,
        q_lo: tuple,
    ):
        """Wiring only: pipelines, shared-memory views, the plan, then each warpgroup's role."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, part, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // roles.THREADS_PER_WG)

        # profiling stamps (DecodeConfig.trace; no code otherwise), read by the roles
        tracer = Tracer.make(cfg, io.o_partial, inputs.sched, m_tile, part)
        # safe this early: a dependent's griddepcontrol.wait still waits for this whole
        # grid, and it is scheduled only after every CTA of this grid has started
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr("launch" in cfg.skip):
            return  # timing only: the launch of this grid and nothing else
        if tidx == 0:
            tracer.stamp("start")
        if warp_idx == 0:
            # the descriptors' first use is on the critical path of a short part
            for atom in tma.atoms():
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(cfg.q_split):
                cpasync.prefetch_descriptor(q_lo[0])
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
            # sparse: every producer thread arrives when its cp.async copies land
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, roles.THREADS_PER_WG if cfg.sparse else 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=self.kv_bytes, defer_sync=True,
        )
        kv_prod, _ = kv_pipe.make_participants()
        smem = SmemTensors.make(storage, cfg, self.scale_stride, self.n_scale, layouts)
        ring = KVRing(cfg.kv_stages, kv_pipe, cfg.sparse)
        handshake = TransposerHandshake(
            ring, storage.qk_mbar.data_ptr(), storage.vt_mbar.data_ptr(),
            storage.vt_valid.get_tensor(cute.make_layout((cfg.kv_stages,))),
        )
        handshake.init(tidx)
        if cutlass.const_expr(cfg.cluster > 1):
            ClusterExchange.init(storage.cl_mbar.data_ptr(), cfg.cluster, cfg.cluster_rows_per_rank * cfg.cluster, tidx)
        cute.arch.mbarrier_init_fence()
        if tidx == 0:
            # the epilogue derives storage.epi's address from kv's (one register less)
            if storage.epi.data_ptr().toint() != storage.kv.data_ptr().toint() + self.kv_smem_bytes:
                ptx.trap()
        cute.arch.sync_threads()
        if cutlass.const_expr(cfg.cluster > 1):
            # every CTA's barriers are initialized before a peer's first remote arrival: the
            # consumers wait on this (``cluster_epilogue``); the other roles never do
            cute.arch.cluster_arrive_relaxed()
        cute.arch.griddepcontrol_wait()  # the previous grid's writes (lengths, KV, Q, counters)
        # this part's plan, computed here from the lengths (no scheduler launch); the KV
        # stages are its scratch until the producer starts
        planner = Planner(cfg, self.scheduler, self.threads, tracer)
        planner.plan(inputs, storage.kv.data_ptr(), storage.scan.get_tensor(cute.make_layout((self.threads // 32,))),
                     smem.plan, m_tile, part, tidx)
        if tidx == 0:
            tracer.stamp("planned")

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(roles.PRODUCER_REGS)
            producer = Producer(cfg, tracer, tma, smem, q_lo)
            if cutlass.const_expr(cfg.sparse):
                work = PartWork.read(smem.plan, inputs.seqlens)
                producer.load_sparse(inputs.block_table, ring, q_prod, m_tile, work, warp_idx)
            elif warp_idx == 0:
                work = PartWork.read(smem.plan, inputs.seqlens)
                producer.load(inputs.block_table, q_prod, kv_prod, m_tile, work)
        else:
            kv_addr = smem.kv_addr()
            merger = Merger(cfg, tracer, io)
            consumer = Consumer(
                cfg, self.roles, tracer, mmas, smem,
                ConsumerSync(ring, handshake, PairExchange(smem.state), q_cons),
                inputs, scale_log2, m_visible,
                Epilogue(cfg, io, mmas.pv_rs, self.kv_smem_bytes, tracer, merger),
                merger,
            )
            # the consumers' branch comes last: ptxas spilled them at 224 registers when the
            # transposer's 40-register branch followed it
            if wg_idx == self.roles.transposer_wg:
                cute.arch.setmaxregister_decrease(roles.TRANSPOSER_REGS)
                kv_addr_t = smem.kv_addr()
                wg_tidx = tidx % roles.THREADS_PER_WG
                work = PartWork.read(smem.plan, inputs.seqlens)
                Transposer(cfg, tracer).transpose_blocks(work, kv_addr_t, handshake, wg_tidx)
            else:
                consumer.run(m_tile, wg_idx, kv_addr)
