"""Fused-Q-Quant (SnapMLA §3.3.1): one launch turns a bf16 query into the FP8 decode format.

Input  ``q``        bf16  [n, 576]   (n = b * s_q * h rows, row stride 576), passed as two
                   views: content [n, 512] and RoPE [n, 64]
Output ``q_nope``   uint8 [n, 512]   e4m3 bytes of q_content / q_scale
       ``q_rope``   bf16  [n, 64]    q_rope / q_scale (pre-scaled domain alignment, Eq. 6)
       ``q_scale``  fp32  [n]        amax(|q_content|) / 448, one per (token, head)
       ``q_lo``     uint8 [n, 512]   (``QuantQConfig.split``, the accurate mode) e4m3 bytes
                                     of q_content / q_scale - q_nope: Q as hi + lo
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from snapmla_cute import jit_cache
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kernels import fake, rowquant
from snapmla_cute.kernels.views import view

NAME = "quant_q"
CALL_NAME = "quant_q_call"


@dataclass(frozen=True)
class QuantQConfig:
    rows_per_cta: int = 8  # one warp per row
    split: bool = False  # also the residual's e4m3 codes (``q_lo``): the query as hi + lo


@dataclass(frozen=True)
class QuantQTensors:
    """The kernel's tensors (views of [n, ...] rows): the bf16 query's content and RoPE, then
    the outputs ``q_nope`` (e4m3 bytes), ``q_rope`` (bf16) and ``q_scale`` (fp32)."""

    q_content: cute.Tensor
    q_rope_in: cute.Tensor
    q_nope: cute.Tensor
    q_rope: cute.Tensor
    q_scale: cute.Tensor


@dataclass(frozen=True)
class QuantQSplitTensors:
    """``QuantQTensors`` and the residual's codes ``q_lo`` (e4m3 bytes): the split query."""

    q: QuantQTensors
    q_lo: cute.Tensor


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
        m_q_lo: cute.Tensor = None,  # uint8 [n, 512]: the residual's codes (``QuantQConfig.split``)
    ):
        if cutlass.const_expr((m_q_lo is not None) != self.cfg.split):
            raise ValueError(f"quantize_q: q_lo given: {m_q_lo is not None}, but the config says split={self.cfg.split}")
        rows = self.cfg.rows_per_cta
        t = QuantQTensors(m_q_content, m_q_rope_in, m_q_nope, m_q_rope, m_q_scale)
        if cutlass.const_expr(self.cfg.split):
            t = QuantQSplitTensors(t, m_q_lo)
        self.kernel(t).launch(
            grid=[cute.ceil_div(m_q_content.shape[0], rows), 1, 1],
            block=[rowquant.WARP * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, tensors):
        t = tensors.q if cutlass.const_expr(self.cfg.split) else tensors
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % rowquant.WARP
        row = cutlass.Int64(bidx) * self.cfg.rows_per_cta + tidx // rowquant.WARP
        if row < t.q_content.shape[0]:
            content, rope = rowquant.load_row(t.q_content[row, None], t.q_rope_in[row, None], lane)
            scale = rowquant.row_scale(content)
            lo_row = tensors.q_lo[row, None] if cutlass.const_expr(self.cfg.split) else None
            rowquant.store_quantized(content, rope, Float32(1.0) / scale, t.q_nope[row, None], t.q_rope[row, None],
                                     lane, lo_row)
            if lane == 0:
                t.q_scale[row] = scale


def fake_args(config: QuantQConfig):
    n = fake.sym()
    lo = (fake.tensor(cutlass.Uint8, (n, CONTENT_DIM), (CONTENT_DIM, 1), 16),) if config.split else ()
    return (
        *fake.rows_in(n),
        fake.tensor(cutlass.Uint8, (n, CONTENT_DIM), (CONTENT_DIM, 1), 16),
        fake.tensor(cutlass.BFloat16, (n, ROPE_DIM), (ROPE_DIM, 1), 16),
        fake.tensor(Float32, (n,), (1,), 4),
        fake.stream(),
        *lo,
    )


def compile(config: QuantQConfig = QuantQConfig(), *, arch: str | None = None, keep_sass: bool = False):
    """The compiled kernel for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, QuantizeQKernel, fake_args, arch=arch, keep_sass=keep_sass)


# ---------------------------------------------------------------------------------------------
# The call ``quantize_q`` makes: tensors as they are, views built at trace time
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantQCallConfig:
    s_q: int
    heads: int
    kernel: QuantQConfig = QuantQConfig()  # ``split``: the call also writes ``q_lo``


class QuantizeQCall:
    """``q`` bf16 ``[b, s_q, h, 576]`` → ``q_nope`` e4m3 ``[b, s_q, h, 512]``, ``q_rope`` bf16
    ``[b, s_q, h, 64]``, ``q_scale`` fp32 ``[b, s_q, h]``, all contiguous; one symbolic batch
    ties them, so the argument decoder rejects a mismatch before launch."""

    def __init__(self, cfg: QuantQCallConfig):
        self.cfg = cfg
        self.quant = QuantizeQKernel(cfg.kernel)

    @cute.jit
    def __call__(self, m_q: cute.Tensor, m_q_nope: cute.Tensor, m_q_rope: cute.Tensor, m_q_scale: cute.Tensor, stream,
                 m_q_lo: cute.Tensor = None):
        n = m_q.shape[0] * (self.cfg.s_q * self.cfg.heads)
        self.quant(
            view(m_q, (n, CONTENT_DIM), (HEAD_DIM, 1)),
            view(m_q, (n, ROPE_DIM), (HEAD_DIM, 1), cutlass.BFloat16, 2 * CONTENT_DIM),
            view(m_q_nope, (n, CONTENT_DIM), (CONTENT_DIM, 1), cutlass.Uint8),
            view(m_q_rope, (n, ROPE_DIM), (ROPE_DIM, 1)),
            view(m_q_scale, (n,), (1,)),
            stream,
            None if m_q_lo is None else view(m_q_lo, (n, CONTENT_DIM), (CONTENT_DIM, 1), cutlass.Uint8),
        )


def call_fake_args(config: QuantQCallConfig):
    b, s_q, h = fake.sym(), config.s_q, config.heads
    R = s_q * h
    t = fake.tensor
    nope = t(cutlass.Float8E4M3FN, (b, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16)
    return (
        t(cutlass.BFloat16, (b, s_q, h, HEAD_DIM), (R * HEAD_DIM, h * HEAD_DIM, HEAD_DIM, 1), 16),
        nope,
        t(cutlass.BFloat16, (b, s_q, h, ROPE_DIM), (R * ROPE_DIM, h * ROPE_DIM, ROPE_DIM, 1), 16),
        t(Float32, (b, s_q, h), (R, h, 1), 4),
        fake.stream(),
        *((t(cutlass.Float8E4M3FN, (b, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),)
          if config.kernel.split else ()),
    )


def compile_call(config: QuantQCallConfig, *, arch: str | None = None, keep_sass: bool = False):
    """``quantize_q``'s compiled call for one (s_q, heads)."""
    return jit_cache.compile_kernel(CALL_NAME, config, QuantizeQCall, call_fake_args, arch=arch, keep_sass=keep_sass)
