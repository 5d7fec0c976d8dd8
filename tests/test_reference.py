"""CPU tests of the specification: quantization, exact decode, emulation, configs."""

import math

import pytest
import torch

from snapmla_cute import emulation, sparse_reference, tensor_core
from snapmla_cute import format as fmt
from snapmla_cute import reference as ref
from snapmla_cute.accuracy import make_inputs


def test_reference_restates_the_format_constants():
    for name in ("CONTENT_DIM", "ROPE_DIM", "HEAD_DIM", "KV_ROW_BYTES", "FP8_MAX", "AMAX_FLOOR"):
        assert getattr(ref, name) == getattr(fmt, name), name


def test_quantize_rows_matches_its_definition(seed):
    x = (torch.randn(300, 576) * torch.logspace(-3, 3, 300)[:, None]).bfloat16()
    c, r, s = ref.quantize_rows(x)
    xf = x.float()
    want_s = xf[:, :512].abs().amax(-1).clamp(min=1e-6) / 448.0
    assert torch.equal(s, want_s)
    inv = 1.0 / s
    assert torch.equal(c.view(torch.uint8), (xf[:, :512] * inv[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(r.view(torch.int16), (xf[:, 512:] * inv[:, None]).bfloat16().view(torch.int16))
    # the largest content element lands on ±448 (the full e4m3 range is used)
    assert torch.allclose(c.float().abs().amax(-1), torch.full((300,), 448.0))


def test_quantize_rows_zero_and_extreme_rows_stay_finite():
    x = torch.zeros(4, 576)
    x[1, 512:] = 1e4  # zero content, large RoPE
    x[2, :512] = 3e38
    x[3, 0] = 1e-30
    c, r, s = ref.quantize_rows(x.bfloat16())
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(c.float()).all() and torch.isfinite(r.float()).all()
    assert s[0] == s[1] == s[3] == torch.tensor(1e-6) / 448.0


def test_round_trip_and_packing(seed):
    x = (torch.randn(64, 576) / 10).bfloat16()
    c, r, s = ref.quantize_rows(x)
    rows = ref.pack_kv_rows(c, r)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 640)
    c2, r2 = ref.unpack_kv_rows(rows)
    assert torch.equal(c2.view(torch.uint8), c.view(torch.uint8)) and torch.equal(r2, r)
    back = ref.dequantize_rows(c2, r2, s)
    assert ref.rel_l2(back[:, :512], x[:, :512]) < 0.04
    assert ref.rel_l2(back[:, 512:], x[:, 512:]) < 0.005


def _sdpa_reference(q, k_pages, bt, lens, scale, causal):
    """Independent check of mla_decode_exact through torch's SDPA (float64)."""
    b, s_q, h, _ = q.shape
    outs = torch.zeros(b, s_q, h, 512, dtype=torch.float64)
    for bi in range(b):
        L = int(lens[bi])
        if L == 0:
            continue
        ps = k_pages.shape[1]
        k = k_pages[bt[bi, : (L + ps - 1) // ps].long()].reshape(-1, 576)[:L].double()
        mask = torch.ones(s_q, L, dtype=torch.bool)
        if causal:
            mask = torch.arange(L)[None, :] < (L - s_q + torch.arange(s_q) + 1)[:, None]
        qq = q[bi].double().transpose(0, 1)  # [h, s_q, 576]
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, k[None].expand(h, L, 576), k[None, :, :512].expand(h, L, 512), attn_mask=mask, scale=scale
        )
        outs[bi] = o.transpose(0, 1).nan_to_num(0.0)
    return outs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q", [1, 3])
def test_exact_decode_matches_sdpa(seed, causal, s_q):
    gen = torch.Generator().manual_seed(seed)
    b, h, ps = 3, 16, 16
    lens = torch.tensor([0, 2, 77], dtype=torch.int32)
    P = 15
    k_pages = torch.randn(P, ps, 576, generator=gen).bfloat16()
    bt = torch.randperm(P, generator=gen).view(3, 5).int()
    q = torch.randn(b, s_q, h, 576, generator=gen).bfloat16()
    out, lse = ref.mla_decode_exact(q, k_pages, bt, lens, causal=causal)
    want = _sdpa_reference(q, k_pages, bt, lens, ref.default_softmax_scale(), causal)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, h, s_q)
    if causal and s_q == 3:  # request 1 (L=2): its first query token sees no key
        assert torch.all(lse[1, :, 0] == -math.inf) and torch.all(out[1, 0] == 0)
    # lse against a direct logsumexp for one visible row
    k = k_pages[bt[2, :5].long()].reshape(-1, 576)[:77].double()
    n_vis = 77 - s_q + 1 if causal else 77
    s = q[2, 0].double() @ k[:n_vis].T * ref.default_softmax_scale()
    torch.testing.assert_close(lse[2, :, 0], torch.logsumexp(s, -1))


def _fp8_case(seed, b=3, s_q=2, h=16, ps=32, lens=(0, 45, 300), nan_fill=True):
    gen = torch.Generator().manual_seed(seed)
    n_pages = [(L + ps - 1) // ps for L in lens]
    P = sum(n_pages) + 3
    k_pages = (torch.randn(P, ps, 576, generator=gen) / 10).clamp(-1, 1).bfloat16()
    kv, kv_scale = ref.quantize_kv_cache(k_pages)
    perm = torch.randperm(P, generator=gen)
    bt = torch.full((b, max(n_pages) + 2), 2**30, dtype=torch.int32)  # huge past each length
    pos = 0
    for i, n in enumerate(n_pages):
        bt[i, :n] = perm[pos : pos + n].int()
        pos += n
        L = lens[i]
        if nan_fill and L % ps:  # unused tail slots of the last page
            last = int(bt[i, n - 1])
            kv[last, L % ps :, :512] = 0x7F
            kv[last, L % ps :, 512:].view(torch.bfloat16).fill_(float("nan"))
            kv_scale[last, L % ps :] = float("nan")
    q = torch.randn(b, s_q, h, 576, generator=gen).bfloat16()
    return q, k_pages, (kv, kv_scale), bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_emulation_close_to_exact_and_nan_never_leaks(seed, causal):
    q, k_pages, cache, bt, lens = _fp8_case(seed)
    out_x, lse_x = ref.mla_decode_exact(q, k_pages, bt, lens, causal=causal)
    out, lse = emulation.mla_decode_emulated(q, cache, bt, lens, causal=causal)
    assert torch.isfinite(out).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_x))
    assert ref.rel_l2(out, out_x) < 5e-2
    assert ref.cos_diff(out, out_x) < 1.5e-3
    assert ref.lse_max_abs(lse, lse_x) < 1e-2


def test_emulation_from_pages_equals_emulation_from_fp8_cache(seed):
    q, k_pages, cache, bt, lens = _fp8_case(seed, nan_fill=False)
    a = emulation.mla_decode_emulated(q, cache, bt, lens)
    b = emulation.mla_decode_emulated(q, k_pages, bt, lens, config="snapmla")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_online_implicit_dequant_equals_the_closed_form(seed):
    """Alg. 1's online rescaling (γ = 2^(m-m_new)·σ_p/σ_p_cur) equals summing each block's
    dequantized contribution σ_p,j·P_q,j·V at the final max (App. B Eq. 13–14)."""
    gen = torch.Generator().manual_seed(seed)
    R, L = 8, 300
    k = (torch.randn(L, 576, generator=gen) / 10).bfloat16()
    c, r, s = ref.quantize_rows(k)
    kq = emulation.QuantizedK(torch.cat([c.float(), r.float()], -1), s, c.float(), s)
    qc, qs = emulation.quantize_q_codes(torch.randn(R, 576, generator=gen).bfloat16(), emulation.SNAPMLA)
    vis = torch.full((R,), L)
    out, lse = emulation.decode_one(qc, qs, kq, vis, 0.05)
    s2 = (qc @ kq.qk_codes.T) * qs[:, None] * s[None, :] * torch.tensor(0.05 * ref.LOG2E)
    m_final = s2.amax(-1)
    num = torch.zeros(R, 512, dtype=torch.float64)
    den = torch.zeros(R, dtype=torch.float64)
    m_run = torch.full((R,), -math.inf)
    for j0 in range(0, L, 64):
        blk = slice(j0, min(L, j0 + 64))
        m_run = torch.maximum(m_run, s2[:, blk].amax(-1))
        p = torch.exp2(s2[:, blk] - m_run[:, None])
        pf = p * s[None, blk]
        sp = pf.amax(-1) / 448
        pq = ref.to_e4m3(pf * (448 / pf.amax(-1))[:, None]).double()
        w = torch.exp2((m_run - m_final).double())
        num += w[:, None] * sp.double()[:, None] * (pq @ kq.v_values[blk].double())
        den += w * p.double().sum(-1)
    torch.testing.assert_close(out.double(), num / den[:, None], rtol=2e-5, atol=1e-7)
    want_lse = (m_final.double() + torch.log2(den)) / ref.LOG2E
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)


