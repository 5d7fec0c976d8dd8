"""The decode kernel's layouts as mappings on the CPU: bijective, chunk-local, and landing
every element where the MMA and the in-place transposition expect it."""

import os
import random

import pytest

from snapmla_cute.layouts import p_permute, smem, transpose


def test_importable_only_under_snapmla_cute():
    import snapmla_cute.layouts as lay

    assert lay.__name__ == "snapmla_cute.layouts"


@pytest.mark.parametrize(
    "fn, rows, cols, size",
    [
        (smem.content_offset, 64, 512, 32768),
        (smem.vt_offset, 512, 64, 32768),
        (smem.p_offset, 64, 64, 4096),
    ],
)
def test_fp8_tiles_are_bijective(fn, rows, cols, size):
    offs = {fn(r, c) for r in range(rows) for c in range(cols)}
    assert offs == set(range(size))


def test_rope_tile_is_bijective_on_bf16_slots():
    offs = {smem.rope_offset(r, c) for r in range(64) for c in range(64)}
    assert offs == set(range(0, 8192, 2))


def test_content_and_vt_chunks_share_bytes():
    """Dims 128c..128c+127 occupy bytes [8192c, 8192c+8192) in both tiles: the in-place
    transposition never reads bytes another chunk's stores overwrite."""
    for r in range(64):
        for c in range(512):
            assert smem.content_offset(r, c) // smem.CHUNK_BYTES == c // 128
    for d in range(512):
        for t in range(64):
            assert smem.vt_offset(d, t) // smem.CHUNK_BYTES == d // 128


def test_swizzle_keeps_16_byte_units_whole():
    """TMA boxes and 16-byte shared loads need each 16-byte unit contiguous."""
    for r in range(64):
        for c0 in range(0, 512, 16):
            base = smem.content_offset(r, c0)
            assert base % 16 == 0
            assert [smem.content_offset(r, c0 + i) for i in range(16)] == list(range(base, base + 16))


def test_sw128_row_step_follows_the_tiles():
    # the sparse gather's per-lane destinations: a row r0 with r0 % 8 and the step's low
    # bits disjoint (the gather: r0 % 8 < 4, steps of 4, content and RoPE)
    for r0 in range(64):
        for step in range(64 - r0):
            if (r0 % 8) & (step % 8):
                continue
            for col in range(0, 512, 16):
                assert smem.sw128_row_step(smem.content_offset(r0, col), step) == smem.content_offset(r0 + step, col)
            for col in range(0, 64, 8):
                assert smem.sw128_row_step(smem.rope_offset(r0, col), step) == smem.rope_offset(r0 + step, col)
    # where the bits overlap the step is not a row move (the gather never asks for one)
    assert smem.sw128_row_step(smem.content_offset(1, 0), 1) != smem.content_offset(2, 0)


