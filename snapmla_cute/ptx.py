"""Thin inline-PTX wrappers the DSL does not expose, at the lowest level: the kernels and
``pipelines`` both import them (nothing of ours is imported here). ldmatrix.trans /
stmatrix with explicit per-lane shared-memory addresses (the V transposition), cp.async with
zero fill and its mbarrier arrival (the sparse gather), distributed shared memory and
cluster-scope mbarriers (the cluster merge), ``launder`` and ``trap``; stmatrix.trans and
the e4m3 packing of Pᵀ (``profiles/experiments/small_batch_skeleton.py``'s ETAP compute)."""

from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as _T, dsl_user_op


def _asm(result, operands, text, constraints, loc, ip):
    """One volatile inline-asm statement (never reordered away or merged)."""
    return llvm.inline_asm(
        result, operands, text, constraints,
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


@dsl_user_op
def ldsm_x4_trans(smem_addr: Int32, *, loc=None, ip=None):
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` → four b32 registers."""
    res = _asm(
        llvm.StructType.get_literal([_T.i32(), _T.i32(), _T.i32(), _T.i32()]),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        loc, ip,
    )
    return tuple(Int32(llvm.extractvalue(_T.i32(), res, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def stsm_x4(smem_addr: Int32, r0: Int32, r1: Int32, r2: Int32, r3: Int32, *, loc=None, ip=None):
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16 [addr], {r0..r3}``."""
    _asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (smem_addr, r0, r1, r2, r3)],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r,~{memory}",
        loc, ip,
    )


@dsl_user_op
def stsm_x2_trans(smem_addr: Int32, r0: Int32, r1: Int32, *, loc=None, ip=None):
    """``stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [addr], {r0, r1}``: lanes 0-7 give
    matrix 0's row addresses, lanes 8-15 matrix 1's; element (i, j) of a lane-held matrix
    lands in stored row j, position i."""
    _asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (smem_addr, r0, r1)],
        "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [$0], {$1, $2};",
        "r,r,r,~{memory}",
        loc, ip,
    )


@dsl_user_op
def pack_e4m3x4(a0, a1, a2, a3, *, loc=None, ip=None) -> Int32:
    """Four fp32 → one word of e4m3 codes, byte i = ``ai`` (``cvt.rn.satfinite.e4m3x2.f32``
    twice: round to nearest even, saturating at ±448)."""
    from cutlass import Float32

    res = _asm(
        _T.i32(),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (a0, a1, a2, a3)],
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f",
        loc, ip,
    )
    return Int32(res)


@dsl_user_op
def trap(*, loc=None, ip=None):
    """``trap;``: abort the kernel (the launch then fails with an error on the host)."""
    _asm(None, [], "trap;", "", loc, ip)


@dsl_user_op
def launder(x: Int32, dep: Int32, *, loc=None, ip=None) -> Int32:
    """``x``, as the result of a volatile ``prmt`` that also reads ``dep`` (bytes of x only):
    values derived from it cannot be hoisted above a loop in which ``dep`` varies. The
    transposer WG (40 registers) uses it so ptxas recomputes its lane addresses per block
    instead of keeping (and spilling) all of them."""
    res = _asm(
        _T.i32(),
        [Int32(x).ir_value(loc=loc, ip=ip), Int32(dep).ir_value(loc=loc, ip=ip)],
        "prmt.b32 $0, $1, $2, 0x3210;",
        "=r,r,r",
        loc, ip,
    )
    return Int32(res)


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """``createpolicy.fractional.L2::evict_first.b64 p, 1.0``: an L2 cache policy for
    ``cp_async_or_zero`` (the lines it reads are the first to go)."""
    return Int64(_asm(_T.i64(), [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l", loc, ip))


@dsl_user_op
def cp_async_or_zero(smem_addr: Int32, gmem_addr, nbytes: int, read: Int32, policy=None, *, loc=None, ip=None):
    """``cp.async.{cg|ca}.shared.global [smem], [gmem], nbytes, ignore-src``: ``nbytes`` from
    ``gmem`` where ``read`` is nonzero, else zeros (``gmem`` is then not dereferenced, so it
    may be any value: no select of a safe address before the copy). ``policy``: an L2 cache
    policy (``.L2::cache_hint``), e.g. ``l2_evict_first_policy()``."""
    cache = "cg" if nbytes == 16 else "ca"
    ops = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
           Int32(read).ir_value(loc=loc, ip=ip)]
    if policy is None:
        text = f"{{ .reg .pred z; setp.eq.s32 z, $2, 0; cp.async.{cache}.shared.global [$0], [$1], {nbytes}, z; }}"
        constraints = "r,l,r,~{memory}"
    else:
        ops.append(Int64(policy).ir_value(loc=loc, ip=ip))
        text = (f"{{ .reg .pred z; setp.eq.s32 z, $2, 0; "
                f"cp.async.{cache}.shared.global.L2::cache_hint [$0], [$1], {nbytes}, z, $3; }}")
        constraints = "r,l,r,l,~{memory}"
    _asm(None, ops, text, constraints, loc, ip)


@dsl_user_op
def cp_async_arrive_noinc(mbar_addr: Int32, *, loc=None, ip=None):
    """``cp.async.mbarrier.arrive.noinc``: one arrival on the mbarrier once this thread's
    earlier cp.async copies have landed (counted in the barrier's expected arrivals)."""
    _asm(
        None, [Int32(mbar_addr).ir_value(loc=loc, ip=ip)],
        "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r,~{memory}", loc, ip,
    )


# ---- distributed shared memory (a cluster's CTAs), for the cluster merge


@dsl_user_op
def mapa(smem_addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """``mapa.shared::cluster.u32``: the shared::cluster address of ``smem_addr`` (this
    CTA's shared window) in the CTA of cluster rank ``rank``."""
    res = _asm(
        _T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", loc, ip,
    )
    return Int32(res)


@dsl_user_op
def st_cluster_v4(cluster_addr: Int32, a, b, c, d, *, loc=None, ip=None):
    """``st.shared::cluster.v4.f32``: 16 bytes into a cluster CTA's shared memory."""
    from cutlass import Float32

    _asm(
        None,
        [Int32(cluster_addr).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "st.shared::cluster.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f,~{memory}", loc, ip,
    )


@dsl_user_op
def st_cluster_f32(cluster_addr: Int32, a, *, loc=None, ip=None):
    """``st.shared::cluster.f32``."""
    from cutlass import Float32

    _asm(
        None, [Int32(cluster_addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip)],
        "st.shared::cluster.f32 [$0], $1;", "r,f,~{memory}", loc, ip,
    )


@dsl_user_op
def mbar_arrive_cluster(cluster_addr: Int32, *, loc=None, ip=None):
    """``mbarrier.arrive.release.cluster.shared::cluster.b64``: one arrival on a cluster
    CTA's mbarrier, after (release, cluster scope) this thread's earlier writes."""
    _asm(
        None, [Int32(cluster_addr).ir_value(loc=loc, ip=ip)],
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];", "r,~{memory}", loc, ip,
    )


@dsl_user_op
def mbar_try_wait_cluster(smem_addr: Int32, phase: Int32, *, loc=None, ip=None) -> Int32:
    """``mbarrier.try_wait.parity.acquire.cluster``: 1 once this CTA's mbarrier completed
    phase ``phase`` (the writes released before its arrivals, from any cluster CTA, are
    then visible), else 0 after the hardware's wait slice."""
    res = _asm(
        _T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
        "=r,r,r,~{memory}", loc, ip,
    )
    return Int32(res)


@dsl_user_op
def pow2_normalizer(amax, *, loc=None, ip=None):
    """(f, 1/f), powers of two, for a magnitude ``amax`` >= 0: amax·f in [2^14, 2^15), so
    f16 holds it and everything down to 2^-24 of it with full precision (f at most 2^126,
    so 1/f is a normal float; amax = 0 gives 2^126, inf or NaN 2^-114; under 2^-112 the
    cap leaves amax·f below 2^14). From the exponent
    bits: x = min(268 - e, 253), f = 2^(x - 127), 1/f = 2^(127 - x)."""
    from cutlass import Float32

    res = _asm(
        llvm.StructType.get_literal([_T.f32(), _T.f32()]),
        [Float32(amax).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 e, x; mov.b32 e, $2; shr.u32 e, e, 23; and.b32 e, e, 255; sub.s32 x, 268, e; "
        "min.s32 x, x, 253; shl.b32 $0, x, 23; sub.s32 x, 254, x; shl.b32 $1, x, 23; }",
        "=f,=f,f",
        loc, ip,
    )
    return tuple(Float32(llvm.extractvalue(_T.f32(), res, [k], loc=loc, ip=ip)) for k in range(2))
