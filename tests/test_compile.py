"""CI's window into the GPU code: compile every kernel for sm_90a without a GPU and read the SASS."""

import pytest

from snapmla_cute import jit_cache
from snapmla_cute.compile_report import all_variants, compile_report, fused_kernels, violations
from snapmla_cute.sass import sass_counts


@pytest.fixture(scope="module")
def report():
    """The main variants (the CLI `snapmla-cute compile` in CI covers every one)."""
    return compile_report(arch="sm_90a", variants=all_variants(full=False), jobs=2)


@pytest.fixture(scope="module")
def by_kernel(report):
    return {r["kernel"]: r for r in report}


def test_no_variant_violates(report):
    assert violations(report) == []


def test_decode_variants_run_fp8_and_bf16_warpgroup_mmas(report):
    from snapmla_cute.pipelines import roles

    decode = [r for r in report if r["kernel"] == "decode"]
    assert len(decode) >= 4
    for r in decode:
        # per 64-token block: 16 QK k-blocks (e4m3) + PV k-blocks, RoPE QK in bf16
        assert r["qgmma"] >= 16 and r["hgmma"] >= 4, r
        assert r["local_ld"] == r["local_st"] == 0, r
        # the consumer budget set by setmaxnreg (roles.LAYOUT: 224 beside the transposer WG)
        assert r["max_reg_used"] <= roles.CONSUMER_REGS, r


def test_violations_are_detected():
    rows = [
        dict(kernel="decode", variant="x", local_ld=0, local_st=0, frame_bytes=0, qgmma=0, hgmma=4, gmma_run=4),
        dict(kernel="quant_q", variant="-", local_ld=3, local_st=0, frame_bytes=0, qgmma=0, hgmma=0),
        dict(kernel="decode", variant="y", local_ld=0, local_st=0, frame_bytes=0, qgmma=20, hgmma=4, gmma_run=20),
    ]
    bad = violations(rows)
    assert len(bad) == 2 and "QGMMA 0" in bad[0] and "local memory" in bad[1]


FUSED = {k.NAME: k for k in fused_kernels()}


@pytest.mark.parametrize("name", FUSED)
def test_kernel_compiles_for_sm90a_with_sass(by_kernel, name):
    row = by_kernel[name]
    assert row["sass_instructions"] > 50
    assert 16 <= row["registers"] <= 64  # one warp per row: a light kernel
    assert row["frame_bytes"] == 0 and row["local_ld"] == 0 and row["local_st"] == 0


@pytest.mark.parametrize("name", FUSED)
def test_memory_bound_kernels_use_16_byte_accesses(name):
    art = FUSED[name].compile(arch="sm_90a", keep_sass=True).artifacts
    sass = str(art.SASS)
    assert "LDG.E.128" in sass or "LDG.E.64" in sass
    assert "STG.E.128" in sass
    ptx = str(art.PTX)
    assert ".target sm_90a" in ptx
    if name != "dequant_kv":  # Eq. 6 arithmetic: IEEE division for σ, RNE saturating e4m3 converts
        assert "div.rn.f32" in ptx and "rcp.rn.f32" in ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_kv_loads_hint_l2_evict_first_where_few_ctas_read_a_block():
    """The KV stream is read once: its loads (TMA, or the sparse gather's cp.async) carry L2's
    evict-first policy where at most two query tiles' CTAs read each block
    (``DecodeConfig.l2_evict_first``) and, sparse, a request has one query token; not where
    four tiles (h128 s_q2) or a request's query tokens (sparse s_q8) read the same lines.
    The rule from the configs, the policy in the PTX of one variant each way and the sparse
    gather's."""
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.config import L2_EVICT_FIRST
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig, DecodeStepKernel

    dense = {(h, s_q): DecodeConfig(h, s_q, 64, s_q > 1).l2_evict_first for h, s_q in ((64, 1), (128, 1), (64, 2),
                                                                                         (128, 2), (64, 3))}
    assert dense == {(64, 1): True, (128, 1): True, (64, 2): True, (128, 2): False, (64, 3): False}
    sparse = {s_q: DecodeStepKernel(DecodeSparseStepConfig(DecodeConfig(8, 1, 1, False, sparse=True), s_q))
              .decode.cfg.l2_evict_first for s_q in (1, 2, 8)}
    assert sparse == {1: True, 2: False, 8: False}
    for h, s_q, hinted in ((64, 1, True), (128, 2, False)):
        ptx = str(dc.compile_step(DecodeStepConfig(DecodeConfig(h, s_q, 64, s_q > 1)), arch="sm_90a",
                                  keep_sass=True).artifacts.PTX)
        # every TMA load names a policy operand; the KV loads' is the evict-first constant
        assert (str(L2_EVICT_FIRST) in ptx) == hinted
    cfg = DecodeSparseStepConfig(DecodeConfig(64, 1, 1, False, sparse=True), 1)
    ptx = str(dc.compile_sparse(cfg, arch="sm_90a", keep_sass=True).artifacts.PTX)
    assert "createpolicy.fractional.L2::evict_first" in ptx
    assert "cp.async.cg.shared.global.L2::cache_hint" in ptx