def test_sw128_rows_of_one_column_group_hit_distinct_banks():
    """The point of Swizzle-128B: 8 consecutive rows of one 16-byte column group spread over
    8 different 16-byte bank groups."""
    for c0 in range(0, 128, 16):
        groups = {(smem.content_offset(r, c0) % 128) // 16 for r in range(8)}
        assert len(groups) == 8


@pytest.mark.parametrize("pi", [False, True])
@pytest.mark.parametrize("valid", [64, 63, 40, 33, 17, 9, 4, 1, 0])
def test_in_place_transposition_produces_vt(valid, pi):
    """The kernel's ldmatrix.trans / prmt / stmatrix program, replayed byte for byte: K
    position k of Vᵀ holds token k, or token π(k) with ``pi``."""
    rng = random.Random(valid)
    content = [[rng.randrange(256) for _ in range(512)] for _ in range(64)]
    buf = bytearray(32768)
    for r in range(64):
        for c in range(512):
            buf[smem.content_offset(r, c)] = content[r][c]
    transpose.transpose_ldsm_emulated(buf, valid, pi)
    for d in range(512):
        for k in range(64):
            t = transpose.pi(k) if pi else k
            want = content[t][d] if t < valid else 0  # tokens past the sequence are zeroed
            assert buf[smem.vt_offset(d, k)] == want, (d, k)


def test_pi_permutes_within_each_k_step():
    """π only reorders tokens inside each 32-wide k-step (the MMA's sums are unchanged)."""
    ks = [transpose.pi(k) for k in range(64)]
    for kb in range(2):
        assert sorted(ks[32 * kb : 32 * kb + 32]) == list(range(32 * kb, 32 * kb + 32))


@pytest.mark.parametrize("pi", [False, True])
def test_transposition_is_chunk_local_and_conflict_free(pi):
    for w in range(transpose.LDSM_WARPS):
        for k in range(transpose.LDSM_STEPS):
            src = [transpose.ldsm_src(w, lane, k, pi) for lane in range(32)]
            dst = [transpose.stsm_dst(w, lane, k) for lane in range(32)]
            # in place: step k reads and writes only chunk k // 4
            assert {a // smem.CHUNK_BYTES for a in src + dst} == {k // 4}
            for m in range(4):  # each 8-lane phase hits 8 distinct 16-byte bank groups
                assert len({(a % 128) // 16 for a in src[8 * m : 8 * m + 8]}) == 8
                assert len({(a % 128) // 16 for a in dst[8 * m : 8 * m + 8]}) == 8


def test_prmt_matches_ptx_semantics():
    a, b = 0x33221100, 0x77665544
    assert transpose.prmt(a, b, 0x3210) == a
    assert transpose.prmt(a, b, 0x7654) == b
    assert transpose.prmt(a, b, 0x5140) == 0x55114400  # bytes a0 b0 a1 b1, little-endian


@pytest.mark.parametrize("lane", range(4))
def test_p_byte_permutation_lands_in_a_operand_order(lane):
    assert sorted(p_permute.c_layout_labels(lane)) != p_permute.a_layout_labels(lane) or lane == 0
    assert p_permute.permuted_labels(lane) == p_permute.a_layout_labels(lane)


@pytest.mark.parametrize("lane", range(4))
def test_p_words_without_shuffles_are_in_pi_order(lane):
    """With Vᵀ in the order π the P accumulator packs into A-operand words inside each lane."""
    assert p_permute.pi_packed_labels(lane) == p_permute.pi_a_layout_labels(lane)


def test_every_p_byte_kept_exactly_once():
    before = sorted(b for t in range(4) for b in p_permute.c_layout_labels(t))
    after = sorted(b for t in range(4) for b in p_permute.permuted_labels(t))
    assert before == after == list(range(64))


def test_cute_layout_objects_match_the_byte_maps():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    rng = random.Random(0)
    kv_pts = [(rng.randrange(64), rng.randrange(512)) for _ in range(300)]
    vt_pts = [(rng.randrange(512), rng.randrange(64)) for _ in range(300)]
    p_pts = [(rng.randrange(64), rng.randrange(64)) for _ in range(200)]
    got = {}

    @cute.jit
    def probe():
        kv, vt, p = smem.kv_content_layout(2), smem.vt_layout(2), smem.p_layout(2)
        got["kv"] = [kv((r, c, 1)) for r, c in kv_pts]
        got["vt"] = [vt((d, t, 1)) for d, t in vt_pts]
        got["p"] = [p((r, t, 1)) for r, t in p_pts]

    probe()
    assert got["kv"] == [32768 + smem.content_offset(r, c) for r, c in kv_pts]
    assert got["vt"] == [32768 + smem.vt_offset(d, t) for d, t in vt_pts]
    assert got["p"] == [4096 + smem.p_offset(r, t) for r, t in p_pts]


def test_render_draws_a_tile():
    text = smem.render("vt", rows=4, cols=4)
    assert text.splitlines()[0].startswith("vt:") and len(text.splitlines()) == 5


def test_p_stmatrix_rows_land_the_a_fragment_words_conflict_free():
    """``Consumer.publish_p``: lane l of warp w gives stmatrix row (16w + l%8 + 8·(l/8 % 2),
    k-half 16·(l/16) + 32·kb) of the P tile; thread t's register j (the A-fragment word of
    row 16w + t/4 + 8·(j%2), k = 16·(j/2) + 32·kb + 4·(t%4)) then lands where the A-operand
    view stores it, and each 8-lane phase hits 8 distinct 16-byte bank groups."""
    for w in range(4):
        for kb in range(2):
            rows = [smem.p_stsm_offset(w, l, kb) for l in range(32)]
            for m in range(4):
                assert len({(a % 128) // 16 for a in rows[8 * m : 8 * m + 8]}) == 8
            for t in range(32):
                q, c = t & 3, t >> 2
                for j in range(4):
                    row, k = 16 * w + c + 8 * (j & 1), 16 * (j >> 1) + 32 * kb + 4 * q
                    assert rows[8 * j + c] + 4 * q == smem.p_offset(row, k)
