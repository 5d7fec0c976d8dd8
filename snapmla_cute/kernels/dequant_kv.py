"""Fused-Fetch-Dequant (SnapMLA §3.3.1): gather cache slots and dequantize them to bf16 in one pass.

Cache  ``kv_content`` uint8 [S, 512], ``kv_rope`` bf16 [S, 64], ``kv_scale`` fp32 [S]
Input  ``slots``      int64 [n]; -1 (or anything outside [0, S)) yields a zero row
Output ``out``        bf16 [n, 576] as views content [n, 512] and RoPE [n, 64]:
       bf16(e4m3 * scale) and bf16(rope * scale), each product one fp32 multiply.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN

from snapmla_cute import jit_cache
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kernels import fake, rowquant
from snapmla_cute.kernels.views import cache_views, view

NAME = "dequant_kv"
CALL_NAME = "dequant_kv_call"


@dataclass(frozen=True)
class DequantKVConfig:
    rows_per_cta: int = 8  # one warp per gathered token


@dataclass(frozen=True)
class DequantKVTensors:
    """The kernel's tensors: the cache's views (``views.cache_views``), the slots to read,
    then the output's bf16 content and RoPE views."""

    kv_content: cute.Tensor
    kv_rope: cute.Tensor
    kv_scale: cute.Tensor
    slots: cute.Tensor
    out_content: cute.Tensor
    out_rope: cute.Tensor


class DequantizeKVKernel:
    def __init__(self, cfg: DequantKVConfig = DequantKVConfig()):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_kv_content: cute.Tensor,
        m_kv_rope: cute.Tensor,
        m_kv_scale: cute.Tensor,
        m_slots: cute.Tensor,
        m_out_content: cute.Tensor,
        m_out_rope: cute.Tensor,
        stream,
    ):
        rows = self.cfg.rows_per_cta
        self.kernel(DequantKVTensors(m_kv_content, m_kv_rope, m_kv_scale, m_slots, m_out_content, m_out_rope)).launch(
            grid=[cute.ceil_div(m_out_content.shape[0], rows), 1, 1],
            block=[rowquant.WARP * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, t: DequantKVTensors):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % rowquant.WARP
        row = cutlass.Int64(bidx) * self.cfg.rows_per_cta + tidx // rowquant.WARP
        if row < t.out_content.shape[0]:
            slot = t.slots[row]
            c_out = cute.make_rmem_tensor((rowquant.CONTENT_PER_LANE,), BFloat16)
            r_out = cute.make_rmem_tensor((rowquant.ROPE_PER_LANE,), BFloat16)
            c_out.fill(0.0)
            r_out.fill(0.0)
            if slot >= 0 and slot < t.kv_scale.shape[0]:
                c_in = cute.make_rmem_tensor((rowquant.CONTENT_PER_LANE,), Float8E4M3FN)
                r_in = cute.make_rmem_tensor((rowquant.ROPE_PER_LANE,), BFloat16)
                cute.autovec_copy(
                    cute.local_tile(t.kv_content[slot, None], (rowquant.CONTENT_PER_LANE,), (lane,)),
                    cute.recast_tensor(c_in, cutlass.Uint8),
                )
                cute.autovec_copy(
                    cute.local_tile(t.kv_rope[slot, None], (rowquant.ROPE_PER_LANE,), (lane,)),
                    r_in,
                )
                scale = t.kv_scale[slot]
                c_out.store((c_in.load().to(Float32) * scale).to(BFloat16))
                r_out.store((r_in.load().to(Float32) * scale).to(BFloat16))
            cute.autovec_copy(
                c_out,
                cute.local_tile(t.out_content[row, None], (rowquant.CONTENT_PER_LANE,), (lane,)),
            )
            cute.autovec_copy(
                r_out, cute.local_tile(t.out_rope[row, None], (rowquant.ROPE_PER_LANE,), (lane,))
            )


def fake_args(config: DequantKVConfig):
    n = fake.sym()
    return (*fake.cache_views(fake.sym()), fake.tensor(cutlass.Int64, (n,), (1,), 8), *fake.rows_in(n), fake.stream())


def compile(config: DequantKVConfig = DequantKVConfig(), *, arch: str | None = None, keep_sass: bool = False):
    """The compiled kernel for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, DequantizeKVKernel, fake_args, arch=arch, keep_sass=keep_sass)


# ---------------------------------------------------------------------------------------------
# The call ``dequantize_kv`` makes: tensors as they are, views built at trace time
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DequantKVCallConfig:
    page_size: int
    kernel: DequantKVConfig = DequantKVConfig()


class DequantizeKVCall:
    """The cache's ``kv`` uint8 ``[pages, page_size, 640]`` and ``kv_scale`` fp32
    ``[pages, page_size]``, ``slots`` int64 ``[n]`` → ``out`` bf16 ``[n, 576]``."""

    def __init__(self, cfg: DequantKVCallConfig):
        self.cfg = cfg
        self.dequant = DequantizeKVKernel(cfg.kernel)

    @cute.jit
    def __call__(self, m_kv: cute.Tensor, m_kv_scale: cute.Tensor, m_slots: cute.Tensor, m_out: cute.Tensor, stream):
        n = m_out.shape[0]
        self.dequant(
            *cache_views(m_kv, m_kv_scale, self.cfg.page_size),
            m_slots,
            view(m_out, (n, CONTENT_DIM), (HEAD_DIM, 1)),
            view(m_out, (n, ROPE_DIM), (HEAD_DIM, 1), cutlass.BFloat16, 2 * CONTENT_DIM),
            stream,
        )


def call_fake_args(config: DequantKVCallConfig):
    n = fake.sym()
    return (
        *fake.cache(config.page_size),
        fake.tensor(cutlass.Int64, (n,), (1,), 8),
        fake.tensor(cutlass.BFloat16, (n, HEAD_DIM), (HEAD_DIM, 1), 16),
        fake.stream(),
    )


def compile_call(config: DequantKVCallConfig, *, arch: str | None = None, keep_sass: bool = False):
    """``dequantize_kv``'s compiled call for one page size."""
    return jit_cache.compile_kernel(CALL_NAME, config, DequantizeKVCall, call_fake_args, arch=arch, keep_sass=keep_sass)
