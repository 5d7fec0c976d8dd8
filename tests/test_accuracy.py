"""The accuracy study's data sets, its error budget, the emulated peer formats and P variants (CPU)."""

import math

import pytest
import torch

from snapmla_cute import accuracy as acc
from snapmla_cute import emulation
from snapmla_cute import reference as ref


def _case(dist, L=1024, h=16, b=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return acc.make_inputs(dist, b, 1, h, L, 64, gen)


def test_realistic_keys_are_rms_normalized_latents_with_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    k, ch, g = acc._realistic_keys(2, 512, gen)
    content = k[..., :512]
    rms_over_tokens = content.pow(2).mean(dim=(0, 1)).sqrt()
    # the per-channel gain: a few channels far above the median
    assert (rms_over_tokens > 6 * rms_over_tokens.median()).sum() >= 3
    # RMSNorm before the gain: every token has unit RMS
    torch.testing.assert_close((content / g).pow(2).mean(-1), torch.ones(2, 512))
    # RoPE: low-frequency pairs carry the large magnitudes
    assert ch[-8:].min() > 3 * ch[:-8].median()


def test_realistic_pages_hold_each_request_in_position_order():
    """Page block_table[i, j] holds tokens j·64… of request i: RoPE phases must line up."""
    gen = torch.Generator().manual_seed(3)
    q, k_pages, bt, lens = acc.make_inputs("realistic", 2, 1, 16, 300, 64, gen)
    gen = torch.Generator().manual_seed(3)
    k_seq, _, _ = acc._realistic_keys(2, 320, gen)
    for i in range(2):
        got = ref.gather_pages(k_pages, bt, i, 300)
        assert torch.equal(got, k_seq[i, :300].to(torch.bfloat16))


@pytest.mark.parametrize("dist", ["realistic", "stress"])
def test_logits_have_the_intended_spread(dist):
    q, k_pages, bt, lens = _case(dist)
    for i in range(2):
        k = ref.gather_pages(k_pages, bt, i, int(lens[i])).double()
        s = (q[i, 0].double() @ k.T) * ref.default_softmax_scale()
        sd = s.std(-1)
        widest = (s - s.mean(-1, keepdim=True)).abs().amax(-1)
        # std 2, or the widest logit 8 from the mean where that is the binding limit (bf16 rounding aside)
        assert (sd < 2.05).all() and (widest < 8.1).all()
        assert ((sd > 1.9) | (widest > 7.9)).all()


def test_stress_set_spreads_per_token_scales_inside_blocks():
    q, k_pages, bt, lens = _case("stress", L=2048)
    k = ref.gather_pages(k_pages, bt, 0, 2048).float()
    amax = k[:, :512].abs().amax(-1).view(-1, 64)
    ratio = amax.amax(-1) / amax.amin(-1)
    assert (ratio > 1e3).float().mean() > 0.5, ratio


def test_budget_switches_isolate_each_step():
    q, k_pages, bt, lens = _case("realistic")
    out_x, lse_x = ref.mla_decode_exact(q, k_pages, bt, lens)
    nothing = acc._steps("none")[1]
    o, lse = emulation.mla_decode_emulated(q, k_pages, bt, lens, config=nothing, mma="exact")
    assert ref.rel_l2(o, out_x) < 1e-5 and ref.lse_max_abs(lse, lse_x) < 1e-4
    errs = {}
    for label, cfg, mma in acc.BUDGET[acc._SINGLE_STEPS]:
        o, _ = emulation.mla_decode_emulated(q, k_pages, bt, lens, config=cfg, mma=mma)
        errs[label] = ref.rel_l2(o, out_x)
        assert errs[label] > 1e-5, label  # each switch does something
    o, _ = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens)
    full = ref.rel_l2(o, out_x)
    assert max(errs.values()) < 1.5 * full  # no single step beyond the whole path (errors add in quadrature)
    assert math.sqrt(sum(e * e for e in errs.values())) > 0.5 * full


