"""CI's window into the GPU code: compile every kernel for sm_90a without a GPU and read the SASS."""

import pytest

from snapmla_cute import jit_cache
from snapmla_cute.compile_report import compile_report
from snapmla_cute.sass import sass_counts


@pytest.fixture(scope="module")
def report():
    return {r["kernel"]: r for r in compile_report(arch="sm_90a")}


@pytest.mark.parametrize("name", jit_cache.KERNEL_NAMES)
def test_kernel_compiles_for_sm90a_with_sass(report, name):
    row = report[name]
    assert row["sass_instructions"] > 50
    assert 16 <= row["registers"] <= 64  # one warp per row: a light kernel
    assert row["frame_bytes"] == 0 and row["local_ld"] == 0 and row["local_st"] == 0


@pytest.mark.parametrize("name", jit_cache.KERNEL_NAMES)
def test_memory_bound_kernels_use_16_byte_accesses(name):
    art = jit_cache.compile_kernel(name, arch="sm_90a", keep_sass=True).artifacts
    sass = str(art.SASS)
    assert "LDG.E.128" in sass or "LDG.E.64" in sass
    assert "STG.E.128" in sass
    ptx = str(art.PTX)
    assert ".target sm_90a" in ptx
    if name != "dequant_kv":  # Eq. 6 arithmetic: IEEE division for σ, RNE saturating e4m3 converts
        assert "div.rn.f32" in ptx and "rcp.rn.f32" in ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_compile_cache_reuses_objects():
    a = jit_cache.compile_kernel("quant_q", arch="sm_90a")
    b = jit_cache.compile_kernel("quant_q", arch="sm_90a")
    assert a is b


def test_sass_counter_reads_mma_and_local_memory():
    listing = """
        /*0100*/                   QGMMA.64x256x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88 ;
        /*0120*/              @!P0 STL [R1+0x10], R3 ;
        /*0130*/                   LDL.64 R4, [R1] ;
        /*0140*/                   EXIT ;
    """
    c = sass_counts(listing)
    assert (c.qgmma, c.hgmma, c.local_st, c.local_ld, c.instructions) == (1, 1, 1, 1, 5)
