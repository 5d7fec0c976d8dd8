"""The decode CTA's shared memory: the struct (sizes, alignments) and the tensor views over it.

Q (one stage), the KV ring (``kv_stages`` of e4m3 content, bf16 RoPE and fp32 scales; Vᵀ
is written over the content in place), two P slots and two softmax-state slots for the
consumer WGs' exchange, the per-stage handshake mbarriers, the plan, and the epilogue's
per-warp staging buffers (and, in clusters, the cluster merge's two mbarriers). The KV
stages double as the plan's scratch before the producer starts and as the merge's scratch
(or the cluster merge's receive buffer) after the part's last block.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from snapmla_cute.kernels.decode.config import EPI_BUFFER_BYTES, FP8, PLAN_WORDS
from snapmla_cute.layouts import smem as L


def shared_storage(cfg, threads: int, scale_stride: int, n_scale: int, q_nope_sl, q_rope_sl, kv_sl, kr_sl, p_sl):
    """The ``cute.struct`` of one CTA's shared memory for ``cfg``."""
    stages = cfg.kv_stages

    @cute.struct
    class SharedStorage:
        q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
        qk_mbar: cute.struct.MemRange[cutlass.Int64, stages]  # transposer: owner's QK done
        vt_mbar: cute.struct.MemRange[cutlass.Int64, stages]  # transposer: Vᵀ written
        vt_valid: cute.struct.MemRange[Int32, stages]  # transposer: valid tokens of the block
        if cfg.cluster > 1:
            # the cluster merge: peers' stages free, peers' rows arrived (``cluster_epilogue``)
            cl_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        # (row, field, slot), a row's 4 fields contiguous (one 16-byte access)
        state: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 4 * L.M_TILE], 16]
        plan: cute.struct.MemRange[Int32, PLAN_WORDS]
        scan: cute.struct.MemRange[Int32, threads // 32]
        amax: cute.struct.Align[cute.struct.MemRange[Float32, 2 * L.M_TILE], 16]  # epilogue: split rows' max |o/ℓ|
        k_scale: cute.struct.Align[cute.struct.MemRange[Float32, scale_stride * n_scale * stages], 128]
        q_nope: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(q_nope_sl)], 1024]
        q_rope: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(q_rope_sl)], 1024]
        kv: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(kv_sl)], 1024]
        # right after kv: its address is kv's + kv_smem_bytes (the epilogue computes it)
        epi: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, EPI_BUFFER_BYTES], 128]
        k_rope: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kr_sl)], 1024]
        p: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(p_sl)], 1024]

    return SharedStorage


@dataclass(frozen=True)
class SmemTensors:
    """Views of the allocated storage: ``q_nope``, ``q_rope``, ``kv`` (content), ``kr``
    (RoPE), ``ks`` (scales: one 128-byte slot per TMA box, or per block), ``p``, ``vt`` (over ``kv``),
    ``state``, ``plan``; the handshake words and mbarriers stay on ``storage``. Frozen: the
    DSL passes it unchanged through the roles' run-time branches and loops."""

    storage: object
    q_nope: object
    q_rope: object
    kv: object
    kr: object
    ks: object
    p: object
    vt: object
    state: object
    plan: object

    @classmethod
    def make(cls, storage, cfg, scale_stride: int, n_scale: int, layouts):
        """Views of ``storage`` (a ``shared_storage`` struct) through ``layouts``
        (``args.SmemLayouts``)."""
        q_nope_sl, q_rope_sl, kv_sl, kr_sl, vt_sl, p_sl = (
            layouts.q_nope, layouts.q_rope, layouts.kv, layouts.kr, layouts.vt, layouts.p)
        q_nope = storage.q_nope.get_tensor(q_nope_sl.outer, swizzle=q_nope_sl.inner)
        q_rope = storage.q_rope.get_tensor(q_rope_sl.outer, swizzle=q_rope_sl.inner)
        kv = storage.kv.get_tensor(kv_sl.outer, swizzle=kv_sl.inner)
        kr = storage.k_rope.get_tensor(kr_sl.outer, swizzle=kr_sl.inner)
        # TMA needs 128-byte aligned destinations: one 128-byte slot per box of scales (one
        # slot of 64 per block when the producer gathers them: sparse)
        ks = storage.k_scale.get_tensor(
            cute.make_layout(
                (cfg.scale_box, n_scale, cfg.kv_stages),
                stride=(1, scale_stride, scale_stride * n_scale),
            )
        )
        p = storage.p.get_tensor(p_sl.outer, swizzle=p_sl.inner)
        vt = cute.make_tensor(cute.recast_ptr(kv.iterator, vt_sl.inner), vt_sl.outer)
        state = storage.state.get_tensor(cute.make_layout((L.M_TILE, 4, 2), stride=(4, 1, 4 * L.M_TILE)))
        plan = storage.plan.get_tensor(cute.make_layout((PLAN_WORDS,)))
        return cls(storage, q_nope, q_rope, kv, kr, ks, p, vt, state, plan)

    def cl_mbar_addr(self):
        """The cluster merge's two mbarriers' shared address (free, then data: 8 bytes on)."""
        return self.storage.cl_mbar.data_ptr().toint()

    def kv_addr(self):
        """The KV stages' shared address as an Int32 (the transposer's and the epilogue's
        address arithmetic, and the merge's scratch); made where it is used, so no register
        holds it across ``setmaxnreg``."""
        return self.storage.kv.data_ptr().toint()
