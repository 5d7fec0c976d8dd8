"""The in-kernel V transposition (content tile → Vᵀ), as a byte-level mapping on plain ints.

The decode kernel rewrites each 8 KiB chunk of the K-major SW128 content tile
(64 tokens x 128 dims) as the K-major SW64 Vᵀ chunk (128 dims x 64 tokens) in place, with
``ldmatrix.trans`` → ``prmt`` → ``stmatrix`` (FA3's FP8 V transpose, here in place). The
lane address maps below are the ones the kernel traces; ``transpose_ldsm_emulated`` replays
the program (PTX semantics of the three instructions) on a bytearray so the CPU tests check
it against ``smem.content_offset``/``vt_offset``.

Two token orders: natural (K position k of Vᵀ is token k) and π (``pi``, what the kernel's
``Transposer`` writes), the order in which the QK accumulator hands each lane
its columns, so that P needs no shuffles; each 32-wide k-step sums the same tokens either way.
``render_tokens`` / ``plot_tokens`` draw the Vᵀ and P tiles by token in either order.
"""

from __future__ import annotations

from snapmla_cute.layouts.smem import CHUNK_BYTES, content_offset, p_offset, vt_offset


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``sel_i`` of {b, a}."""
    pool = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 0x7] for i in range(4)), "little")


# --------------------------------------------------------------------------------------------
# The decode kernel's transposition: ldmatrix.trans -> prmt -> stmatrix (conflict-free)
# --------------------------------------------------------------------------------------------
#
# The owning warpgroup's 4 warps walk 16 steps; in step k warp w takes the unit of 32 tokens
# (tb = w % 2) x 16 dims (db = 2k + w // 2): one ``ldmatrix.m8n8.x4.trans.b16`` (lane l gives
# the row address of matrix m = l / 8, row i = l % 8: token tb*32 + 16*(m>>1) + (f(i) ^ 2*(m&1)),
# f = 0,1,4,5,10,11,14,15; dims db*16..+15), two ``prmt`` per register pair gathering 4
# consecutive tokens of one dim, one ``stmatrix.m8n8.x4.b16`` (lane l gives the row address
# of dim db*16 + 2i + ((m&1) ^ (i>>2)), tokens tb*32 + 16*(m>>1)..+15). Steps 4c..4c+3 cover
# chunk c exactly, so the rewrite is in place with one warpgroup barrier per chunk between
# its loads and its stores. Every 8-lane phase touches 8 distinct 16-byte bank groups on both
# sides (checked below), so neither side has bank conflicts.

LDSM_WARPS = 4
LDSM_STEPS = 16


def ldsm_unit(warp: int, step: int) -> tuple[int, int]:
    """(tb, db): the 32-token half and 16-dim group warp ``warp`` transposes in ``step``."""
    u = step * LDSM_WARPS + warp
    return u % 2, u // 2


def ldsm_lane(lane, pi: bool = False):
    """(token within the unit of the ldmatrix row address, dim within the unit of the stmatrix
    row address, first token within the unit of that stmatrix row) for ``lane``; plain
    integer ops so it traces on DSL ints too. ``pi``: Vᵀ in the token order π (``pi``
    below), where the ldmatrix rows are simply tokens ``lane``."""
    m = lane >> 3
    i = lane & 7
    if pi:
        return lane, 2 * i + ((m & 1) ^ (i >> 2)), 16 * (m >> 1)
    f = (i & 1) + 4 * (i >> 1) + 2 * (i >> 2)
    return 16 * (m >> 1) + (f ^ (2 * (m & 1))), 2 * i + ((m & 1) ^ (i >> 2)), 16 * (m >> 1)


def pi(k: int) -> int:
    """Token at K position ``k`` of Vᵀ and P in the order π (what the kernel ships):
    within each 16, k = 4q + i holds token (2q, 2q+1, 8+2q, 9+2q)[i] — the columns the QK
    accumulator gives lane q, in register order, so P is packed without quad shuffles.
    Every 32-wide k-step still sums the same tokens."""
    g, r = divmod(k, 16)
    q, i = divmod(r, 4)
    return 16 * g + (2 * q, 2 * q + 1, 8 + 2 * q, 9 + 2 * q)[i]


def ldsm_src(warp, lane, step: int, pi: bool = False):
    """Byte offset (in the content tile) of the ldmatrix row address of ``lane``."""
    tok, _, _ = ldsm_lane(lane, pi)
    tb = warp % 2
    db = (step * LDSM_WARPS + warp) // 2
    return content_offset(tb * 32 + tok, db * 16)


def stsm_dst(warp, lane, step: int):
    """Byte offset (in the Vᵀ tile) of the stmatrix row address of ``lane``."""
    _, dim, tok = ldsm_lane(lane)
    tb = warp % 2
    db = (step * LDSM_WARPS + warp) // 2
    return vt_offset(db * 16 + dim, tb * 32 + tok)


def _step_constants():
    """Per-step address constants: src(k) = src(0) ^ SRC_XOR[k] + SRC_ADD[k], dst(k) = dst(0) +
    DST_ADD[k], for every warp and lane and both token orders (verified here, at import)."""
    src_xor = [32 * (k % 4) for k in range(LDSM_STEPS)]
    src_add = [CHUNK_BYTES * (k // 4) for k in range(LDSM_STEPS)]
    dst_add = [2048 * k for k in range(LDSM_STEPS)]
    for order in (False, True):
        for w in range(LDSM_WARPS):
            for lane in range(32):
                s0, d0 = ldsm_src(w, lane, 0, order), stsm_dst(w, lane, 0)
                for k in range(LDSM_STEPS):
                    assert ldsm_src(w, lane, k, order) == (s0 ^ src_xor[k]) + src_add[k]
                    assert stsm_dst(w, lane, k) == d0 + dst_add[k]
    return src_xor, src_add, dst_add


SRC_XOR, SRC_ADD, DST_ADD = _step_constants()


# prmt selectors of the two stored words (dims 2c, 2c+1) from one ldmatrix register pair:
# bytes 0/2/4/6 and 1/3/5/7, or those pairs swapped (natural order, lanes with q >= 2)
SEL_WORDS = (0x6420, 0x7531)
SEL_WORDS_SWAPPED = (0x2064, 0x3175)


def prmt_selectors(lane, pi: bool = False):
    """(sel0, sel1) of ``lane``: sel0 builds the word of dim 2c (2c+1 when c >= 4), sel1 the
    other, each from the two b16 registers of one ldmatrix matrix pair (c = lane / 4).
    Natural order: tokens 4q.. of the pair (the lane map above interleaves them so that
    the bytes 0/2 or 2/0 are the pair's); ``pi``: tokens 2q, 2q+1 of each register."""
    q = lane & 3
    c = lane >> 2
    even, odd = SEL_WORDS if q < 2 or pi else SEL_WORDS_SWAPPED
    return (odd, even) if c >= 4 else (even, odd)


def keep_bytes(n):
    """Mask of the low bytes of a word: the first ``n`` (clamped to 0..4) kept."""
    return 0xFFFFFFFF if n >= 4 else (0 if n <= 0 else (1 << (8 * n)) - 1)


def ldsm_keep_masks(warp, lane, valid_tokens, pi: bool = False):
    """Byte masks zeroing tokens >= ``valid_tokens`` in the two stored word groups of a lane
    (tokens tb*32 + 4q.. for registers 0, 1 and tb*32 + 16 + 4q.. for 2, 3; with ``pi``
    tokens t0, t0+1, t0+8, t0+9 from t0 = tb*32 + 2q and t0 + 16)."""
    out = []
    if pi:
        first = (warp % 2) * 32 + 2 * (lane & 3)
        for t0 in (first, first + 16):
            n = valid_tokens - t0
            out.append((keep_bytes(n) & 0xFFFF) | ((keep_bytes(n - 8) & 0xFFFF) << 16))
        return out
    first = (warp % 2) * 32 + 4 * (lane & 3)
    return [keep_bytes(valid_tokens - t0) for t0 in (first, first + 16)]


def transpose_ldsm_emulated(buf: bytearray, valid_tokens: int = 64, pi: bool = False) -> None:
    """Replays the kernel's ldmatrix.trans / prmt / stmatrix program on a 32 KiB tile, chunk by
    chunk (all loads of a chunk before its stores), so the CPU tests check it byte for byte.
    ``pi``: the token order π (K position k of Vᵀ holds token ``pi(k)``)."""

    def b16(off):
        return int.from_bytes(buf[off : off + 2], "little")

    for c in range(4):
        regs = {}
        for k in range(4 * c, 4 * c + 4):
            for w in range(LDSM_WARPS):
                # row addresses given by the lanes: matrix m, row i -> 16 bytes = 8 b16 elements
                rows = {(l >> 3, l & 7): ldsm_src(w, l, k, pi) for l in range(32)}
                for t in range(32):
                    q, col = t & 3, t >> 2
                    # .trans: thread t gets element (row 2q, 2q+1; column col) of each matrix
                    regs[(k, w, t)] = [
                        b16(rows[(m, 2 * q)] + 2 * col) | (b16(rows[(m, 2 * q + 1)] + 2 * col) << 16)
                        for m in range(4)
                    ]
        for k in range(4 * c, 4 * c + 4):
            for w in range(LDSM_WARPS):
                dst_rows = {(l >> 3, l & 7): stsm_dst(w, l, k) for l in range(32)}
                for t in range(32):
                    r0, r1, r2, r3 = regs[(k, w, t)]
                    s0, s1 = prmt_selectors(t, pi)
                    lo_mask, hi_mask = ldsm_keep_masks(w, t, valid_tokens, pi)
                    words = [prmt(r0, r1, s0) & lo_mask, prmt(r0, r1, s1) & lo_mask,
                             prmt(r2, r3, s0) & hi_mask, prmt(r2, r3, s1) & hi_mask]
                    # stmatrix: register j is matrix j; thread t holds row t/4, bytes 4(t%4)..+3
                    for j in range(4):
                        off = dst_rows[(j, t >> 2)] + 4 * (t & 3)
                        buf[off : off + 4] = words[j].to_bytes(4, "little")


# ------------------------------------------------------------------------------------------
# The token order π (what the kernel ships)
# ------------------------------------------------------------------------------------------
#
# K position k of the Vᵀ and P tiles holds token ``pi(k)``. π moves tokens only inside each
# group of 16, i.e. inside one 16-byte unit of a tile row, so ``smem.render`` and
# ``smem.plot`` (the unit of element (row, K position)) are the same in both orders. The
# functions below index by token and show where its byte lands, unit and byte.

_pi_of = pi  # for the functions below, whose flag ``pi`` shadows it


def token_position(token: int, pi: bool = True) -> int:
    """K position of ``token`` in the Vᵀ / P tiles: π⁻¹(token), or ``token`` with ``pi=False``."""
    if not pi:
        return token
    base = token - token % 16
    return next(k for k in range(base, base + 16) if _pi_of(k) == token)


def token_offset(kind: str, row: int, token: int, pi: bool = True) -> int:
    """Byte offset of ``token`` of ``row`` (a dim of ``vt``, a query row of ``p``) when the
    tile's K positions hold tokens in the order π (``pi=False``: natural, position = token)."""
    fn = {"vt": vt_offset, "p": p_offset}[kind]
    return fn(row, token_position(token, pi))


def _order_name(pi: bool) -> str:
    return "token order π (kernel default)" if pi else "natural token order (the reference π is defined against)"


def render_tokens(kind: str = "vt", rows: int = 8, cols: int = 16, pi: bool = True) -> str:
    """A text picture of a corner of the Vᵀ or P tile by token: ``unit.byte`` (16-byte unit
    index, byte inside it) of element (row, token) in the order π (or natural)."""
    lines = [f"{kind}, {_order_name(pi)}: 16-byte unit.byte of element (row, token), top-left {rows}x{cols}"]
    for r in range(rows):
        offsets = [token_offset(kind, r, t, pi) for t in range(cols)]
        lines.append(" ".join(f"{o // 16:3d}.{o % 16:02d}" for o in offsets))
    return "\n".join(lines)


def plot_tokens(kind: str = "vt", rows: int = 32, cols: int = 64, pi: bool = True, ax=None):
    """Draws where each token's byte of a Vᵀ or P tile corner lands (matplotlib): the byte
    offset mod 64 (its place in the swizzled 64-byte row) of element (row, token), in the
    order π (or natural). Natural order gives smooth runs of 16; π shows its pairs."""
    import matplotlib.pyplot as plt

    grid = [[token_offset(kind, r, t, pi) % 64 for t in range(cols)] for r in range(rows)]
    if ax is None:
        _, ax = plt.subplots(figsize=(cols / 6, rows / 6))
    ax.imshow(grid, cmap="viridis", interpolation="nearest")
    ax.set_title(f"{kind}, {_order_name(pi)}: byte (mod 64) of element (row, token)")
    ax.set_xlabel("token")
    ax.set_ylabel("dim" if kind == "vt" else "query row")
    return ax
