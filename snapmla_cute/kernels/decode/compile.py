"""Compile entries of the decode: the kernel on its own views (``decode``, for the compile
report; ``fake_args``), and the one-launch step (``step.DecodeStepKernel``) that
``mla_decode`` and ``mla_decode_sparse`` call, from a quantized or a bf16 query (``step``,
``step_q``, ``sparse``, ``sparse_q``), all faked by ``step_fakes`` (symbolic batch, pages
and splits; natural PyTorch strides, so the compiled call's argument decoder checks every
tensor)."""

from __future__ import annotations

from snapmla_cute import jit_cache
from snapmla_cute.kernels import fake
from snapmla_cute.kernels.decode.config import DecodeConfig
from snapmla_cute.kernels.decode.kernel import DecodeKernel
from snapmla_cute.kernels.decode.launch import KernelArgs, StepArgs, fake_call
from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig, DecodeStepKernel

NAME = "decode"
STEP_NAME = "decode_step"
STEP_Q_NAME = "decode_step_q"
SPARSE_NAME = "decode_sparse"
SPARSE_Q_NAME = "decode_sparse_q"


def fake_args(config: DecodeConfig) -> tuple:
    """The decode kernel's own views (``launch.KernelArgs``): rows (R = s_q·h) first, the
    batch / page / split index last."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM

    bf16, u8, f32, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32, cutlass.Int32
    n = fake.sym()
    h, s_q, ps = config.heads, config.s_q, config.page_size
    R = h * s_q
    pages, splits, parts, width = fake.sym(), fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    args = KernelArgs(
        q_nope=t(u8, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), 16),
        q_rope=t(bf16, (R, ROPE_DIM, n), (ROPE_DIM, 1, R * ROPE_DIM), 16),
        q_scale=t(f32, (R, n), (1, R), 4),
        kv_content=t(u8, (ps, CONTENT_DIM, pages), (KV_ROW_BYTES, 1, ps * KV_ROW_BYTES), 16),
        kv_rope=t(bf16, (ps, ROPE_DIM, pages), (KV_ROW_BYTES // 2, 1, ps * KV_ROW_BYTES // 2), 16),
        kv_scale=t(f32, (ps, pages), (1, ps), 16),
        block_table=t(i32, (n, width), (fake.sym(), 1), 4),
        seqlens=t(i32, (n,), (1,), 4),
        sched=t(i32, (parts, 8), (8, 1), 16),
        split_offsets=t(i32, (fake.sym(),), (1,), 4),
        out=t(bf16, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), 16),
        lse=t(f32, (n, h, s_q), (h * s_q, s_q, 1), 4),
        o_partial=t(f32, (R, CONTENT_DIM, splits), (CONTENT_DIM, 1, R * CONTENT_DIM), 16),
        lse_partial=t(f32, (R, splits), (1, R), 4),
        counters=t(i32, (n, 2 * config.m_tiles), (2 * config.m_tiles, 1), 4),
        scale_log2=cutlass.Float32(0.0),
        q_lo=t(u8, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), 16) if config.q_split else None,
    )
    return fake_call(args, fake.stream())


def step_fakes(config: DecodeStepConfig | DecodeSparseStepConfig, bf16_q: bool) -> tuple:
    """Every step's arguments (``launch.StepArgs``) in their natural (contiguous PyTorch)
    layouts, dense or sparse by the config, from a quantized query or (``bf16_q``) a bf16
    one quantized first: one symbolic batch size ties q, the table, the lengths, the outputs
    and the metadata's per-request buffers together, so TVM-FFI rejects a mismatch before
    launch. The optional tensors are passed where the step takes them and None otherwise;
    ``q_lo`` (the accurate mode) is left out where absent, so such a step's compiled call
    keeps its arity."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, KV_ROW_BYTES, ROPE_DIM

    bf16, u8, f32, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32, cutlass.Int32
    fp8 = cutlass.Float8E4M3FN
    t = fake.tensor
    sparse = isinstance(config, DecodeSparseStepConfig)
    n = fake.sym()
    g = 1 if sparse else config.head_groups
    s_q = config.s_q if sparse else config.decode.s_q
    h = config.decode.heads * g  # the call's heads
    R = h * s_q
    m_tiles = config.decode.m_tiles
    Rk = h if sparse else config.decode.rows  # a kernel request's rows
    ps = config.decode.page_size
    splits = fake.sym()

    def per_request(*tail):
        """A metadata buffer with one entry (or row ``tail``) per kernel request: ``[b, ..]``,
        ``[b, g, ..]`` with head groups, ``[b, s_q, ..]`` sparse."""
        mid = (s_q,) if sparse else (g,) if g > 1 else ()
        shape = (n, *mid, *tail)
        stride = tuple(_prod(shape[k + 1:]) for k in range(len(shape)))
        return t(i32, shape, stride, 4)

    if sparse:
        topk, slots = fake.sym(), fake.sym()
        table = t(i32, (n, s_q, topk), (fake.sym(), topk, 1), 4)
        kv = t(u8, (slots, KV_ROW_BYTES), (KV_ROW_BYTES, 1), 16)
        kv_scale = t(f32, (slots,), (1,), 4)
    else:
        pages = fake.sym()
        table = t(i32, (n, fake.sym()), (fake.sym(), 1), 4)
        kv = t(u8, (pages, ps, KV_ROW_BYTES), (ps * KV_ROW_BYTES, KV_ROW_BYTES, 1), 16)
        kv_scale = t(f32, (pages, ps), (ps, 1), 16)
    args = StepArgs(
        q_nope=t(fp8, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        q_rope=t(bf16, (n, s_q, h, ROPE_DIM), (R * ROPE_DIM, h * ROPE_DIM, ROPE_DIM, 1), 16),
        q_scale=t(f32, (n, s_q, h), (R, h, 1), 4),
        table=table,
        lengths=t(i32, (n,), (1,), 4),
        out=t(bf16, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        lse=t(f32, (n, h, s_q), (R, s_q, 1), 4),
        kv=kv,
        kv_scale=kv_scale,
        sched=t(i32, (fake.sym(), 8), (8, 1), 16),
        split_offsets=per_request(),
        o_partial=t(f32, (splits, Rk, CONTENT_DIM), (Rk * CONTENT_DIM, CONTENT_DIM, 1), 16),
        lse_partial=t(f32, (splits, Rk), (Rk, 1), 4),
        counters=per_request(2 * m_tiles),
        scale_log2=cutlass.Float32(0.0),
        visible=t(i32, (n, s_q), (s_q, 1), 4) if not sparse and config.decode.visible else None,
        q=t(bf16, (n, s_q, h, HEAD_DIM), (R * HEAD_DIM, h * HEAD_DIM, HEAD_DIM, 1), 16) if bf16_q else None,
        q_lo=(t(fp8, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16)
              if config.decode.q_split else None),
    )
    call = fake_call(args, fake.stream())
    return call if config.decode.q_split else call[:-1]


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def compile(config: DecodeConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The decode kernel alone on its views (what the compile report checks)."""
    return jit_cache.compile_kernel(NAME, config, DecodeKernel, fake_args, arch=arch, keep_sass=keep_sass)


def compile_step(config: DecodeStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The step from a quantized query (one launch)."""
    return jit_cache.compile_kernel(STEP_NAME, config, DecodeStepKernel, lambda c: step_fakes(c, False), arch=arch,
                                    keep_sass=keep_sass)


def compile_step_q(config: DecodeStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The step from a bf16 query (Q-quant launch, then the decode)."""
    return jit_cache.compile_kernel(STEP_Q_NAME, config, DecodeStepKernel, lambda c: step_fakes(c, True), arch=arch,
                                    keep_sass=keep_sass)


def compile_sparse(config: DecodeSparseStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The sparse step from a quantized query (one launch)."""
    return jit_cache.compile_kernel(SPARSE_NAME, config, DecodeStepKernel, lambda c: step_fakes(c, False), arch=arch,
                                    keep_sass=keep_sass)


def compile_sparse_q(config: DecodeSparseStepConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The sparse step from a bf16 query (Q-quant launch, then the decode)."""
    return jit_cache.compile_kernel(SPARSE_Q_NAME, config, DecodeStepKernel, lambda c: step_fakes(c, True), arch=arch,
                                    keep_sass=keep_sass)