@pytest.mark.parametrize("softmax_scale", [1.0, 30.0, 300.0])
def test_extreme_score_ranges_stay_finite_and_accurate(seed, softmax_scale):
    """Scores spread over thousands of log2 units: blocks far below the running max have
    P' in fp32's denormal range, where 448/rowmax(P') would overflow and γ turn O into
    inf/NaN (scale 30 did, before P_TINY, with data seeds 1 and 2). Against float64 softmax
    over the same quantized q and K (no P quantization) the error stays at P quantization's
    level."""
    for data_seed in (seed, 1, 2):
        _extreme_case(data_seed, softmax_scale)


def _extreme_case(seed, softmax_scale):
    gen = torch.Generator().manual_seed(seed)
    L = 256
    k = (torch.randn(L, 576, generator=gen) / 10).bfloat16()
    c, r, s = ref.quantize_rows(k)
    kq = emulation.QuantizedK(torch.cat([c.float(), r.float()], -1), s, c.float(), s)
    qc, qs = emulation.quantize_q_codes(torch.randn(4, 576, generator=gen).bfloat16(), emulation.SNAPMLA)
    s64 = (qc.double() @ kq.qk_codes.double().T) * qs.double()[:, None] * s.double()[None, :] * softmax_scale
    want = torch.softmax(s64, -1) @ (kq.v_values.double() * s.double()[:, None])
    for mma in ("hopper", "exact"):
        out, lse = emulation.decode_one(qc, qs, kq, torch.full((4,), L), softmax_scale, mma)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        if mma == "exact":  # (the tensor core's QK adder moves scores by ~1e-3 relative)
            assert ref.rel_l2(out, want) < 3e-2
            torch.testing.assert_close(lse.double(), torch.logsumexp(s64, -1), rtol=0, atol=1e-4 * softmax_scale)


