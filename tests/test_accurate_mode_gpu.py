"""GPU tests of the accurate mode (``q_precision="e4m3x2"``): the query's content as hi + lo
e4m3 on one scale, a second QK content chain; every case against the mode's bit-faithful
emulation (``emulation.SNAPMLA_X2``) and float64."""

import pytest
import torch

from decode_cases import build_case
from snapmla_cute import emulation, mla_decode, quantize_q
from snapmla_cute import reference as ref

pytestmark = pytest.mark.gpu

EMU_REL, EMU_LSE = 2e-3, 1e-3


def _references(c, causal):
    exact = ref.mla_decode_exact(c["q"], c["k_pages"], c["block_table"], c["cache_seqlens"], causal=causal)
    emu = emulation.mla_decode_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"],
                                        c["cache_seqlens"], causal=causal, config=emulation.SNAPMLA_X2)
    plain = emulation.mla_decode_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"],
                                          c["cache_seqlens"], causal=causal)
    return exact, emu, plain


def _check(c, out, lse, causal):
    (ox, lx), (oe, le), (op, _) = _references(c, causal)
    got = out.float()
    assert not torch.isnan(got).any() and not torch.isnan(lse).any()
    err = ref.rel_l2(got, oe.bfloat16().float())
    assert err <= EMU_REL, f"vs the e4m3x2 emulation rel-L2 {err:.2e}"
    assert ref.lse_max_abs(lse, le) <= EMU_LSE
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    # the mode's point: closer to float64 than the e4m3 query
    assert ref.rel_l2(got, ox) <= 1.1 * ref.rel_l2(oe, ox)
    return ref.rel_l2(oe, ox), ref.rel_l2(op, ox)


def test_quantize_q_split_is_bit_exact_with_the_emulation():
    q = (torch.randn(3, 2, 16, 576, device="cuda") * torch.logspace(-3, 2, 576, device="cuda")).bfloat16()
    q_nope, q_rope, q_scale, q_lo = quantize_q(q, precision="e4m3x2")
    codes, scale = emulation.quantize_q_codes(q.float().cpu(), emulation.SNAPMLA_X2)
    assert torch.equal(q_scale.cpu(), scale)
    assert torch.equal(q_nope.float().cpu(), codes[..., :512])
    assert torch.equal(q_rope.float().cpu(), codes[..., 512:576])
    assert torch.equal(q_lo.float().cpu(), codes[..., 576:])
    plain = quantize_q(q)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b) for a, b in zip(plain, (q_nope, q_rope, q_scale)))


@pytest.mark.parametrize("h, s_q, page_size, causal, lens", [
    (128, 1, 64, False, [4096, 1, 0, 777]),
    (64, 2, 32, True, [1, 2, 300, 2048]),
    (16, 4, 16, True, [3, 129, 1000]),
    (8, 8, 128, True, [5, 8, 4000]),
    (128, 1, 64, False, [65, 64, 63, 8192]),
])
def test_matches_the_emulation(h, s_q, page_size, causal, lens):
    c = build_case(len(lens), s_q, h, page_size, lens, dist="realistic", seed=h + s_q)
    b = len(lens)
    for q in (c["q"], quantize_q(c["q"], precision="e4m3x2")):
        out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, h, s_q), float("nan"), device="cuda")
        kw = {"q_precision": "e4m3x2"} if isinstance(q, torch.Tensor) else {}
        mla_decode(q, c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, out=out, lse=lse, **kw)
        x2_err, e4m3_err = _check(c, out, lse, causal)
    assert x2_err < e4m3_err


def test_graph_replay_with_new_lengths():
    from snapmla_cute import decode_metadata

    lens = [1000, 3000]
    c = build_case(2, 1, 128, 64, lens, dist="realistic", seed=3)
    qq = quantize_q(c["q"], precision="e4m3x2")
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=128, cluster=1)
    out = torch.empty(2, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 128, 1, device="cuda")
    step = lambda: mla_decode(qq, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out,  # noqa: E731
                              lse=lse, check=False)
    step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    c["cache_seqlens"].copy_(torch.tensor([7, 2500], dtype=torch.int32))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(c, out, lse, False)


def test_bad_precision_and_query_rejected_before_launch():
    c = build_case(1, 1, 16, 64, [100], seed=1)
    out = torch.full((1, 1, 16, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((1, 16, 1), 7.0, device="cuda")
    args = (c["cache"], c["block_table"], c["cache_seqlens"])
    with pytest.raises(ValueError, match="q_precision"):
        mla_decode(c["q"], *args, out=out, lse=lse, q_precision="e5m2")
    with pytest.raises(ValueError, match="q_precision"):
        quantize_q(c["q"], precision="fp8")
    qq = quantize_q(c["q"], precision="e4m3x2")
    with pytest.raises(ValueError, match="q_precision"):
        mla_decode(qq, *args, out=out, lse=lse, q_precision="e4m3")  # four tensors are e4m3x2
    with pytest.raises(ValueError, match="q_lo"):
        mla_decode((*qq[:3], qq[3][..., :256]), *args, out=out, lse=lse)
    with pytest.raises(TypeError, match="out"):
        quantize_q(c["q"], precision="e4m3x2", out=quantize_q(c["q"]))  # three buffers for four outputs
    torch.cuda.synchronize()
    assert (out.float() == 7.0).all() and (lse == 7.0).all()


@pytest.mark.parametrize("h, s_q", [(128, 1), (64, 2), (8, 8)])
def test_sparse_matches_the_emulation(h, s_q):
    from test_sparse_gpu import build_sparse_case

    from snapmla_cute import mla_decode_sparse
    from snapmla_cute import sparse_reference as sr

    c = build_sparse_case(3, s_q, h, 64, 1000, 300, seed=h, minus_one=0.05, lengths=[0, 1, 150, 300])
    b = 3
    kw = dict(topk_length=c["topk_length"])
    for q in (c["q"], quantize_q(c["q"], precision="e4m3x2")):
        out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, h, s_q), float("nan"), device="cuda")
        extra = {"q_precision": "e4m3x2"} if isinstance(q, torch.Tensor) else {}
        mla_decode_sparse(q, c["cache"], c["indices"], out=out, lse=lse, **kw, **extra)
        oe, le = sr.mla_decode_sparse_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["indices"], **kw,
                                               config=emulation.SNAPMLA_X2)
        ox, lx = sr.mla_decode_sparse_exact(c["q"], c["k_pages"], c["indices"], **kw)
        assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
        assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
        assert ref.lse_max_abs(lse, le) <= EMU_LSE
        assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))


def test_custom_ops_run_the_accurate_mode():
    from snapmla_cute import decode_metadata

    c = build_case(2, 2, 64, 64, [700, 1500], dist="realistic", seed=4)
    md = decode_metadata(c["cache_seqlens"], s_q=2, heads=64, cluster=1)
    q_nope, q_rope, q_scale, q_lo = torch.ops.snapmla.quantize_q_x2(c["q"])
    out, lse = torch.ops.snapmla.mla_decode(
        q_nope, q_rope, q_scale, c["cache"].kv, c["cache"].kv_scale, c["block_table"], c["cache_seqlens"], md.sched,
        md.split_offsets, md.o_partial, md.lse_partial, md.counters, 576**-0.5, True, q_lo)
    _check(c, out, lse, True)
