"""Fused-K-Append (SnapMLA §3.3.1): quantize new KV rows and scatter them into the paged cache.

Input  ``kv``            bf16  [n, 576] as views content [n, 512] and RoPE [n, 64]
       ``slot_mapping``  int64 [n]      slot = page * page_size + offset; -1 skips the row
Cache  ``kv_content``    uint8 [S, 512] view of the cache (row stride 640 bytes)
       ``kv_rope``       bf16  [S, 64]  view of bytes 512..639 (row stride 320 elements)
       ``kv_scale``      fp32  [S]
S = num_pages * page_size. A slot outside [0, S) is never written (the op rejects it before
launch when it can look; under CUDA-graph capture this guard is what remains).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from snapmla_cute import jit_cache
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kernels import fake, rowquant
from snapmla_cute.kernels.views import cache_views, view

NAME = "append_kv"
CALL_NAME = "append_kv_call"


@dataclass(frozen=True)
class AppendKVConfig:
    rows_per_cta: int = 8  # one warp per token


@dataclass(frozen=True)
class AppendKVTensors:
    """The kernel's tensors: the new rows' bf16 content and RoPE, their slots, then the
    cache's views (``views.cache_views``)."""

    kv_content_in: cute.Tensor
    kv_rope_in: cute.Tensor
    slot_mapping: cute.Tensor
    kv_content: cute.Tensor
    kv_rope: cute.Tensor
    kv_scale: cute.Tensor


class AppendKVKernel:
    def __init__(self, cfg: AppendKVConfig = AppendKVConfig()):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_kv_content_in: cute.Tensor,
        m_kv_rope_in: cute.Tensor,
        m_slot_mapping: cute.Tensor,
        m_kv_content: cute.Tensor,
        m_kv_rope: cute.Tensor,
        m_kv_scale: cute.Tensor,
        stream,
    ):
        rows = self.cfg.rows_per_cta
        self.kernel(
            AppendKVTensors(m_kv_content_in, m_kv_rope_in, m_slot_mapping, m_kv_content, m_kv_rope, m_kv_scale)
        ).launch(
            grid=[cute.ceil_div(m_kv_content_in.shape[0], rows), 1, 1],
            block=[rowquant.WARP * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, t: AppendKVTensors):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % rowquant.WARP
        row = cutlass.Int64(bidx) * self.cfg.rows_per_cta + tidx // rowquant.WARP
        if row < t.kv_content_in.shape[0]:
            slot = t.slot_mapping[row]
            if slot >= 0 and slot < t.kv_scale.shape[0]:
                content, rope = rowquant.load_row(
                    t.kv_content_in[row, None], t.kv_rope_in[row, None], lane
                )
                scale = rowquant.row_scale(content)
                rowquant.store_quantized(
                    content,
                    rope,
                    Float32(1.0) / scale,
                    t.kv_content[slot, None],
                    t.kv_rope[slot, None],
                    lane,
                )
                if lane == 0:
                    t.kv_scale[slot] = scale


def fake_args(config: AppendKVConfig):
    n = fake.sym()
    return (*fake.rows_in(n), fake.tensor(cutlass.Int64, (n,), (1,), 8), *fake.cache_views(fake.sym()), fake.stream())


def compile(config: AppendKVConfig = AppendKVConfig(), *, arch: str | None = None, keep_sass: bool = False):
    """The compiled kernel for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, AppendKVKernel, fake_args, arch=arch, keep_sass=keep_sass)


# ---------------------------------------------------------------------------------------------
# The call ``append_kv`` makes: tensors as they are, views built at trace time
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppendKVCallConfig:
    page_size: int
    kernel: AppendKVConfig = AppendKVConfig()


class AppendKVCall:
    """``kv`` bf16 ``[n, 576]``, ``slot_mapping`` int64 ``[n]``, the cache's ``kv`` uint8
    ``[pages, page_size, 640]`` and ``kv_scale`` fp32 ``[pages, page_size]``."""

    def __init__(self, cfg: AppendKVCallConfig):
        self.cfg = cfg
        self.append = AppendKVKernel(cfg.kernel)

    @cute.jit
    def __call__(self, m_kv_in: cute.Tensor, m_slots: cute.Tensor, m_kv: cute.Tensor, m_kv_scale: cute.Tensor, stream):
        n = m_kv_in.shape[0]
        self.append(
            view(m_kv_in, (n, CONTENT_DIM), (HEAD_DIM, 1)),
            view(m_kv_in, (n, ROPE_DIM), (HEAD_DIM, 1), cutlass.BFloat16, 2 * CONTENT_DIM),
            m_slots,
            *cache_views(m_kv, m_kv_scale, self.cfg.page_size),
            stream,
        )


def call_fake_args(config: AppendKVCallConfig):
    n, ps = fake.sym(), config.page_size
    return (
        fake.tensor(cutlass.BFloat16, (n, HEAD_DIM), (HEAD_DIM, 1), 16),
        fake.tensor(cutlass.Int64, (n,), (1,), 8),
        *fake.cache(ps),
        fake.stream(),
    )


def compile_call(config: AppendKVCallConfig, *, arch: str | None = None, keep_sass: bool = False):
    """``append_kv``'s compiled call for one page size."""
    return jit_cache.compile_kernel(CALL_NAME, config, AppendKVCall, call_fake_args, arch=arch, keep_sass=keep_sass)