@pytest.mark.parametrize("config", ["A", "B", "C", "D"])
def test_table2_configs_run_and_stay_sane(seed, config):
    q, k_pages, _, bt, lens = _fp8_case(seed, nan_fill=False)
    out_x, lse_x = ref.mla_decode_exact(q, k_pages, bt, lens)
    out, lse = emulation.mla_decode_emulated(q, k_pages, bt, lens, config=config)
    assert torch.isfinite(out).all()
    assert ref.rel_l2(out, out_x) < 0.1


def test_rope_unaware_config_a_is_clearly_worse_on_paper_style_data():
    gen = torch.Generator().manual_seed(1)
    q, k_pages, bt, lens = make_inputs("paper", 2, 1, 32, 2048, 64, gen)
    out_x, lse_x = ref.mla_decode_exact(q, k_pages, bt, lens)
    snap = emulation.mla_decode_emulated(q, ref.quantize_kv_cache(k_pages), bt, lens)
    a = emulation.mla_decode_emulated(q, k_pages, bt, lens, config="A")
    assert ref.lse_max_abs(a[1], lse_x) > 3 * ref.lse_max_abs(snap[1], lse_x)
    assert ref.rel_l2(a[0], out_x) > ref.rel_l2(snap[0], out_x)


def test_metrics():
    x = torch.tensor([1.0, 2.0, 3.0])
    assert ref.rel_l2(x, x) == 0 and ref.cos_diff(x, x) == 0 and ref.rmse(x, x) == 0
    assert ref.cos_diff(-x, x) == 2.0
    assert ref.lse_max_abs(torch.tensor([-math.inf, 1.0]), torch.tensor([-math.inf, 1.5])) == 0.5
    assert ref.lse_max_abs(torch.tensor([0.0, 1.0]), torch.tensor([-math.inf, 1.0])) == math.inf


