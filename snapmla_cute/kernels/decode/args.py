"""The typed bundles the decode kernel's wiring builds once and hands to its roles.

The launch passes the kernel five bundles (``DecodeMmas``, ``TmaLoads``, ``DecodeInputs``,
``DecodeOutputs``, ``SmemLayouts``) plus ``scale_log2`` and the optional visible counts;
the kernel body adds the shared-memory views (``storage.SmemTensors``), the plan
(``plan.PartWork``) and the consumers' hand-offs (``ConsumerSync``); a consumer hands the
epilogue its request's result (``RequestEnd``). (The host→kernel seam, each launch's
arguments, is ``launch``.) All are frozen
dataclasses: the DSL passes them unchanged through run-time branches and loops, and flattens
their fields, in order, into the kernel's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Float16, Int32

from snapmla_cute import ptx
from snapmla_cute.pipelines.handshakes import PairExchange, TransposerHandshake
from snapmla_cute.pipelines.kv_ring import KVRing


@dataclass(frozen=True)
class DecodeMmas:
    """The tiled MMAs: QK (e4m3 content, bf16 RoPE: one accumulator) and PV (P from registers
    or from shared memory), each accumulating; ``*0`` run a chain's first k-step with
    scale-d = 0 (zeroing the accumulator in registers instead makes ptxas spill)."""

    qk: cute.TiledMma
    qk_rope: cute.TiledMma
    pv_rs: cute.TiledMma
    pv_ss: cute.TiledMma
    qk0: cute.TiledMma
    pv0: cute.TiledMma
    pv_rs0: cute.TiledMma


@dataclass(frozen=True)
class TmaLoads:
    """The TMA atoms and the global tensors they partition, as (atom, tensor) pairs: Q's
    content and RoPE (64-row tiles), the KV content, RoPE and scales (``box_rows`` tokens).
    The sparse decode gathers KV with cp.async: its KV pairs hold Q's atom beside the cache
    tensors."""

    q_nope: tuple
    q_rope: tuple
    kv: tuple
    kr: tuple
    ks: tuple

    def atoms(self):
        return (self.q_nope[0], self.q_rope[0], self.kv[0], self.kr[0], self.ks[0])


@dataclass(frozen=True)
class DecodeInputs:
    """What a call reads besides Q and the cache: ``q_scale`` fp32 (R, b), ``block_table``
    int32 (b, max_pages) (sparse: the index lists (b, topk)), ``seqlens`` int32 (b,), and the
    metadata the kernel writes its plan into, ``sched`` int32 (parts, 8) and
    ``split_offsets`` int32 (b + 1,)."""

    q_scale: cute.Tensor
    block_table: cute.Tensor
    seqlens: cute.Tensor
    sched: cute.Tensor
    split_offsets: cute.Tensor


@dataclass(frozen=True)
class DecodeOutputs:
    """Where results go: ``out`` bf16 (R, 512, b) and ``lse`` fp32 (b, h, s_q); a split
    request's partials ``o_partial`` (R, 512, splits; fp32, or f16 and scales in the same
    slots: ``partial_views``) and ``lse_partial`` (R, splits);
    ``counters`` int32 (b, 2·m_tiles): splits counted and mergers done per (request, m-tile)."""

    out: cute.Tensor
    lse: cute.Tensor
    o_partial: cute.Tensor
    lse_partial: cute.Tensor
    counters: cute.Tensor

    def partial_views(self, dep):
        """A split's partial slot (fp32 (R, 512) of ``o_partial``) in the f16 format of a
        request of at most ``MERGE_FEW`` splits: its first half o/ℓ·f as f16 (R, 512), then
        1/f per row (fp32). Each split keeps its own slot, so requests of either format
        share the buffer. Returns (f16 (R, 512, splits), fp32 (R, splits))."""
        part = self.o_partial
        R, _, _ = part.shape
        st = part.layout.stride
        o16 = cute.make_tensor(
            cute.recast_ptr(part.iterator, dtype=Float16),
            cute.make_layout(part.shape, stride=(st[0], st[1], 2 * st[2])),
        )
        # the scales' offset laundered by ``dep`` (the request): computed before the block
        # loop, ptxas kept it live there
        scales = cute.make_tensor(
            part.iterator + ptx.launder(Int32(R * st[0] // 2), dep),
            cute.make_layout((R, part.shape[2]), stride=(1, st[2])),
        )
        return o16, scales


@dataclass(frozen=True)
class SmemLayouts:
    """The swizzled shared-memory layouts (``layouts.smem``): Q's content and RoPE, the KV
    ring's content, RoPE and Vᵀ (over the content), and the two P slots."""

    q_nope: cute.ComposedLayout
    q_rope: cute.ComposedLayout
    kv: cute.ComposedLayout
    kr: cute.ComposedLayout
    vt: cute.ComposedLayout
    p: cute.ComposedLayout


@dataclass(frozen=True)
class RequestEnd:
    """A consumer WG at the end of a request segment, as the epilogue takes it: its O
    accumulator (per PV split, as (row, column)), the softmax state (m, σ_p, ℓ), whether the
    segment had any block, and where it runs: the m-tile and request, the consumer WG and
    the thread's index in it, the KV stages' shared address."""

    acc_o_mn: list
    state: tuple
    any_blocks: object
    m_tile: Int32
    req: Int32
    wg: Int32
    wg_tidx: Int32
    kv_addr: Int32


@dataclass(frozen=True)
class ConsumerSync:
    """A consumer warpgroup's hand-offs: the KV ring (wait / release by block), the
    transposer's per-stage handshake, the exchange with the other consumer (P and softmax
    state), and its side of the one-stage Q pipeline."""

    ring: KVRing
    handshake: TransposerHandshake
    exchange: PairExchange
    q_pipe: object  # cutlass.pipeline's consumer participant of the Q pipeline
