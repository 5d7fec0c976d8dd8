# Standalone experiment (out of place, separate buffers) that the decode kernel's in-place
# transposition grew from: a bank-conflict-free FP8 V transposition with ldmatrix.trans ->
# prmt -> stmatrix, checked bit-exact on an H200 (64x512 tile: 16 LDSM.16.MT88.4 + 64 PRMT +
# 16 STSM per warp, ~267 ns per tile with two CTAs per SM). The kernel's version, in place
# chunk by chunk with masking, is in snapmla_cute/kernels/decode/transposer.py and
# layouts/transpose.py.
"""
In-kernel FP8 V -> V^T shared-memory transpose for Hopper (SM90a) in CuTe DSL 4.8.1.

Source  sV : (T tokens, D dims) e4m3 bytes, K-major for the QK^T GEMM (dims contiguous),
             layout = make_smem_layout_b(ROW_MAJOR, (M, T, D), fp8, 1)   -> K_SW128 atoms
Dest    sVt: (D dims, T tokens) e4m3 bytes, K-major for the PV GEMM (tokens contiguous),
             layout = make_smem_layout_b(ROW_MAJOR, (M, D, T), fp8, 1)
             -> K_SW64 atoms when T == 64, K_SW128 atoms when T == 128.

Algorithm (per warp, per 32-token x 16-dim unit; dims never permuted; k_order="exact" keeps the token
order, k_order="mma" stores tokens in the order pi below):
  1. ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: 4 "8x8 b16" matrices, each = 8 token rows x
     16 dim-bytes.  Lane l (m=l/8, i=l%8) supplies the row address of matrix m, row i:
        token = tb*32 + 16*(m>>1) + (fA(i) ^ (2*(m&1))),  fA = [0,1,4,5,10,11,14,15]
        dims  = db*16 .. db*16+15
     (matrix 0/2 = "A" rows, 1/3 = "B" rows = A^2).  With .trans, thread t (q=t%4, c=t/4) gets
     r_m = {V[row 2q][2c], V[row 2q][2c+1], V[row 2q+1][2c], V[row 2q+1][2c+1]} (bytes 0..3).
  2. prmt: w = prmt(rA, rB, sel) gathers 4 consecutive tokens of ONE dim into a 32-bit word.
        even dim 2c : sel = 0x6420 (q<2) / 0x2064 (q>=2)     odd dim 2c+1 : 0x7531 / 0x3175
     Threads with c>=4 swap the two words (so each stmatrix matrix covers 8 distinct d mod 8).
  3. stmatrix.sync.aligned.m8n8.x4.shared.b16: matrix j = register j; lane l (m=l/8,i=l%8)
     supplies row address  d = db*16 + 2i + ((m&1) ^ (i>>2)),  tokens tb*32 + 16*(m>>1) .. +15.
k_order="mma": A rows = tokens 0..7, B rows = 8..15, selectors 0x6420/0x7531 for every thread; then
  sVt K-slot s holds token pi(s) = 16*(s//16) + 2*((s%16)//4) + (s&1) + 8*((s%4)>>1), i.e. thread q of
  the QK^T accumulator (which owns tokens 2q,2q+1,2q+8,2q+9) can pack its 4 fp32 -> e4m3 values
  directly into the FP8 WGMMA A-register (k = 4q..4q+3) -- no shuffles, as FA3 does.
Bank conflicts: every 8-row phase of ldmatrix hits tok%8 = {0,1,4,5,2,3,6,7} (all distinct 16B
chunks under Swizzle<3,4,3>), every stmatrix phase hits d%8 = all distinct (Swizzle<2,4,3> with
64B rows or Swizzle<3,4,3> with 128B rows) -> conflict-free on both sides.
"""

import argparse
import os

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Uint8, Float8E4M3FN, const_expr
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from snapmla_cute.ptx import ldsm_x4_trans, stsm_x4  # the kernel's own wrappers


@dsl_user_op
def prmt(a: Int32, b: Int32, sel: Int32, *, loc=None, ip=None) -> Int32:
    # cute.arch.prmt(src, src_reg_shifted, prmt_indices) emits the same "prmt.b32 $0,$1,$2,$3;"
    return Int32(cute.arch.prmt(a, b, sel, loc=loc, ip=ip))


# ----------------------------------------------------------------------------------------------
# the transpose itself (call from any warp-uniform group of `num_warps` warps)
# ----------------------------------------------------------------------------------------------
def _lane_coords(w, lane, n_tb, k_order="exact"):
    """Per-(warp, lane) base coordinates (pure integer math; works on Python ints and Int32)."""
    m = lane >> 3
    i = lane & 7
    if k_order == "exact":
        f_a = (i & 1) + 4 * (i >> 1) + 2 * (i >> 2)   # A rows: 0,1,4,5,10,11,14,15
        tok_ld = 16 * (m >> 1) + (f_a ^ (2 * (m & 1)))  # B rows = A ^ 2: 2,3,6,7,8,9,12,13
    else:  # "mma": A rows = tokens 0..7, B rows = 8..15 (token order pi, see module doc)
        tok_ld = 16 * (m >> 1) + 8 * (m & 1) + i
    dim_st = 2 * i + ((m & 1) ^ (i >> 2))              # stmatrix rows: d mod 8 all distinct
    tok_st = 16 * (m >> 1)
    tb_w = w % n_tb
    db_w = w // n_tb
    src = (tb_w * 32 + tok_ld, db_w * 16)              # (token, dim) in sV
    dst = (db_w * 16 + dim_st, tb_w * 32 + tok_st)     # (dim, token) in sVt
    return src, dst


