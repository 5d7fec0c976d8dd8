"""LSE merge of partial attention results: the context-parallel decode's last step.

Each of W shards of a request's keys was decoded alone, giving ``out_w`` (bf16) and
``lse_w`` (natural log); the attention over all the keys is

    lse = m + log Σ_w exp(lse_w - m)        m = max_w lse_w
    out = Σ_w exp(lse_w - lse) · out_w

(the in-kernel split merge's arithmetic, ``decode.merge``). A row no shard saw (every
``lse_w`` = -inf) gives zeros and -inf.

Inputs as ``torch.distributed.all_gather_into_tensor`` leaves them: ``outs`` bf16
``[W, b, s_q, h, 512]`` and ``lses`` fp32 ``[W, b, h, s_q]``; outputs ``out`` bf16
``[b, s_q, h, 512]`` and ``lse`` fp32 ``[b, h, s_q]``. A thread owns 8 output dims of one
row (one 16-byte load per shard), 64 threads a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from snapmla_cute import jit_cache
from snapmla_cute.format import CONTENT_DIM
from snapmla_cute.kernels import fake
from snapmla_cute.kernels.views import view

NAME = "lse_merge"
VEC = 8  # bf16 per thread: one 16-byte load
THREADS_PER_ROW = CONTENT_DIM // VEC  # 64


@dataclass(frozen=True)
class LseMergeConfig:
    s_q: int
    heads: int
    rows_per_cta: int = 4  # 256 threads


class LseMergeKernel:
    def __init__(self, cfg: LseMergeConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        m_outs: cute.Tensor,  # bf16 [W, b, s_q, h, 512]
        m_lses: cute.Tensor,  # fp32 [W, b, h, s_q]
        m_out: cute.Tensor,  # bf16 [b, s_q, h, 512]
        m_lse: cute.Tensor,  # fp32 [b, h, s_q]
        stream,
    ):
        s_q, h = self.cfg.s_q, self.cfg.heads
        W = m_outs.shape[0]
        b = m_out.shape[0]
        n = b * (s_q * h)  # rows r = (i·s_q + t)·h + head
        rows_lse = (h, s_q, b)  # the same rows as a coordinate (head, t, i) of the LSE layout
        outs = view(m_outs, (W, n, CONTENT_DIM), (m_outs.stride[0], CONTENT_DIM, 1))
        lses = view(m_lses, (W, rows_lse), (m_lses.stride[0], (s_q, 1, h * s_q)))
        out = view(m_out, (n, CONTENT_DIM), (CONTENT_DIM, 1))
        lse = view(m_lse, (rows_lse,), ((s_q, 1, h * s_q),))
        rows = self.cfg.rows_per_cta
        self.kernel(outs, lses, out, lse, n).launch(
            grid=[cute.ceil_div(n, rows), 1, 1],
            block=[THREADS_PER_ROW * rows, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, outs: cute.Tensor, lses: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.cfg.rows_per_cta + tidx // THREADS_PER_ROW
        chunk = tidx % THREADS_PER_ROW
        W = outs.shape[0]
        if row < n:
            m = -Float32.inf
            for w in cutlass.range(W, unroll=1):
                m = cute.arch.fmax(m, lses[w, row])
            total = Float32(0.0)
            if m != -Float32.inf:
                for w in cutlass.range(W, unroll=1):
                    total += cute.math.exp(lses[w, row] - m)
            res_lse = -Float32.inf
            if m != -Float32.inf:
                res_lse = m + cute.math.log(total)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            if res_lse != -Float32.inf:
                for w in cutlass.range(W, unroll=1):
                    src = cute.make_rmem_tensor((VEC,), BFloat16)
                    cute.autovec_copy(cute.local_tile(outs[w, row, None], (VEC,), (chunk,)), src)
                    acc.store(acc.load() + src.load().to(Float32) * cute.math.exp(lses[w, row] - res_lse))
            res = cute.make_rmem_tensor((VEC,), BFloat16)
            res.store(acc.load().to(BFloat16))
            cute.autovec_copy(res, cute.local_tile(out[row, None], (VEC,), (chunk,)))
            if chunk == 0:
                lse[row] = res_lse


def fake_args(config: LseMergeConfig):
    """Natural (contiguous PyTorch) layouts; W and the batch symbolic, the gathered batch its
    own size (a call whose shapes disagree is rejected by ``distributed.merge_partials``' checks
    first)."""
    s_q, h = config.s_q, config.heads
    R = s_q * h
    W, b, wb = fake.sym(), fake.sym(), fake.sym()
    t = fake.tensor
    return (
        t(BFloat16, (W, wb, s_q, h, CONTENT_DIM), (fake.sym(), R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(Float32, (W, wb, h, s_q), (fake.sym(), R, s_q, 1), 4),
        t(BFloat16, (b, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), 16),
        t(Float32, (b, h, s_q), (R, s_q, 1), 4),
        fake.stream(),
    )


def compile(config: LseMergeConfig, *, arch: str | None = None, keep_sass: bool = False):
    """The compiled merge for ``config`` (cached in memory and on disk: ``jit_cache``)."""
    return jit_cache.compile_kernel(NAME, config, LseMergeKernel, fake_args, arch=arch, keep_sass=keep_sass)
