"""Split-KV combine: LSE-weighted merge of a request's partial decode results.

Input  ``o_partial``     fp32 [max_splits, R, 512]  each split's O / ℓ (R = s_q * h rows)
       ``lse_partial``   fp32 [max_splits, R]       each split's natural-log LSE
       ``split_offsets`` int32 [b + 1]              from the scheduler
Output ``out``           bf16 [b, R, 512] (= [b, s_q, h, 512]),  ``lse`` fp32 [b, h, s_q]
One warp per (request, row); lane l owns dims [16 l, 16 l + 16). A request with a single
split was finished by the decode kernel itself and is skipped here (early exit).
    lse = max_s + log Σ_s exp(lse_s - max_s),   out = Σ_s exp(lse_s - lse) · O_s
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from snapmla_cute.format import V_DIM

WARP = 32
DIMS_PER_LANE = V_DIM // WARP


@dataclass(frozen=True)
class CombineConfig:
    heads: int
    s_q: int
    rows_per_cta: int = 8  # one warp per row


class DecodeCombineKernel:
    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_o_partial: cute.Tensor,
        m_lse_partial: cute.Tensor,
        m_split_offsets: cute.Tensor,
        m_out: cute.Tensor,
        m_lse: cute.Tensor,
        stream,
    ):
        rows = self.cfg.rows_per_cta
        batch = m_out.shape[0]
        self.kernel(m_o_partial, m_lse_partial, m_split_offsets, m_out, m_lse).launch(
            grid=[cute.ceil_div(m_out.shape[1], rows), batch, 1],
            block=[WARP * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        m_o_partial: cute.Tensor,
        m_lse_partial: cute.Tensor,
        m_split_offsets: cute.Tensor,
        m_out: cute.Tensor,
        m_lse: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row_blk, req, _ = cute.arch.block_idx()
        lane = tidx % WARP
        row = row_blk * self.cfg.rows_per_cta + tidx // WARP
        first = m_split_offsets[req]
        n_splits = m_split_offsets[req + 1] - first
        if row < m_out.shape[1] and n_splits > 1:
            lse_max = -Float32.inf
            for s in cutlass.range(n_splits):
                lse_max = cute.arch.fmax(lse_max, m_lse_partial[first + s, row])
            acc = cute.make_rmem_tensor((DIMS_PER_LANE,), Float32)
            acc.fill(0.0)
            lse_final = -Float32.inf
            if lse_max != -Float32.inf:
                total = Float32(0.0)
                for s in cutlass.range(n_splits):
                    total += cute.math.exp(m_lse_partial[first + s, row] - lse_max)
                lse_final = lse_max + cute.math.log(total)
                for s in cutlass.range(n_splits):
                    w = cute.math.exp(m_lse_partial[first + s, row] - lse_final)
                    src = cute.make_rmem_tensor((DIMS_PER_LANE,), Float32)
                    cute.autovec_copy(
                        cute.local_tile(m_o_partial[first + s, row, None], (DIMS_PER_LANE,), (lane,)), src
                    )
                    acc.store(acc.load() + src.load() * w)
            out = cute.make_rmem_tensor((DIMS_PER_LANE,), BFloat16)
            out.store(acc.load().to(BFloat16))
            cute.autovec_copy(out, cute.local_tile(m_out[req, row, None], (DIMS_PER_LANE,), (lane,)))
            if lane == 0:
                m_lse[req, row % self.cfg.heads, row // self.cfg.heads] = lse_final