def test_tensor_core_mma_truncates_like_hopper():
    """Hand-made cases of the fitted WGMMA adder (the fit itself: fp8_accum_probe.py, at cc70d70)."""
    mma = tensor_core.tensor_core_mma
    one = torch.tensor([[1.0, 2.0**-6]])
    # 2^-14 is below the 13-bit grid of the largest product (2^0): dropped, where fp32 keeps it
    assert mma(one, torch.tensor([[1.0, 2.0**-8]])).item() == 1.0
    assert (one @ torch.tensor([[1.0, 2.0**-8]]).T).item() == 1.0 + 2.0**-14
    # 2^-13 is on the grid: kept
    assert mma(one, torch.tensor([[1.0, 2.0**-7]])).item() == 1.0 + 2.0**-13
    # truncation is toward zero, also for a negative term (not toward -inf)
    assert mma(torch.tensor([[1.0, -(2.0**-6)]]), torch.tensor([[1.0, 2.0**-8]])).item() == 1.0
    # the incoming accumulator takes part in the alignment: 16 + 2^-10 loses the small term
    acc = torch.tensor([[16.0]])
    assert mma(torch.tensor([[2.0**-5]]), torch.tensor([[2.0**-5]]), acc).item() == 16.0
    # k = 32 per instruction: the second instruction aligns to its own largest product
    a = torch.zeros(1, 64)
    b = torch.zeros(1, 64)
    a[0, 0], b[0, 0] = 1.0, 1.0
    a[0, 32], b[0, 32] = 2.0**-6, 2.0**-7
    assert mma(a, b).item() == 1.0 + 2.0**-13
    # bf16 (k = 16): 25 alignment bits, result truncated to fp32's 23
    x = torch.tensor([[1.0, 2.0**-12]], dtype=torch.bfloat16)
    y = torch.tensor([[1.0, 2.0**-12]], dtype=torch.bfloat16)
    assert mma(x, y, kind="bf16").item() == 1.0  # 1 + 2^-24: below fp32's ulp of 1, truncated
    x2 = torch.tensor([[1.0, 2.0**-11]], dtype=torch.bfloat16)
    assert mma(x2, x2, kind="bf16").item() == 1.0 + 2.0**-22  # on the grid: kept


def test_emulation_modes():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 16, 576, generator=gen).to(torch.bfloat16)
    k = (torch.randn(1, 64, 576, generator=gen) / 10).to(torch.bfloat16)
    kv, ks = ref.quantize_kv_cache(k)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    L = torch.tensor([50], dtype=torch.int32)
    o_h, _ = emulation.mla_decode_emulated(q, (kv, ks), bt, L)
    o_x, _ = emulation.mla_decode_emulated(q, (kv, ks), bt, L, mma="exact")
    assert 0 < ref.rel_l2(o_h, o_x) < 1e-2  # different adders, same algorithm
    with pytest.raises(ValueError, match="mma"):
        emulation.mla_decode_emulated(q, k, bt, L, config="A", mma="hopper")


def test_pow2_is_exact_over_the_emulations_exponent_range():
    """The tensor-core adder model truncates at 2^e boundaries; 2^e must be exact on every
    device (torch.ldexp goes through pow(2, e), which CUDA rounds for some e)."""
    e = torch.arange(-1000, 1001)
    got = tensor_core._pow2(e)
    assert got.dtype == torch.float64
    assert got.tolist() == [2.0**int(k) for k in e]


