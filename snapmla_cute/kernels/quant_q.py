"""Fused-Q-Quant (SnapMLA §3.3.1): one launch turns a bf16 query into the FP8 decode format.

Input  ``q``        bf16  [n, 576]   (n = b * s_q * h rows, row stride 576), passed as two
                   views: content [n, 512] and RoPE [n, 64]
Output ``q_nope``   uint8 [n, 512]   e4m3 bytes of q_content / q_scale
       ``q_rope``   bf16  [n, 64]    q_rope / q_scale (pre-scaled domain alignment, Eq. 6)
       ``q_scale``  fp32  [n]        amax(|q_content|) / 448, one per (token, head)
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from snapmla_cute import jit_cache
from snapmla_cute.format import CONTENT_DIM, ROPE_DIM
from snapmla_cute.kernels import fake, rowquant

NAME = "quant_q"


@dataclass(frozen=True)
class QuantQConfig:
    rows_per_cta: int = 8  # one warp per row


class QuantizeQKernel:
    def __init__(self, cfg: QuantQConfig = QuantQConfig()):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_q_content: cute.Tensor,
        m_q_rope_in: cute.Tensor,
        m_q_nope: cute.Tensor,
        m_q_rope: cute.Tensor,
        m_q_scale: cute.Tensor,
        stream,
    ):
        rows = self.cfg.rows_per_cta
        self.kernel(m_q_content, m_q_rope_in, m_q_nope, m_q_rope, m_q_scale).launch(
            grid=[cute.ceil_div(m_q_content.shape[0], rows), 1, 1],
            block=[rowquant.WARP * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        m_q_content: cute.Tensor,
        m_q_rope_in: cute.Tensor,
        m_q_nope: cute.Tensor,
        m_q_rope: cute.Tensor,
        m_q_scale: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % rowquant.WARP
        row = cutlass.Int64(bidx) * self.cfg.rows_per_cta + tidx // rowquant.WARP
        if row < m_q_content.shape[0]:
            content, rope = rowquant.load_row(m_q_content[row, None], m_q_rope_in[row, None], lane)
            scale = rowquant.row_scale(content)
            rowquant.store_quantized(
                content, rope, Float32(1.0) / scale, m_q_nope[row, None], m_q_rope[row, None], lane
            )
            if lane == 0:
                m_q_scale[row] = scale


def fake_args(config: QuantQConfig):
    n = fake.sym()
    return (
        *fake.rows_in(n),
        fake.tensor(cutlass.Uint8, (n, CONTENT_DIM), (CONTENT_DIM, 1), 16),
        fake.tensor(cutlass.BFloat16, (n, ROPE_DIM), (ROPE_DIM, 1), 16),
        fake.tensor(Float32, (n,), (1,), 4),
        fake.stream(),
    )


def compile(config: QuantQConfig = QuantQConfig(), *, arch: str | None = None, keep_sass: bool = False):
    """The compiled kernel for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, QuantizeQKernel, fake_args, arch=arch, keep_sass=keep_sass)
