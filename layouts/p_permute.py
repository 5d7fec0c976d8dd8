"""The P accumulator → FP8 A-operand byte permutation, as a mapping on symbolic bytes.

After an m64nN QK WGMMA, lane ``t0 = lane % 4`` of a quad holds columns
``2 t0, 2 t0 + 1`` of every 8-column group for rows r and r + 8 (the C layout). The FP8 A
operand of the PV WGMMA wants ``4 t0 .. 4 t0 + 3`` of each 16-column half of a 32-wide k
block (the A layout). The kernel converts to e4m3 in place (C order, 4 bytes per 32-bit register), then
swaps registers inside each quad with two ``shfl`` and regroups bytes with ``prmt``
(0x5410/0x1054, 0x7632/0x3276) — CUTLASS's ``make_acc_into_op``. ``permute_quad`` replays
that on labels so tests can check every byte lands where the A layout expects it.

That is the natural token order (a compile option of the kernel until cc70d70). The kernel
keeps P's columns in the accumulator's order π (``transpose.pi``) and writes Vᵀ in the same
order: the packing is then one ``prmt`` per word inside each lane, no shuffles
(``pi_packed_labels``).
"""

from __future__ import annotations

from snapmla_cute.layouts.transpose import prmt

# The quad exchange's selectors (the kernel's ``acc_to_fp8_operand`` uses these names): the
# source lane of each lane's two shuffles (a nibble per lane), and the prmt orders of the two
# output words for a lane that sent its second register (KEEP) or its first (SWAP).
QUAD_SRC_A = 0x3021
QUAD_SRC_B = 0x2130
ORDER_KEEP = (0x5410, 0x7632)
ORDER_SWAP = (0x1054, 0x3276)
# π order: one prmt per output word, inside the lane
PI_ORDER = (0x5410, 0x7632)


def c_layout_labels(t0: int) -> list[int]:
    """Bytes of lane t0 for one 32-column k block after the e4m3 conversion, in C order:
    label ``32 * rr + col`` with rr = 0 for the thread's row r and 1 for row r + 8.
    C order is (column pair, row pair, 8-column group): 4 bytes per 32-bit register."""
    return [32 * rr + 8 * g + 2 * t0 + v for g in range(4) for rr in range(2) for v in range(2)]


def a_layout_labels(t0: int) -> list[int]:
    """What the FP8 A operand (m64k32, TV layout ((4,8,4),(4,2,2)):((256,1,16),(64,8,1024)))
    wants in lane t0's registers: 4 consecutive k, then row r + 8, then k + 16."""
    return [32 * rr + 16 * h + 4 * t0 + v for h in range(2) for rr in range(2) for v in range(4)]


def _pack(labels: list[int]) -> int:
    return int.from_bytes(bytes(labels), "little")


def _unpack(word: int) -> list[int]:
    return list(word.to_bytes(4, "little"))


def permute_quad(words: list[list[int]]) -> list[list[int]]:
    """The kernel's exchange for one 32-column k block of one row: ``words[t0]`` are lane
    t0's two 32-bit registers in C order; returns them after the two shuffles and ``prmt``.
    A shuffle returns the register the *source* lane offered, chosen by the source's lane id."""

    def offers(flip: int) -> list[int]:
        out = []
        for lane in range(4):
            send = (0 if lane in (1, 2) else 1) ^ flip
            out.append(words[lane][0] if send == 0 else words[lane][1])
        return out

    offer_a, offer_b = offers(0), offers(1)
    result = []
    for tid in range(4):
        va = offer_a[(QUAD_SRC_A >> (tid * 4)) & 0xF]
        vb = offer_b[(QUAD_SRC_B >> (tid * 4)) & 0xF]
        send_b = (0 if tid in (1, 2) else 1) ^ 1
        order0, order1 = ORDER_SWAP if send_b == 0 else ORDER_KEEP
        result.append([prmt(va, vb, order0), prmt(va, vb, order1)])
    return result


def permuted_labels(t0: int) -> list[int]:
    """Lane t0's 16 bytes after the kernel's exchange, applied to register pairs (0,1), (2,3)."""
    regs = [[_pack(c_layout_labels(t)[4 * i : 4 * i + 4]) for i in range(4)] for t in range(4)]
    out = []
    for pair in range(2):
        words = [[regs[t][2 * pair], regs[t][2 * pair + 1]] for t in range(4)]
        out += [b for w in permute_quad(words)[t0] for b in _unpack(w)]
    return out


# ---- the token order π (what the kernel ships): no shuffles


def pi_packed_labels(t0: int) -> list[int]:
    """Lane t0's 16 bytes for one 32-column k block when Vᵀ is in the token order π
    (``transpose.pi``): after the e4m3 conversion, one ``prmt`` per word inside the thread
    (``pi_pack`` on register pairs (0, 1), (2, 3)) and no shuffles."""
    regs = [_pack(c_layout_labels(t0)[4 * i : 4 * i + 4]) for i in range(4)]
    out = []
    for pair in range(2):
        out += [b for w in pi_pack(regs[2 * pair], regs[2 * pair + 1], prmt) for b in _unpack(w)]
    return out


def pi_pack(v0, v1, prmt_fn):
    """The kernel's packing of one register pair in the order π (``acc_to_fp8_operand``
    calls this with ``cute.arch.prmt``, the CPU tests with ``transpose.prmt``): words of rows
    (r, r+8) x columns (2q, 2q+1) of column groups 2g, 2g+1 → row r's four columns, then
    row r+8's."""
    return prmt_fn(v0, v1, PI_ORDER[0]), prmt_fn(v0, v1, PI_ORDER[1])


def pi_a_layout_labels(t0: int) -> list[int]:
    """What the A operand holds in lane t0 when K position k means token π(k): the A layout
    (``a_layout_labels``) with each column k replaced by π(k)."""
    from snapmla_cute.layouts.transpose import pi

    return [32 * (b // 32) + pi(b % 32) for b in a_layout_labels(t0)]