def test_sparse_emulation_is_the_dense_one_over_the_same_list():
    """A list of a request's tokens in cache order is the dense decode: bit-identical."""
    torch.manual_seed(3)
    P, ps, b, h = 6, 32, 2, 16
    k = (torch.randn(P, ps, 576) / 10).clamp(-1, 1)
    kv, kv_scale = ref.quantize_kv_cache(k)
    q = torch.randn(b, 1, h, 576).bfloat16()
    bt = torch.stack([torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])]).int()
    lens = torch.tensor([70, 96], dtype=torch.int32)
    od, ld = emulation.mla_decode_emulated(q, (kv, kv_scale), bt, lens)
    idx = torch.full((b, 1, 96), -1, dtype=torch.int32)
    for i in range(b):
        slots = (bt[i].long()[:, None] * ps + torch.arange(ps)).flatten()[: int(lens[i])]
        idx[i, 0, : slots.numel()] = slots.int()
    os_, ls_ = sparse_reference.mla_decode_sparse_emulated(q, (kv, kv_scale), idx, topk_length=lens)
    assert torch.equal(od, os_) and torch.equal(ld, ls_)


def test_sparse_reference_semantics():
    """-1, ids outside the cache and positions past topk_length are no token; a duplicate
    counts twice; an empty list gives zeros and -inf; emulation close to exact."""
    torch.manual_seed(4)
    P, ps, h = 4, 16, 16
    k = (torch.randn(P, ps, 576) / 10).clamp(-1, 1)
    kv, kv_scale = ref.quantize_kv_cache(k)
    q = torch.randn(1, 1, h, 576).bfloat16().repeat(3, 1, 1, 1)
    idx = torch.tensor([[[5, -1, 9, 64, 7]], [[5, 9, 7, 2, 2]], [[-1, -1, -1, -1, -1]]], dtype=torch.int32)
    tl = torch.tensor([5, 3, 5], dtype=torch.int32)
    ox, lx = sparse_reference.mla_decode_sparse_exact(q, k, idx, topk_length=tl)
    # request 0 = {5, 9, 7} = request 1's first three
    assert torch.allclose(ox[0], ox[1]) and torch.allclose(lx[0], lx[1])
    assert torch.all(ox[2] == 0) and torch.all(torch.isneginf(lx[2]))
    dup = sparse_reference.mla_decode_sparse_exact(q[1:2], k, idx[1:2])[1]
    once = sparse_reference.mla_decode_sparse_exact(q[1:2], k, idx[1:2, :, :4])[1]
    assert torch.all(dup > once)  # token 2 twice: more mass than once
    oe, le = sparse_reference.mla_decode_sparse_emulated(q, (kv, kv_scale), idx, topk_length=tl)
    assert ref.rel_l2(oe[:2], ox[:2]) < 0.05
    assert torch.all(oe[2] == 0) and torch.all(torch.isneginf(le[2]))


def test_emulation_ends_as_the_epilogue_one_token_requests():
    """A request of one token: P = 1, P' = σ_k, its e4m3 code 448, ℓ = 448/σ_k, o = 448·code;
    out = o·fp32(1/ℓ), the epilogue's order (one reciprocal per row, then a multiply). o/ℓ
    lands an fp32 ulp away for some tokens' σ_k (every output of the token), and where
    code·σ_k sits near a bf16 rounding midpoint that flips its bf16 rounding: a fifth of the
    outputs of one request of the GPU tests, 2.2e-3 rel-L2 against the kernel."""
    torch.manual_seed(7)
    n, h = 256, 2
    pages = (torch.randn(n, 1, 576) / 10).to(torch.bfloat16)
    kv, kv_scale = ref.quantize_kv_cache(pages)
    table = torch.arange(n, dtype=torch.int32)[:, None]
    lens = torch.ones(n, dtype=torch.int32)
    q = torch.randn(n, 1, h, 576).to(torch.bfloat16)
    out, _ = emulation.mla_decode_emulated(q, (kv, kv_scale), table, lens)
    codes = kv[:, 0, :512].view(torch.float8_e4m3fn).float()
    sigma = kv_scale[:, 0]
    ell = torch.full_like(sigma, 448.0) / sigma
    o = 448.0 * codes
    epilogue = o * (1.0 / ell)[:, None]
    assert torch.equal(out[:, 0], epilogue[:, None].expand(n, h, 512))
    divided = (o / ell[:, None]).bfloat16()
    assert not torch.equal(epilogue.bfloat16(), divided)  # the draws where the order shows
