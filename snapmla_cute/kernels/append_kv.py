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
from snapmla_cute.kernels import fake, rowquant

NAME = "append_kv"


@dataclass(frozen=True)
class AppendKVConfig:
    rows_per_cta: int = 8  # one warp per token


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
            m_kv_content_in, m_kv_rope_in, m_slot_mapping, m_kv_content, m_kv_rope, m_kv_scale
        ).launch(
            grid=[cute.ceil_div(m_kv_content_in.shape[0], rows), 1, 1],
            block=[rowquant.WARP * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        m_kv_content_in: cute.Tensor,
        m_kv_rope_in: cute.Tensor,
        m_slot_mapping: cute.Tensor,
        m_kv_content: cute.Tensor,
        m_kv_rope: cute.Tensor,
        m_kv_scale: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % rowquant.WARP
        row = cutlass.Int64(bidx) * self.cfg.rows_per_cta + tidx // rowquant.WARP
        if row < m_kv_content_in.shape[0]:
            slot = m_slot_mapping[row]
            if slot >= 0 and slot < m_kv_scale.shape[0]:
                content, rope = rowquant.load_row(
                    m_kv_content_in[row, None], m_kv_rope_in[row, None], lane
                )
                scale = rowquant.row_scale(content)
                rowquant.store_quantized(
                    content,
                    rope,
                    Float32(1.0) / scale,
                    m_kv_content[slot, None],
                    m_kv_rope[slot, None],
                    lane,
                )
                if lane == 0:
                    m_kv_scale[slot] = scale


def fake_args(config: AppendKVConfig):
    n = fake.sym()
    return (*fake.rows_in(n), fake.tensor(cutlass.Int64, (n,), (1,), 8), *fake.cache_views(fake.sym()), fake.stream())


def compile(config: AppendKVConfig = AppendKVConfig(), *, arch: str | None = None, keep_sass: bool = False):
    """The compiled kernel for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, AppendKVKernel, fake_args, arch=arch, keep_sass=keep_sass)
