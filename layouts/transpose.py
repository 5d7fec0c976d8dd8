"""The in-kernel V transposition (content tile → Vᵀ), as a byte-level mapping on plain ints.

The decode kernel rewrites each 8 KiB chunk of the K-major SW128 content tile
(64 tokens x 128 dims) as the K-major SW64 Vᵀ chunk (128 dims x 64 tokens) in place:
thread ``t`` of the owning warpgroup takes tokens ``4a..4a+3`` (``a = t % 16``) and dims
``16b..16b+15`` (``b = t // 16``), loads 4 rows x 16 bytes, transposes 4x4 byte blocks with
``prmt`` (selectors 0x5140, 0x7362, 0x5410, 0x7632) and stores one 32-bit word per dim.
``transpose_chunk_emulated`` replays exactly that on a bytearray, so the CPU tests can check
the kernel's address arithmetic and permutation against ``smem.content_offset``/``vt_offset``.
"""

from __future__ import annotations

from snapmla_cute.layouts.smem import CHUNK_BYTES, swizzle


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``sel_i`` of {b, a}."""
    pool = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 0x7] for i in range(4)), "little")


def transpose_4x4(rows: list[int]) -> list[int]:
    """Four 32-bit words (token r holds dims 0..3) → four words (dim e holds tokens 0..3)."""
    lo01 = prmt(rows[0], rows[1], 0x5140)
    hi01 = prmt(rows[0], rows[1], 0x7362)
    lo23 = prmt(rows[2], rows[3], 0x5140)
    hi23 = prmt(rows[2], rows[3], 0x7362)
    return [prmt(lo01, lo23, 0x5410), prmt(lo01, lo23, 0x7632), prmt(hi01, hi23, 0x5410), prmt(hi01, hi23, 0x7632)]


def src_word(chunk: int, token: int, b: int, w: int) -> int:
    """Byte offset of word ``w`` of the 16-byte group ``b`` (dims 16b..16b+15) of ``token``."""
    base = (token % 8) * 128 + (token // 8) * 1024 + 16 * b
    return chunk * CHUNK_BYTES + swizzle(base, 3) + 4 * w


def dst_word(chunk: int, dim: int, a: int) -> int:
    """Byte offset of the word holding tokens 4a..4a+3 of ``dim`` (0..127 within the chunk)."""
    base = (dim % 8) * 64 + (dim // 8) * 512 + 4 * a
    return chunk * CHUNK_BYTES + swizzle(base, 2)


def transpose_chunk_emulated(buf: bytearray, chunk: int, valid_tokens: int = 64) -> None:
    """Replays the 128 threads' loads, ``prmt`` transposes and stores for one chunk."""
    loaded = {}
    for t in range(128):  # all loads happen before the warpgroup barrier
        a, b = t % 16, t // 16
        loaded[t] = [
            [int.from_bytes(buf[src_word(chunk, 4 * a + r, b, w) :][:4], "little") for w in range(4)]
            for r in range(4)
        ]
    for t in range(128):
        a, b = t % 16, t // 16
        keep = 0xFFFFFFFF
        if 4 * a + 4 > valid_tokens:
            keep = 0 if 4 * a >= valid_tokens else (1 << (8 * (valid_tokens - 4 * a))) - 1
        for w in range(4):
            outs = transpose_4x4([loaded[t][r][w] for r in range(4)])
            for e in range(4):
                off = dst_word(chunk, 16 * b + 4 * w + e, a)
                buf[off : off + 4] = (outs[e] & keep).to_bytes(4, "little")
