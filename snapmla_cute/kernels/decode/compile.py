"""Compile entries of the decode: the kernel on its own views (``decode``, for the compile
report), and the one-launch step (``step.DecodeStepKernel``) that ``mla_decode`` and
``mla_decode_sparse`` call, from a quantized or a bf16 query (``step``, ``step_q``,
``sparse``, ``sparse_q``), each with its fake arguments (symbolic batch, pages and splits;
natural PyTorch strides for the step, so its argument decoder checks every tensor)."""

from __future__ import annotations

from snapmla_cute import jit_cache
from snapmla_cute.kernels import fake
from snapmla_cute.kernels.decode.config import DecodeConfig
from snapmla_cute.kernels.decode.kernel import DecodeKernel
from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig, DecodeStepKernel

NAME = "decode"
STEP_NAME = "decode_step"
STEP_Q_NAME = "decode_step_q"
SPARSE_NAME = "decode_sparse"
SPARSE_Q_NAME = "decode_sparse_q"


def fake_args(config: DecodeConfig, n=None):
    """The decode kernel's own views: rows (R = s_q·h) first, the batch / page / split index last."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM

    bf16, u8, f32, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32, cutlass.Int32
    n = fake.sym() if n is None else n
    h, s_q, ps = config.heads, config.s_q, config.page_size
    R = h * s_q
    pages, splits, parts, width = fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (
        t(u8, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), 16),
        t(bf16, (R, ROPE_DIM, n), (ROPE_DIM, 1, R * ROPE_DIM), 16),
        t(f32, (R, n), (1, R), 4),
        t(u8, (ps, CONTENT_DIM, pages), (KV_ROW_BYTES, 1, ps * KV_ROW_BYTES), 16),
        t(bf16, (ps, ROPE_DIM, pages), (KV_ROW_BYTES // 2, 1, ps * KV_ROW_BYTES // 2), 16),
        t(f32, (ps, pages), (1, ps), 16),
        t(i32, (n, width), (fake.sym(), 1), 4),
        t(i32, (n,), (1,), 4),
        t(i32, (parts, 8), (8, 1), 16),
        t(i32, (fake.sym(),), (1,), 4),
        t(bf16, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), 16),
        t(f32, (n, h, s_q), (h * s_q, s_q, 1), 4),
        t(f32, (R, CONTENT_DIM, splits), (CONTENT_DIM, 1, R * CONTENT_DIM), 16),
        t(f32, (R, splits), (1, R), 4),
        t(i32, (n, 2 * config.m_tiles), (2 * config.m_tiles, 1), 4),
        cutlass.Float32(0.0),
        fake.stream(),
        *((None, t(u8, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), 16)) if config.q_split else ()),
    )


def step_fake_args(config: DecodeStepConfig, n=None, q=None):
    """The step's arguments in their natural (contiguous PyTorch) layouts; one symbolic batch
    size ties q, the table, the lengths and the outputs together, so TVM-FFI rejects a
    mismatch before launch. The two optional tensors are always passed (None where absent):
    the compiled call then takes every parameter, as the API passes them."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM

    bf16, u8, f32, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32, cutlass.Int32
    fp8 = cutlass.Float8E4M3FN
    n = fake.sym() if n is None else n
    g = config.head_groups
    h, s_q, ps = config.decode.heads * g, config.decode.s_q, config.decode.page_size  # h: the call's heads
    R = h * s_q
    Rk = config.decode.rows  # a kernel request's rows
    m_tiles = config.decode.m_tiles
    pages, splits = fake.sym(), fake.sym()
    t = fake.tensor
    return (
        t(fp8, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(bf16, (n, s_q, h, ROPE_DIM), (R * ROPE_DIM, h * ROPE_DIM, ROPE_DIM, 1), 16),
        t(f32, (n, s_q, h), (R, h, 1), 4),
        t(i32, (n, fake.sym()), (fake.sym(), 1), 4),
        t(i32, (n,), (1,), 4),
        t(bf16, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(f32, (n, h, s_q), (R, s_q, 1), 4),
        t(u8, (pages, ps, KV_ROW_BYTES), (ps * KV_ROW_BYTES, KV_ROW_BYTES, 1), 16),
        t(f32, (pages, ps), (ps, 1), 16),
        t(i32, (fake.sym(), 8), (8, 1), 16),
        # per kernel request (g of them per call request with head groups)
        t(i32, (n, g), (g, 1), 4) if g > 1 else t(i32, (n,), (1,), 4),
        t(f32, (splits, Rk, CONTENT_DIM), (Rk * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(f32, (splits, Rk), (Rk, 1), 4),
        t(i32, (n, g, 2 * m_tiles), (g * 2 * m_tiles, 2 * m_tiles, 1), 4) if g > 1 else
        t(i32, (n, 2 * m_tiles), (2 * m_tiles, 1), 4),
        cutlass.Float32(0.0),
        fake.stream(),
        t(i32, (n, s_q), (s_q, 1), 4) if config.decode.visible else None,  # the visible step's counts
        q,
        *_q_lo(config, n, s_q, h),
    )


def _q_lo(config, n, s_q: int, h: int) -> tuple:
    """The accurate mode's residual codes ``[b, s_q, h, 512]`` (``DecodeConfig.q_split``): a
    step's last argument there, and absent otherwise (its compiled call keeps its arity)."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM

    if not config.decode.q_split:
        return ()
    R = s_q * h
    return (fake.tensor(cutlass.Float8E4M3FN, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1),
                        16),)


def step_q_fake_args(config: DecodeStepConfig):
    """The step from a bf16 query ``[b, s_q, h, 576]`` (the last argument), quantized into
    the q buffers first."""
    n = fake.sym()
    return step_fake_args(config, n, _bf16_query(n, config.decode.s_q, config.decode.heads * config.head_groups))


def _bf16_query(n, s_q: int, h: int):
    import cutlass

    from snapmla_cute.format import HEAD_DIM

    return fake.tensor(cutlass.BFloat16, (n, s_q, h, HEAD_DIM), (s_q * h * HEAD_DIM, h * HEAD_DIM, HEAD_DIM, 1), 16)


def compile(config: DecodeConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The decode kernel alone on its views (what the compile report checks)."""
    return jit_cache.compile_kernel(NAME, config, DecodeKernel, fake_args, arch=arch, keep_sass=keep_sass)


def compile_step(config: DecodeStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The step from a quantized query (one launch)."""
    return jit_cache.compile_kernel(STEP_NAME, config, DecodeStepKernel, step_fake_args, arch=arch, keep_sass=keep_sass)


def compile_step_q(config: DecodeStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The step from a bf16 query (Q-quant launch, then the decode)."""
    return jit_cache.compile_kernel(
        STEP_Q_NAME, config, DecodeStepKernel, step_q_fake_args, arch=arch, keep_sass=keep_sass
    )


def sparse_fake_args(config: DecodeSparseStepConfig, n=None, q=None):
    """The sparse step's arguments (natural PyTorch layouts): the batch ties q, the index
    lists, the lengths, the outputs and the metadata's per-request buffers; the cache as
    slots ``[S, 640]`` and ``[S]`` (any page size)."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM

    bf16, u8, f32, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32, cutlass.Int32
    fp8 = cutlass.Float8E4M3FN
    n = fake.sym() if n is None else n
    h, s_q = config.decode.heads, config.s_q
    R = h * s_q
    m_tiles = config.decode.m_tiles
    slots, splits, topk = fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (
        t(fp8, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(bf16, (n, s_q, h, ROPE_DIM), (R * ROPE_DIM, h * ROPE_DIM, ROPE_DIM, 1), 16),
        t(f32, (n, s_q, h), (R, h, 1), 4),
        t(i32, (n, s_q, topk), (fake.sym(), topk, 1), 4),
        t(i32, (n,), (1,), 4),
        t(bf16, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(f32, (n, h, s_q), (R, s_q, 1), 4),
        t(u8, (slots, KV_ROW_BYTES), (KV_ROW_BYTES, 1), 16),
        t(f32, (slots,), (1,), 4),
        t(i32, (fake.sym(), 8), (8, 1), 16),
        t(i32, (n, s_q), (s_q, 1), 4),
        t(f32, (splits, h, CONTENT_DIM), (h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(f32, (splits, h), (h, 1), 4),
        t(i32, (n, s_q, 2 * m_tiles), (s_q * 2 * m_tiles, 2 * m_tiles, 1), 4),
        cutlass.Float32(0.0),
        fake.stream(),
        None,  # no visible counts
        q,
        *_q_lo(config, n, s_q, h),
    )


def sparse_q_fake_args(config: DecodeSparseStepConfig):
    """The sparse step from a bf16 query ``[b, s_q, h, 576]`` (the last argument)."""
    n = fake.sym()
    return sparse_fake_args(config, n, _bf16_query(n, config.s_q, config.decode.heads))


def compile_sparse(config: DecodeSparseStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The sparse step from a quantized query (one launch)."""
    return jit_cache.compile_kernel(
        SPARSE_NAME, config, DecodeStepKernel, sparse_fake_args, arch=arch, keep_sass=keep_sass
    )


def compile_sparse_q(config: DecodeSparseStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The sparse step from a bf16 query (Q-quant launch, then the decode)."""
    return jit_cache.compile_kernel(
        SPARSE_Q_NAME, config, DecodeStepKernel, sparse_q_fake_args, arch=arch, keep_sass=keep_sass
    )