def test_p_variant_path_equals_the_kernel_path_for_the_kernels_p():
    """The generic P path (true units) with the kernel's P format gives the kernel path's
    result (units of 1/σ_p) up to fp32 rounding with fp32 GEMMs, so the P variants compare
    like for like (with the tensor-core adder the two differ by its truncation, ~1e-4)."""
    q, k_pages, bt, lens = _case("stress")
    codes, scale = emulation.quantize_q_codes(q.reshape(-1, 576), emulation.SNAPMLA)
    kq = emulation._quantize_k(ref.gather_pages(k_pages, bt, 0, 1024), emulation.SNAPMLA, None)
    vis = torch.full((16,), 1024)
    for mma, tol in (("exact", 2e-6), ("hopper", 3e-4)):
        args = (codes[:16], scale[:16], kq, vis, ref.default_softmax_scale(), mma)
        o1, l1 = emulation.decode_one(*args)
        o2, l2 = emulation._decode_one_p_variant(*args, "e4m3", 64)
        assert ref.rel_l2(o2, o1) < tol and float((l1 - l2).abs().max()) < 1e-5, mma


@pytest.mark.parametrize("p, block", [("e4m3", 32), ("e4m3", 16), ("e5m2", 64), ("bf16", 64), ("none", 64)])
def test_p_variants_run_and_bracket_the_kernel(p, block):
    q, k_pages, bt, lens = _case("realistic")
    out_x, _ = ref.mla_decode_exact(q, k_pages, bt, lens)
    cfg = emulation.QuantConfig("v", "per_token", p=p, p_block=block)
    o, _ = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens, config=cfg)
    base, _ = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens)
    assert 0 < ref.rel_l2(o, base) < 2e-2
    assert ref.rel_l2(o, out_x) < 1.2 * ref.rel_l2(base, out_x)


def test_flashmla_dense_fp8_quantizes_rope_and_v32_scales_are_powers_of_two():
    q, k_pages, bt, lens = _case("paper", L=2048)
    out_x, lse_x = ref.mla_decode_exact(q, k_pages, bt, lens)
    snap = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens)
    dense = emulation.mla_decode_emulated(q, k_pages, bt, lens, config="flashmla_fp8")
    # RoPE outlier channels in e4m3 with one per-tensor scale: the logits suffer (paper §3.1)
    assert ref.lse_max_abs(dense[1], lse_x) > 3 * ref.lse_max_abs(snap[1], lse_x)
    k = ref.gather_pages(k_pages, bt, 0, 2048)
    kq = emulation._quantize_k(k, emulation.V32_TILE128, None)
    assert torch.equal(kq.qk_codes[:, 512:], k[:, 512:].float())  # RoPE kept bf16
    tiles = k[:, :512].float().view(-1, 4, 128)
    sc = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(-1, keepdim=True) / 448)))
    codes = (kq.v_values.view(-1, 4, 128) / sc)
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())  # code · 2^e: exact
    assert (codes.abs().amax(-1) <= 448).all() and (codes.abs().amax(-1) >= 224).all()


def test_study_tables_and_cli(capsys):
    from snapmla_cute.cli import main

    rows = acc.accuracy_study(lengths=(256,), dists=("realistic",), batch=1, heads=16, seeds=(0,), table="budget")
    assert [r["config"] for r in rows] == [label for label, _, _ in acc.BUDGET]
    assert sum(r["dominant"] for r in rows) == 1 and not rows[0]["dominant"]
    assert main(["accuracy", "--data", "stress", "--table", "formats", "--lengths", "256", "--batch", "1",
                 "--heads", "16", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    for name in ("SnapMLA", "FlashMLA dense FP8", "V3.2 tile-128", "stress"):
        assert name in out
    with pytest.raises(ValueError, match="unknown data set"):
        _case("nope")


def test_split_query_keeps_hi_plus_lo_and_removes_most_of_qs_error():
    q, k_pages, bt, lens = _case("realistic")
    split = emulation.SNAPMLA_X2
    codes, scale = emulation.quantize_q_codes(q, split)
    plain, scale0 = emulation.quantize_q_codes(q, emulation.SNAPMLA)
    assert codes.shape[-1] == 576 + 512 and torch.equal(scale, scale0)
    assert torch.equal(codes[..., :576], plain)  # hi and RoPE are the plain codes
    want = q[..., :512].float() / scale.unsqueeze(-1)
    hi_lo = codes[..., :512] + codes[..., 576:]
    big = want.abs() > 1  # lo codes of small elements fall into e4m3's subnormals
    assert ((hi_lo - want).abs()[big] <= want.abs()[big] * 2.0**-7).all()
    out_x, _ = ref.mla_decode_exact(q, k_pages, bt, lens)
    o_split, _ = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens, config=split)
    o_plain, _ = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens)
    assert ref.rel_l2(o_split, out_x) < 0.5 * ref.rel_l2(o_plain, out_x)