def test_compile_cache_reuses_objects():
    a = FUSED["quant_q"].compile(arch="sm_90a")
    b = FUSED["quant_q"].compile(arch="sm_90a")
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


def test_sass_counter_sees_serialized_warpgroup_mmas():
    """ptxas serializes the GMMAs (C7511) when the wgmma pipeline lacks registers: each one
    then waits for the previous (an earlier default did, unnoticed, at 2x the
    softmax time); CI rejects decode variants in that state."""
    chained = """
        /*0100*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT ;
        /*0110*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24 ;
        /*0120*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR24], R24, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    """
    serialized = """
        /*0100*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/                   WARPGROUP.ARRIVE ;
        /*0130*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24, gsb0 ;
        /*0140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    """
    assert sass_counts(chained).gmma_run == 3
    assert sass_counts(serialized).gmma_run == 1
    row = dict(kernel="decode_step", variant="v", local_ld=0, local_st=0, frame_bytes=0, qgmma=2, hgmma=1, gmma_run=1)
    assert any("serialized" in v for v in violations([row]))
    assert not violations([dict(row, gmma_run=20)])


def test_decode_shared_storage_over_the_sm90_limit_is_refused_at_trace_time(monkeypatch):
    """A CTA over 227 KB of shared memory compiles but fails at launch (seen once: the
    epilogue buffer took it 1 KB over); the kernel refuses it while tracing instead."""
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode import kernel
    from snapmla_cute.kernels.decode.step import DecodeStepConfig

    monkeypatch.setattr(kernel, "SM90_SMEM_BYTES", 64 * 1024)
    monkeypatch.setenv("SNAPMLA_DISABLE_DISK_CACHE", "1")
    monkeypatch.setattr(jit_cache, "_memory_cache", {})
    cfg = DecodeStepConfig(DecodeConfig(heads=16, s_q=1, page_size=64, causal=False))
    with pytest.raises(ValueError, match="shared storage"):
        dc.compile_step(cfg, arch="sm_90a")


def test_sass_digest_ignores_kernel_names_only():
    from snapmla_cute.compile_report import sass_digest

    a = ".text.kernel_cutlass_kernel_snapmla_cutekernelsdecodeDecodeKernel_x_0:\n /*0000*/ LDC R1, c[0x0][0x28] ;\n"
    moved = a.replace("kernelsdecodeDecodeKernel", "kernelsdecodekernelDecodeKernel")
    assert sass_digest(a) == sass_digest(moved)
    assert sass_digest(a) != sass_digest(a.replace("R1,", "R2,"))


def test_variant_keys_name_the_shape_and_only_non_default_fields():
    """And every variant CI compiles has a key of its own (the digest files' keys)."""
    from snapmla_cute.compile_report import all_variants, variant_key
    from snapmla_cute.kernels.decode import DecodeConfig

    assert variant_key("decode", DecodeConfig(128, 1, 64, False)) == "decode [heads=128 s_q=1 page_size=64 causal=False]"
    assert variant_key("decode", DecodeConfig(16, 4, 16, True, kv_stages=3)).endswith("causal=True kv_stages=3]")
    keys = [variant_key(name, cfg) for name, _, cfg in all_variants()]
    assert len(set(keys)) == len(keys), "two variants share a digest key"
