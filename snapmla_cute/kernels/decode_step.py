"""One decode step as one host function: split-KV scheduler, decode, combine.

The three kernels are launched back to back on the caller's stream from a single compiled
host function, so a decode step costs one TVM-FFI call instead of three. The arguments are
the three kernels' arguments, shared tensors passed once (``cache_seqlens``, the plan,
``split_offsets``, ``lse``).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from snapmla_cute.kernels.decode import DecodeConfig, DecodeKernel
from snapmla_cute.kernels.decode_combine import CombineConfig, DecodeCombineKernel
from snapmla_cute.kernels.decode_scheduler import DecodeSchedulerKernel


@dataclass(frozen=True)
class DecodeStepConfig:
    decode: DecodeConfig


class DecodeStepKernel:
    def __init__(self, cfg: DecodeStepConfig):
        self.cfg = cfg
        self.scheduler = DecodeSchedulerKernel()
        self.decode = DecodeKernel(cfg.decode)
        self.combine = DecodeCombineKernel(CombineConfig(heads=cfg.decode.heads, s_q=cfg.decode.s_q))

    @cute.jit
    def __call__(
        self,
        m_q_nope: cute.Tensor,
        m_q_rope: cute.Tensor,
        m_q_scale: cute.Tensor,
        m_kv_content: cute.Tensor,
        m_kv_rope: cute.Tensor,
        m_kv_scale: cute.Tensor,
        m_block_table: cute.Tensor,
        m_seqlens: cute.Tensor,
        m_sched: cute.Tensor,
        m_split_offsets: cute.Tensor,
        m_out: cute.Tensor,  # (R, 512, b) view for the decode
        m_lse: cute.Tensor,
        m_o_partial: cute.Tensor,  # (R, 512, splits) view for the decode
        m_lse_partial: cute.Tensor,  # (R, splits) view for the decode
        c_o_partial: cute.Tensor,  # (splits, R, 512) for the combine
        c_lse_partial: cute.Tensor,  # (splits, R)
        c_out: cute.Tensor,  # (b, R, 512)
        scale_log2: cutlass.Float32,
        stream,
    ):
        self.scheduler(m_seqlens, m_sched, m_split_offsets, stream)
        self.decode(
            m_q_nope, m_q_rope, m_q_scale, m_kv_content, m_kv_rope, m_kv_scale, m_block_table, m_seqlens,
            m_sched, m_split_offsets, m_out, m_lse, m_o_partial, m_lse_partial, scale_log2, stream,
        )
        self.combine(c_o_partial, c_lse_partial, m_split_offsets, c_out, m_lse, stream)