def test_hadamard_rotation_is_orthogonal_and_keeps_every_logit():
    gen = torch.Generator().manual_seed(5)
    r = acc.hadamard_rotation(512, gen)
    assert torch.allclose(r @ r.T, torch.eye(512, dtype=torch.float64), atol=1e-12)
    assert set((r.abs() * math.sqrt(512)).round().unique().tolist()) == {1.0}  # ±1/√512 everywhere
    assert not torch.equal(r, acc.hadamard_rotation(512, torch.Generator().manual_seed(6)))  # signs drawn
    with pytest.raises(ValueError, match="power of two"):
        acc.hadamard_rotation(576, gen)
    # q R · k R = q · k, and O comes out as O R: exact attention on rotated inputs, rotated
    # back, is exact attention on the originals (float64, no bf16 rounding in between)
    q, k_pages, bt, lens = _case("realistic")
    q64, k64 = q.double(), k_pages.double()
    rot = lambda x: torch.cat([x[..., :512] @ r, x[..., 512:]], dim=-1)  # noqa: E731
    out, lse = ref.mla_decode_exact(q64, k64, bt, lens)
    out_r, lse_r = ref.mla_decode_exact(rot(q64), rot(k64), bt, lens)
    assert torch.allclose(out_r.double() @ r.T, out.double(), atol=1e-9)
    assert torch.allclose(lse_r, lse, atol=1e-9)


def test_q_precisions_rotation_and_bf16_rows(capsys):
    from snapmla_cute.cli import main

    kw = dict(lengths=(256,), dists=("realistic",), batch=1, heads=16, seeds=(0,))
    rows = acc.accuracy_study(**kw, q_precisions=("e4m3", "e4m3x2"), rotate="both")
    names = [r["config"] for r in rows]
    assert names[:2] == [emulation.SNAPMLA.name, emulation.SNAPMLA_X2.name]
    assert emulation.BF16_KV.name in names and f"{emulation.SNAPMLA.name} (rotated)" in names
    assert len(names) == 2 * (len(acc.FORMATS) + 1) and sum(r["rotated"] for r in rows) == len(names) // 2
    by = {r["config"]: r["rel_l2"] for r in rows}
    assert by[emulation.SNAPMLA_X2.name] < 0.5 * by[emulation.SNAPMLA.name]
    assert by[emulation.BF16_KV.name] < 1e-3  # BF16 Q, K and P: far below every FP8 format
    assert [r["config"] for r in acc.accuracy_study(**kw, rotate="on")] == [f"{label} (rotated)" for label, _, _ in acc.FORMATS]
    with pytest.raises(ValueError, match="q_precisions"):
        acc.accuracy_study(**kw, q_precisions=("e5m2",))
    with pytest.raises(ValueError, match="q_precisions"):
        acc.accuracy_study(**kw, table="budget", q_precisions=("e4m3x2",))
    with pytest.raises(ValueError, match="rotate"):
        acc.accuracy_study(**kw, rotate="yes")
    assert main(["accuracy", "--data", "realistic", "--lengths", "256", "--batch", "1", "--heads", "16", "--seeds", "0",
                 "--q-precision", "e4m3", "e4m3x2", "--rotate", "on"]) == 0
    assert "Q e4m3x2" in capsys.readouterr().out
