"""Fake tensors for compiling kernels without a GPU (and without real data): the argument
builders beside each kernel use these. Sizes that vary per call are symbolic
(``cute.sym_int``), so one compiled object serves every batch; strides are static, so the
compiled call's argument decoder checks them."""

from __future__ import annotations


def stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


def tensor(dtype, shape, stride, align: int):
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def sym():
    import cutlass.cute as cute

    return cute.sym_int()


def rows_in(n):
    """bf16 ``[n, 576]`` rows split into their content and RoPE views."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM

    bf16 = cutlass.BFloat16
    return (
        tensor(bf16, (n, CONTENT_DIM), (HEAD_DIM, 1), 16),
        tensor(bf16, (n, ROPE_DIM), (HEAD_DIM, 1), 16),
    )


def cache_views(slots):
    """The uint8 ``[slots, 640]`` cache split into content bytes and bf16 RoPE, and the fp32 scales."""
    import cutlass

    from snapmla_cute.format import CONTENT_DIM, KV_ROW_BYTES, ROPE_DIM

    return (
        tensor(cutlass.Uint8, (slots, CONTENT_DIM), (KV_ROW_BYTES, 1), 16),
        tensor(cutlass.BFloat16, (slots, ROPE_DIM), (KV_ROW_BYTES // 2, 1), 16),
        tensor(cutlass.Float32, (slots,), (1,), 4),
    )


def cache(page_size: int):
    """An FP8 cache as ``FP8KVCache`` holds it: ``kv`` uint8 ``[pages, page_size, 640]`` and
    ``kv_scale`` fp32 ``[pages, page_size]``, pages symbolic."""
    import cutlass

    from snapmla_cute.format import KV_ROW_BYTES

    pages = sym()
    return (
        tensor(cutlass.Uint8, (pages, page_size, KV_ROW_BYTES), (page_size * KV_ROW_BYTES, KV_ROW_BYTES, 1), 16),
        tensor(cutlass.Float32, (pages, page_size), (page_size, 1), 16),
    )
