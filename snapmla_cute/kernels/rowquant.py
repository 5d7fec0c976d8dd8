"""Per-row RoPE-aware FP8 quantization, as device helpers shared by the fused kernels.

One warp owns one 576-wide row (512 content + 64 RoPE dims). Lane ``l`` holds content
columns ``[16 l, 16 l + 16)`` (two 16-byte bf16 loads, one 16-byte e4m3 store) and RoPE
columns ``[2 l, 2 l + 2)``. The arithmetic is the one ``reference.quantize_rows`` specifies,
op for op, so the bytes match bit for bit:

    scale = max(amax(|content|), AMAX_FLOOR) / 448          (div.rn.f32)
    inv   = 1 / scale                                       (rcp.rn.f32)
    content_e4m3 = cvt.rn.satfinite(x * inv)
    rope_bf16    = cvt.rn.bf16(x * inv)                     (Eq. 6: RoPE pre-divided)
    lo_e4m3      = cvt.rn.satfinite(x * inv - content_e4m3) (the accurate mode's second term;
                                                             the difference is exact in fp32)
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float8E4M3FN, Uint8

from snapmla_cute.format import AMAX_FLOOR, CONTENT_DIM, FP8_MAX, ROPE_DIM

WARP = 32
CONTENT_PER_LANE = CONTENT_DIM // WARP  # 16
ROPE_PER_LANE = ROPE_DIM // WARP  # 2


@cute.jit
def load_row(content_row: cute.Tensor, rope_row: cute.Tensor, lane):
    """Loads this lane's 16 content and 2 RoPE values of one row into fp32 registers."""
    c_frag = cute.make_rmem_tensor((CONTENT_PER_LANE,), content_row.element_type)
    r_frag = cute.make_rmem_tensor((ROPE_PER_LANE,), rope_row.element_type)
    cute.autovec_copy(cute.local_tile(content_row, (CONTENT_PER_LANE,), (lane,)), c_frag)
    cute.autovec_copy(cute.local_tile(rope_row, (ROPE_PER_LANE,), (lane,)), r_frag)
    return c_frag.load().to(Float32), r_frag.load().to(Float32)


@cute.jit
def row_scale(content: cute.TensorSSA) -> Float32:
    """Per-row scale: warp-wide amax of the content part, floored, over the e4m3 max."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(CONTENT_PER_LANE):
        amax = cute.arch.fmax(amax, abs(content[i]))
    amax = cute.arch.warp_reduction(amax, cute.arch.fmax)
    return cute.arch.fmax(amax, Float32(AMAX_FLOOR)) / Float32(FP8_MAX)


@cute.jit
def store_quantized(
    content: cute.TensorSSA,
    rope: cute.TensorSSA,
    inv_scale: Float32,
    content_row: cute.Tensor,
    rope_row: cute.Tensor,
    lane,
    lo_row: cute.Tensor = None,
):
    """Writes e4m3(content * inv) (as bytes) and bf16(rope * inv) for this lane; with
    ``lo_row`` also e4m3(content * inv - that e4m3), the residual's codes (hi + lo)."""
    c_out = cute.make_rmem_tensor((CONTENT_PER_LANE,), Float8E4M3FN)
    scaled = content * inv_scale
    c_out.store(scaled.to(Float8E4M3FN))
    if cutlass.const_expr(lo_row is not None):
        lo_out = cute.make_rmem_tensor((CONTENT_PER_LANE,), Float8E4M3FN)
        lo_out.store((scaled - c_out.load().to(Float32)).to(Float8E4M3FN))
        cute.autovec_copy(cute.recast_tensor(lo_out, Uint8), cute.local_tile(lo_row, (CONTENT_PER_LANE,), (lane,)))
    r_out = cute.make_rmem_tensor((ROPE_PER_LANE,), BFloat16)
    r_out.store((rope * inv_scale).to(BFloat16))
    cute.autovec_copy(
        cute.recast_tensor(c_out, Uint8),
        cute.local_tile(content_row, (CONTENT_PER_LANE,), (lane,)),
    )
    cute.autovec_copy(r_out, cute.local_tile(rope_row, (ROPE_PER_LANE,), (lane,)))