def _plan(sV_layout, sVt_layout, num_warps, k_order="exact"):
    # the number of transposed dims is taken from sVt (D_v may be < D of sV, e.g. 512 of 576)
    """Trace-time (static) planning + exhaustive check of the XOR decomposition
    offset(base + step_k) == offset(base) ^ offset(step_k) for every warp/lane/k."""
    n_tok = cute.size(sV_layout, mode=[0])
    n_dim = cute.size(sVt_layout, mode=[0])
    assert cute.size(sVt_layout, mode=[1]) == n_tok and n_dim <= cute.size(sV_layout, mode=[1])
    n_tb = n_tok // 32
    n_units = n_tb * (n_dim // 16)
    assert n_units % num_warps == 0
    assert num_warps % n_tb == 0 or n_tb % num_warps == 0
    steps = []
    for k in range(n_units // num_warps):
        u = k * num_warps
        tb, db = u % n_tb, u // n_tb
        steps.append((cute.crd2idx((tb * 32, db * 16), sV_layout),
                      cute.crd2idx((db * 16, tb * 32), sVt_layout)))
    m_src = m_dst = 0
    for w in range(num_warps):
        for lane in range(32):
            (st, sd), (dd, dt) = _lane_coords(w, lane, n_tb, k_order)
            b_src = cute.crd2idx((st, sd), sV_layout)
            b_dst = cute.crd2idx((dd, dt), sVt_layout)
            m_src |= b_src
            m_dst |= b_dst
            for k in range(n_units // num_warps):
                u = k * num_warps
                tb, db = u % n_tb, u // n_tb
                assert cute.crd2idx((st + 32 * tb, sd + 16 * db), sV_layout) == b_src ^ steps[k][0]
                assert cute.crd2idx((dd + 16 * db, dt + 32 * tb), sVt_layout) == b_dst ^ steps[k][1]
    return n_tb, steps, m_src, m_dst


@cute.jit
def transpose_v_fp8(
    sV_addr: Int32,  # smem byte address of sV (1024B aligned)
    sV_layout: cute.ComposedLayout,  # (T, D) -> byte offset (swizzled), static
    sVt_addr: Int32,  # smem byte address of sVt (1024B aligned)
    sVt_layout: cute.ComposedLayout,  # (D, T) -> byte offset (swizzled), static
    warp: Int32,  # warp index inside the transposing group (warp-uniform)
    lane: Int32,
    num_warps: cutlass.Constexpr[int],
    ilp: cutlass.Constexpr[int] = 2,
    k_order: cutlass.Constexpr[str] = "exact",
):
    assert k_order in ("exact", "mma")
    n_tb, steps, m_src, m_dst = _plan(sV_layout, sVt_layout, num_warps, k_order)
    (st, sd), (dd, dt) = _lane_coords(warp, lane, n_tb, k_order)
    base_src = Int32(cute.crd2idx((st, sd), sV_layout))
    base_dst = Int32(cute.crd2idx((dd, dt), sVt_layout))

    # per-thread byte-permute selectors
    q = lane & 3
    c = lane >> 2
    if const_expr(k_order == "exact"):
        lo_first = q < 2
        sel_e = Int32(0x6420) if lo_first else Int32(0x2064)
        sel_o = Int32(0x7531) if lo_first else Int32(0x3175)
    else:
        sel_e = Int32(0x6420)
        sel_o = Int32(0x7531)
    swap = c >= 4
    sel0 = sel_o if swap else sel_e
    sel1 = sel_e if swap else sel_o

    # ILP: issue `ilp` LDSM.T back to back, then prmt + STSM (inline asm is volatile, so program
    # order is kept; without batching every LDSM->PRMT->STSM chain is fully serialized).
    n_k = len(steps)
    for k0 in cutlass.range_constexpr(0, n_k, ilp):
        regs = []
        for kk in cutlass.range_constexpr(min(ilp, n_k - k0)):
            c_src = steps[k0 + kk][0]
            # bits of the step that can collide with the per-thread base are XORed, the rest added
            # (add of disjoint bits == xor); the added part folds into the LDSM immediate.
            src = sV_addr + (base_src ^ (c_src & m_src)) + (c_src & ~m_src)
            regs.append(ldsm_x4_trans(src))
        for kk in cutlass.range_constexpr(min(ilp, n_k - k0)):
            c_dst = steps[k0 + kk][1]
            dst = sVt_addr + (base_dst ^ (c_dst & m_dst)) + (c_dst & ~m_dst)
            r0, r1, r2, r3 = regs[kk]
            w0 = prmt(r0, r1, sel0)  # dim 2c   (or 2c+1 if c>=4), tokens 4q..4q+3
            w1 = prmt(r0, r1, sel1)  # dim 2c+1 (or 2c   if c>=4)
            w2 = prmt(r2, r3, sel0)  # same, tokens 16+4q..
            w3 = prmt(r2, r3, sel1)
            stsm_x4(dst, w0, w1, w2, w3)


# ----------------------------------------------------------------------------------------------
# test harness kernel: gV (T, D) row-major bytes -> sV -> transpose -> sVt -> gVt (D, T)
# ----------------------------------------------------------------------------------------------
class VTransposeTest:
    def __init__(self, n_tok: int = 64, n_dim: int = 512, num_threads: int = 128, n_dim_src: int = 0,
                 k_order: str = "exact"):
        self.k_order = k_order
        assert n_tok % 32 == 0 and n_dim % 16 == 0
        self.n_tok, self.n_dim, self.num_threads = n_tok, n_dim, num_threads
        self.n_dim_src = n_dim_src or n_dim  # e.g. 576 (K tile incl. rope) while V uses 512

    @cute.jit
    def __call__(self, gV: cute.Tensor, gVt: cute.Tensor, iters: Int32, stream):
        # M (=64 heads) is irrelevant for B-operand layouts.
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (64, self.n_tok, self.n_dim_src), Float8E4M3FN, 1
        )
        sVt_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (64, self.n_dim, self.n_tok), Float8E4M3FN, 1
        )
        sV_layout = cute.slice_(sV_layout, (None, None, 0))
        sVt_layout = cute.slice_(sVt_layout, (None, None, 0))
        print("sV  layout:", sV_layout)
        print("sVt layout:", sVt_layout)

        @cute.struct
        class Storage:
            sV: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(sV_layout)], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(sVt_layout)], 1024]

        self.storage = Storage
        self.kernel(gV, gVt, iters, sV_layout, sVt_layout).launch(
            grid=[1, 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, gV: cute.Tensor, gVt: cute.Tensor, iters: Int32, sV_layout: cute.ComposedLayout,
               sVt_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        # swizzled views for the (slow, element-wise) harness copies
        sV = st.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sVt = st.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)

        # gmem -> sV (element-wise, harness only)
        for idx in range(tidx, self.n_tok * self.n_dim, self.num_threads):
            t = idx // self.n_dim
            d = idx % self.n_dim
            sV[t, d] = gV[t, d]
        cute.arch.sync_threads()

        # `iters` > 1 only for benchmarking (the transpose is idempotent)
        for _ in range(iters):
            transpose_v_fp8(
                st.sV.data_ptr().toint(), sV_layout,
                st.sVt.data_ptr().toint(), sVt_layout,
                warp, lane, self.num_threads // 32, 2, self.k_order,
            )
            cute.arch.sync_threads()

        # sVt -> gmem (element-wise, harness only)
        for idx in range(tidx, self.n_tok * self.n_dim, self.num_threads):
            d = idx // self.n_tok
            t = idx % self.n_tok
            gVt[d, t] = sVt[d, t]


def compile_test(n_tok: int, n_dim: int, dump_dir: str, n_dim_src: int = 0, k_order: str = "exact"):
    import cuda.bindings.driver as cuda

    from cutlass.cute.runtime import make_fake_compact_tensor

    gV = make_fake_compact_tensor(Uint8, (n_tok, n_dim_src or n_dim), stride_order=(1, 0),
                                  assumed_align=16)
    gVt = make_fake_compact_tensor(Uint8, (n_dim, n_tok), stride_order=(1, 0), assumed_align=16)
    stream = cuda.CUstream(0)
    os.makedirs(dump_dir, exist_ok=True)
    opts = f"--keep-sass --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return cute.compile(VTransposeTest(n_tok, n_dim, n_dim_src=n_dim_src, k_order=k_order), gV, gVt, Int32(1), stream,
                        options=opts)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--src-dim", type=int, default=0, help="dims of the source K tile (e.g. 576)")
    ap.add_argument("--k-order", default="exact", choices=["exact", "mma"])
    ap.add_argument("--dump", default="/tmp/research_vt/dump")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    fn = compile_test(a.tok, a.dim, a.dump, a.src_dim, a.k_order)
    arts = getattr(fn, "artifacts", None)
    print("compiled:", type(fn).__name__)
    if arts is not None:
        import collections, re
        sass = arts.SASS
        ops = collections.Counter(
            m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
        print("SASS instruction mix (whole test kernel, incl. harness byte copies):")
        for op, n in ops.most_common():
            print(f"  {n:5d} {op}")
