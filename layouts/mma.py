"""Views of warpgroup-MMA register fragments (call while tracing a kernel).

``acc_mn_layout`` views an accumulator fragment as (rows of this thread, columns of this
thread), the indexing the softmax and the epilogue use; ``c_to_a_layout`` views an
accumulator's registers as the A-operand fragment of a following register-A WGMMA (the P
of the PV product). The same helpers as CUTLASS's Hopper ``fmha.py`` example.
"""

from __future__ import annotations


def _separate(thr, src, ref):
    import cutlass.cute as cute

    lt = cute.make_layout(())
    ge = cute.make_layout(())
    for k, v in enumerate(ref):
        if v < thr:
            lt = cute.append(lt, src[k])
        else:
            ge = cute.append(ge, src[k])
    if cute.rank(lt) == 1:
        return cute.append(lt, ge)
    return cute.append(cute.append(cute.make_layout(()), lt), ge)


def _pair(a, b):
    """(a, b) as a rank-2 layout, a kept whole when it is not rank 1."""
    import cutlass.cute as cute

    if cute.rank(a) == 1:
        return cute.append(a, b)
    return cute.append(cute.append(cute.make_layout(()), a), b)


def acc_mn_layout(tiled_mma, acc):
    """The layout of accumulator fragment ``acc`` viewed as (rows of this thread, cols of
    this thread)."""
    separated = _separate(tiled_mma.shape_mnk[0], acc[0], tiled_mma.tv_layout_C.stride[1])
    return _pair(_pair(separated[0], acc[1]), _pair(separated[1], acc[2]))


def c_to_a_layout(c, a):
    """Accumulator layout ``c`` regrouped as A-operand fragment values ``a`` per k-block."""
    import cutlass.cute as cute

    return cute.make_layout(
        (a, c.shape[1], (c.shape[2], cute.size(c, mode=[0]) // cute.size(a))),
        stride=(c.stride[0], c.stride[1], (c.stride[2], cute.size(a, mode=[2]) * c.stride[0][2])),
    )
