"""The online softmax of Alg. 1 with V-scale fusion and block-wise P quantization (§3.2).

``OnlineSoftmax`` holds a consumer thread's rows' running state in registers: the running
max m (log2 domain), σ_p, ℓ, this block's γ and the other WG's γ_o, plus per row σ_q·scale·log2e
(``q_fac``) and the visible key count (``n_vis``, causal). ``step`` turns one block's QK
accumulator into P'/σ_p (ready for the e4m3 cast) and updates the state. The state is not
carried in registers across blocks: the two consumer WGs alternate blocks and exchange it
through shared memory (``pipelines.handshakes.PairExchange``).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from snapmla_cute.format import FP8_MAX
from snapmla_cute import ptx
from snapmla_cute.kernels.decode.config import INV_FP8_MAX, P_TINY
from snapmla_cute.layouts import smem as L


def tree(vals, op):
    """op over vals as a balanced tree (depth log2 n instead of an n-deep chain)."""
    vals = list(vals)
    while len(vals) > 1:
        nxt = [op(vals[k], vals[k + 1]) for k in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


@dataclass(frozen=True)
class OnlineSoftmax:
    """Per-thread softmax state over a thread's rows (register tensors; ``create`` makes them
    in this order). Frozen: the DSL passes it unchanged through run-time loops; its methods
    write the tensors in place."""

    cfg: object
    row_max: object
    row_sum: object
    sigma_p: object
    gamma: object  # of my block
    gamma_o: object  # of the other WG's block
    q_fac: object
    n_vis: object

    @classmethod
    def create(cls, cfg, rows: int):
        f32 = [cute.make_rmem_tensor((rows,), Float32) for _ in range(6)]
        return cls(cfg, *f32, cute.make_rmem_tensor((rows,), Int32))

    def own_state(self):
        """(m, σ_p, ℓ, γ) as this WG publishes them for its block."""
        return self.row_max, self.sigma_p, self.row_sum, self.gamma

    def other_state(self):
        """(m, σ_p, ℓ, γ_o) as read from the other WG's block (or this WG's last, at the end)."""
        return self.row_max, self.sigma_p, self.row_sum, self.gamma_o

    @cute.jit
    def start_request(self, c_s_mn, m_q_scale, m_tile, req, seqlen, scale_log2, m_visible=None):
        """A request's rows: empty state, σ_q·scale·log2e and the visible keys per row
        (causal: ``seqlen - s_q + 1 + t``, or ``m_visible[t, req]`` clamped to that and
        ``seqlen`` with ``DecodeConfig.visible``)."""
        cfg = self.cfg
        # the dynamic `if` below writes locals: writing self.* there carries self, config
        # included, through it (a profiling config's ``skip`` strings cannot be)
        q_fac, n_vis = self.q_fac, self.n_vis
        for i in cutlass.range_constexpr(cute.size(c_s_mn, mode=[0])):
            # laundered: row // heads is recomputed per request, not kept live (spilled)
            row = ptx.launder(m_tile * L.M_TILE + c_s_mn[i, 0][0], req)
            self.row_max[i] = -Float32.inf
            self.row_sum[i] = 0.0
            self.sigma_p[i] = 1.0
            q_fac[i] = scale_log2
            n_vis[i] = seqlen
            if row < cfg.rows:
                q_fac[i] = m_q_scale[row, req] * scale_log2  # σ_q·scale·log2e, once per row
                if cutlass.const_expr(cfg.causal):
                    n_vis[i] = seqlen - cfg.s_q + row // cfg.heads + 1
                    if cutlass.const_expr(cfg.visible):
                        # the causal window is what the unmasked-block test assumes
                        n_vis[i] = min(max(m_visible[row // cfg.heads, req], n_vis[i]), seqlen)

    @cute.jit
    def reset(self):
        """The state before a request's first block."""
        for i in cutlass.range_constexpr(cute.size(self.row_max)):
            self.row_max[i] = -Float32.inf
            self.row_sum[i] = 0.0
            self.sigma_p[i] = 1.0

    @cute.jit
    def stand_in(self):
        """Profiling only (``skip`` "softmax"): a finite state (m 0, σ_p 1, ℓ 1, γ 1) in place
        of the step's. With the reset state left, every row's LSE was -inf and the merge skips
        a row of -inf (it reads no partial), so a "no softmax" time also lost the merge's reads."""
        for i in cutlass.range_constexpr(cute.size(self.row_max)):
            self.row_max[i] = Float32(0.0)
            self.sigma_p[i] = Float32(1.0)
            self.row_sum[i] = Float32(1.0)
            self.gamma[i] = Float32(1.0)

    @cute.jit
    def step(self, acc_s_mn, c_s_mn, ks_pre, blk, valid, first_blk, masked: cutlass.Constexpr):
        """Alg. 1 lines 4-9 for this thread's rows: scores in the log2 domain, P = 2^(s-m),
        P' = P·σ_k, σ_p = rowmax(P')/448, P'/σ_p left in ``acc_s_mn`` for the e4m3 cast;
        updates (m, σ_p, ℓ) and this block's γ. ``ks_pre``: σ_k of this thread's columns,
        loaded by the caller before its state wait (in here the loads' latency was on the
        chain between the WGs).

        s = t·q_fac with t = acc·σ_k: the row max is q_fac·max(t) (rounding is monotone, so
        bit-equal to the max of the rounded s) and 2^(s-m) takes t·q_fac - m as one FFMA.
        ``masked`` (a request's last block, or causal rows): columns past a row's visible
        length get t = -inf and σ_k = 0 (those slots may hold NaN; their P is 0, and 0·0
        keeps P' clean without a per-element test); whole blocks skip both. Sparse: a key
        the producer zero-filled (σ_k = 0) gets t = -inf in every block."""
        rows_per_thr = cute.size(c_s_mn, mode=[0])
        cols_per_thr = cute.size(c_s_mn, mode=[1])
        q_fac = self.q_fac
        row_max = self.row_max
        row_sum = self.row_sum
        sigma_p = self.sigma_p
        ks = cute.make_rmem_tensor((cols_per_thr,), Float32)
        bias = [None] * cols_per_thr
        for j in cutlass.range_constexpr(cols_per_thr):
            c = c_s_mn[0, j][1]
            ks[j] = ks_pre[j]
            if cutlass.const_expr(self.cfg.sparse):
                # a masked key of the index list (zero-filled: σ_k = 0; a written slot's is
                # > 0): t = acc·0 - inf
                bj = Float32(0.0)
                if ks_pre[j] <= Float32(0.0):
                    ks[j] = 0.0
                    bj = -Float32.inf
                bias[j] = bj
            if cutlass.const_expr(masked):
                if c >= valid:
                    ks[j] = 0.0
        # Phases over all of this thread's rows (not row after row), reductions as trees:
        # the rows' chains interleave and no reduction is a 16-deep dependent chain (the
        # row-by-row form ran ~2300 cycles per block for ~440 instructions, latency-bound).
        t_max = [None] * rows_per_thr
        for i in cutlass.range_constexpr(rows_per_thr):
            lim = self.n_vis[i] - blk * L.BLOCK_N  # visible columns of this row in the block
            ts = []
            for j in cutlass.range_constexpr(cols_per_thr):
                t = acc_s_mn[i, j] * ks[j]
                if cutlass.const_expr(self.cfg.sparse):
                    t = t + bias[j]  # + 0 leaves acc·σ_k as it is
                if cutlass.const_expr(masked):
                    if c_s_mn[i, j][1] >= lim:
                        t = -Float32.inf
                acc_s_mn[i, j] = t
                ts.append(t)
            t_max[i] = tree(ts, cute.arch.fmax)
        for off in (2, 1):  # the quad's max, rows interleaved
            for i in cutlass.range_constexpr(rows_per_thr):
                t_max[i] = cute.arch.fmax(t_max[i], cute.arch.shuffle_sync_bfly(t_max[i], offset=off))
        m_prev = [None] * rows_per_thr
        m_new = [None] * rows_per_thr
        m_safe = [None] * rows_per_thr
        sums = [None] * rows_per_thr
        p_max = [None] * rows_per_thr
        for i in cutlass.range_constexpr(rows_per_thr):
            mp = row_max[i]
            if first_blk:
                mp = -Float32.inf
            m_prev[i] = mp
            mn = cute.arch.fmax(mp, t_max[i] * q_fac[i])
            ms = mn
            if mn == -Float32.inf:
                ms = 0.0
            m_new[i] = mn
            m_safe[i] = ms
        for i in cutlass.range_constexpr(rows_per_thr):
            ps = []
            pfs = [Float32(0.0)]
            for j in cutlass.range_constexpr(cols_per_thr):
                p = cute.math.exp2(acc_s_mn[i, j] * q_fac[i] - m_safe[i], fastmath=True)  # one FFMA
                pf = p * ks[j]  # P' = P·σ_k
                acc_s_mn[i, j] = pf
                ps.append(p)
                pfs.append(pf)
            sums[i] = tree(ps, lambda a, b: a + b)
            p_max[i] = tree(pfs, cute.arch.fmax)
        for off in (2, 1):
            for i in cutlass.range_constexpr(rows_per_thr):
                sums[i] = sums[i] + cute.arch.shuffle_sync_bfly(sums[i], offset=off)
                p_max[i] = cute.arch.fmax(p_max[i], cute.arch.shuffle_sync_bfly(p_max[i], offset=off))
        for i in cutlass.range_constexpr(rows_per_thr):
            sig_prev = sigma_p[i]
            if first_blk:
                sig_prev = 1.0
            # one division either way: 448/P'max, or 1/σ_p,prev for a negligible block
            num = Float32(1.0)
            den = sig_prev
            sig_cur = sig_prev
            if p_max[i] > Float32(P_TINY):
                num = Float32(FP8_MAX)
                den = p_max[i]
                sig_cur = p_max[i] * Float32(INV_FP8_MAX)  # one FMUL: σ_p's definition
            inv = num / den
            for j in cutlass.range_constexpr(cols_per_thr):
                acc_s_mn[i, j] = acc_s_mn[i, j] * inv
            g = Float32(0.0)
            if m_prev[i] != -Float32.inf:
                g = cute.math.exp2(m_prev[i] - m_safe[i], fastmath=True) * sig_prev * inv
            ell = row_sum[i]
            if first_blk:
                ell = 0.0
            row_sum[i] = g * ell + sums[i] * inv
            row_max[i] = m_new[i]
            sigma_p[i] = sig_cur
            self.gamma[i] = g
