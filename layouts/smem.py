"""Shared-memory layouts of the decode kernel, as CuTe objects and as plain byte maps.

Every tile is K-major (the only major mode FP8 WGMMA accepts) and built from the
Swizzle-128B / Swizzle-64B atoms of ``warpgroup.SmemLayoutAtomKind``:

* ``q_nope`` / ``kv_content``: e4m3 ``(rows, 512)``, atom ``S<3,4,3> o (8,128):(128,1)``
  (the paper's 64x128 tiling: every 128-byte row segment is one L2 line and one TMA box
  row). Column chunk ``c`` (dims ``128c..128c+127``) of a 64-row tile is the contiguous
  8 KiB ``[8192c, 8192c + 8192)``.
* ``q_rope`` / ``kv_rope``: bf16 ``(rows, 64)``, atom ``S<3,4,3> o (8,64):(64,1)``.
* ``vt``: the transposed content, e4m3 ``(512 dims, 64 tokens)``, atom
  ``S<2,4,3> o (8,64):(64,1)``. Dims ``128c..128c+127`` occupy the same 8 KiB as content
  chunk ``c``, which is what lets the kernel transpose each chunk in place.
* ``p``: the quantized probabilities, e4m3 ``(64 rows, 64 tokens)``, atom ``S<2,4,3>``.

The ``*_offset`` functions give the same maps as Python integers (byte offset of an
element), so CPU tests can check them as mappings and ``render`` can draw them.
"""

from __future__ import annotations

BLOCK_N = 64  # KV tokens per block
M_TILE = 64  # query rows per MMA tile
CHUNK_BYTES = 8192  # 64 tokens x 128 bytes


def swizzle(offset: int, bits: int, base: int = 4, shift: int = 3) -> int:
    """CuTe ``Swizzle<bits, base, shift>`` on a byte offset: XOR bits [base, base+bits)
    with bits [base+shift, base+shift+bits)."""
    mask = (1 << bits) - 1
    return offset ^ (((offset >> (base + shift)) & mask) << base)


def content_offset(row: int, col_byte: int) -> int:
    """Byte offset of e4m3 element (row, col) of a K-major SW128 ``(64, 512)`` tile.

    Operators only (like every map here), so the kernel traces it on DSL integers."""
    return (col_byte // 128) * CHUNK_BYTES + swizzle((row % 8) * 128 + (row // 8) * 1024 + col_byte % 128, 3)


def sw128_row_step(offset: int, rows: int) -> int:
    """The offset of the same column ``rows`` rows further down a Swizzle-128B tile
    (``content_offset``, ``rope_offset``), from ``offset``, the offset in row ``r``: valid
    where ``r % 8`` and ``rows % 8`` share no bit (so ``(r + rows) % 8 == r % 8 ^ rows % 8``).
    With ``rows`` a constant it is one XOR and an add folded into the address, which lets
    the sparse gather compute a lane's swizzled destination once per block. The gather
    applies it to absolute shared addresses: valid because the tiles start 1024-aligned
    (bits 4-9 of the base are 0)."""
    return (offset ^ ((rows % 8) * 16)) + (rows % 8) * 128 + (rows // 8) * 1024


def vt_offset(dim: int, token: int) -> int:
    """Byte offset of e4m3 element (dim, token) of the K-major SW64 ``(512, 64)`` Vᵀ tile."""
    return swizzle((dim % 8) * 64 + (dim // 8) * 512 + token, 2)


def rope_offset(row: int, col: int) -> int:
    """Byte offset of bf16 element (row, col) of a K-major SW128 ``(64, 64)`` tile."""
    return swizzle((row % 8) * 128 + (row // 8) * 1024 + 2 * col, 3)


def p_offset(row: int, token: int) -> int:
    """Byte offset of e4m3 element (row, token) of the K-major SW64 ``(64, 64)`` P tile."""
    return swizzle((row % 8) * 64 + (row // 8) * 512 + token, 2)


def p_stsm_offset(warp, lane, kb: int):
    """Byte offset in the P tile of ``lane``'s stmatrix.x4 row address for k-step ``kb``
    (``Consumer.publish_p``): row 16·warp + lane%8 (+8 for matrices 1, 3), k-half lane/16.
    Plain integer ops, so the kernel traces it on DSL ints."""
    row = 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1)
    return p_offset(row, 16 * (lane >> 4) + 32 * kb)


# ------------------------------------------------------------------------------------------
# CuTe layout objects (call inside @cute.jit)
# ------------------------------------------------------------------------------------------


def _smem_layout(kind_name: str, dtype, shape, stages: int):
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    atom = warpgroup.make_smem_layout_atom(getattr(warpgroup.SmemLayoutAtomKind, kind_name), dtype)
    return cute.tile_to_shape(atom, (*shape, stages), order=(0, 1, 2))


def q_nope_layout(stages: int = 1):
    """Q's content tile; a second stage holds the accurate mode's residual codes (hi + lo)."""
    import cutlass

    return _smem_layout("K_SW128", cutlass.Float8E4M3FN, (M_TILE, 512), stages)


def q_rope_layout():
    import cutlass

    return _smem_layout("K_SW128", cutlass.BFloat16, (M_TILE, 64), 1)


def kv_content_layout(stages: int):
    import cutlass

    return _smem_layout("K_SW128", cutlass.Float8E4M3FN, (BLOCK_N, 512), stages)


def kv_rope_layout(stages: int):
    import cutlass

    return _smem_layout("K_SW128", cutlass.BFloat16, (BLOCK_N, 64), stages)


def vt_layout(stages: int, dims: int = 512):
    """Vᵀ over the same bytes as ``kv_content_layout`` (``dims`` = 256 gives one WG's half)."""
    import cutlass

    return _smem_layout("K_SW64", cutlass.Float8E4M3FN, (dims, BLOCK_N), stages)


def p_layout(stages: int):
    import cutlass

    return _smem_layout("K_SW64", cutlass.Float8E4M3FN, (M_TILE, BLOCK_N), stages)


def render(kind: str = "vt", rows: int = 16, cols: int = 16) -> str:
    """A text picture of a corner of a tile: the 16-byte unit each element lands in."""
    fn = {"content": content_offset, "vt": vt_offset, "rope": rope_offset, "p": p_offset}[kind]
    lines = [f"{kind}: 16-byte unit index of element (row, col), top-left {rows}x{cols}"]
    for r in range(rows):
        lines.append(" ".join(f"{fn(r, c) // 16:4d}" for c in range(cols)))
    return "\n".join(lines)


def plot(kind: str = "vt", rows: int = 32, cols: int = 64, ax=None):
    """Draws which 16-byte unit each element of a tile corner lands in (matplotlib)."""
    import matplotlib.pyplot as plt

    fn = {"content": content_offset, "vt": vt_offset, "rope": rope_offset, "p": p_offset}[kind]
    grid = [[(fn(r, c) // 16) % 64 for c in range(cols)] for r in range(rows)]
    if ax is None:
        _, ax = plt.subplots(figsize=(cols / 6, rows / 6))
    ax.imshow(grid, cmap="tab20", interpolation="nearest")
    ax.set_title(f"{kind}: 16-byte unit (mod 64) of element (row, col)")
    ax.set_xlabel("col")
    ax.set_ylabel("row")
    return ax
