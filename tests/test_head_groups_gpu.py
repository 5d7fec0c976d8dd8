"""GPU tests of the head-group plan (``decode_metadata(head_groups=...)``): a small batch's
requests of 128 heads run as groups of 16 heads, each on its own cluster of CTAs merged
on-chip. Every case against the bit-faithful emulation and float64, outputs poisoned, NaN
in every unused cache slot (``build_case``)."""

import random

import pytest
import torch

from decode_cases import build_case, references
from snapmla_cute import decode_metadata, mla_decode, quantize_q
from snapmla_cute import reference as ref
from snapmla_cute.heads import CLUSTER_SM_COUNTS, default_head_groups

pytestmark = pytest.mark.gpu

EMU_REL, EMU_LSE = 2e-3, 1e-3


def _need_clusters():
    if torch.cuda.get_device_properties(0).multi_processor_count not in CLUSTER_SM_COUNTS:
        pytest.skip("the head-group plan's cluster launches are not measured on this device")


def _poisoned(b, h):
    return (torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda"),
            torch.full((b, h, 1), float("nan"), device="cuda"))


def _check(c, out, lse, refs=None):
    (ox, lx), (oe, le) = references(c, False) if refs is None else refs
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse, le) <= EMU_LSE
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    assert ref.rel_l2(out.float(), ox) <= 5e-2


@pytest.mark.parametrize("b, h, k, page_size", [(1, 128, 8, 64), (1, 128, 4, 16), (2, 128, 4, 128), (3, 128, 2, 64),
                                                (4, 128, 2, 32), (2, 128, 1, 64), (2, 64, 8, 64), (4, 64, 4, 64),
                                                (8, 64, 2, 64), (5, 128, 1, 64)])
def test_head_groups_match_the_references(seed, b, h, k, page_size):
    """Lengths 0, 1, a partial block and longer (the kernel re-plans the groups' work at any
    length: whole, cluster or split plans on the same parts); three calls with poisoned
    outputs; the plan's counters back to zero. 128 and 64 heads (8 and 4 groups); b5 h128 on
    plain launches has 40 kernel requests, past the one-warp plan's 32."""
    _need_clusters()
    rng = random.Random(seed * 31 + b)
    pool = [0, 1, 63, 640, rng.randint(2, 2048), rng.randint(2049, 5000)]
    lens = [pool[(i + seed) % len(pool)] for i in range(b)] if b > 1 else [rng.choice(pool[2:])]
    g = h // 16
    c = build_case(b, 1, h, page_size, lens, seed=seed)
    refs = references(c, False)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, head_groups=g, cluster=k)
    assert (md.head_groups, md.cluster, md.num_parts) == (g, k, b * g * k)
    for _ in range(3):
        out, lse = _poisoned(b, h)
        mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
        _check(c, out, lse, refs)
        assert torch.all(md.counters == 0)
        for i, L in enumerate(lens):
            if L == 0:
                assert torch.all(out[i] == 0) and torch.all(torch.isneginf(lse[i]))


def test_head_groups_from_a_bf16_and_a_quantized_query(seed):
    """The step that quantizes a bf16 query first and the one-call hot path (quantized q,
    metadata and outputs given, ``check=False``) give the same bytes, both within the
    references' tolerances."""
    _need_clusters()
    b, h = 2, 128
    c = build_case(b, 1, h, 64, [700, 1500], seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, head_groups=8)
    assert (md.head_groups, md.cluster) == (8, 4)
    out, lse = _poisoned(b, h)
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
    _check(c, out, lse)
    qq = quantize_q(c["q"])
    out2, lse2 = _poisoned(b, h)
    for _ in range(2):  # the second call takes the hot path
        mla_decode(qq, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out2, lse=lse2, check=False)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_head_groups_in_the_accurate_mode(seed):
    """Q as hi + lo (three KV stages) on the head-group plan, against the plain plan's
    accurate call."""
    _need_clusters()
    b, h = 1, 128
    c = build_case(b, 1, h, 64, [1000], seed=seed)
    q4 = quantize_q(c["q"], precision="e4m3x2")
    outs = []
    for g in (8, 1):
        md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, head_groups=g, cluster=8 if g > 1 else 1)
        out, lse = _poisoned(b, h)
        mla_decode(q4, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
        outs.append((out.float(), lse))
    (ox, _), _ = references(c, False)
    assert ref.rel_l2(outs[0][0], outs[1][0]) <= 2e-3
    assert ref.lse_max_abs(outs[0][1], outs[1][1]) <= 1e-3
    assert ref.rel_l2(outs[0][0], ox) <= ref.rel_l2(outs[1][0], ox) * 1.1 + 1e-4


def test_head_groups_replayed_in_a_graph_with_new_lengths(seed):
    """Captured once at short lengths, replayed with new block tables and lengths (0, 1,
    past the choice's limit), outputs poisoned before each replay."""
    _need_clusters()
    rng = random.Random(seed)
    b, h, ps = 2, 128, 64
    lens0 = [640, 640]
    c = build_case(b, 1, h, ps, [6000, 6000], seed=seed)  # room for every replay's lengths
    lens_t = torch.tensor(lens0, dtype=torch.int32, device="cuda")
    md = decode_metadata(lens_t, s_q=1, heads=h, max_seqlen=640)  # replayed past it below: slower, still exact
    assert (md.head_groups, md.cluster) == (8, 4)
    qq = quantize_q(c["q"])
    out, lse = _poisoned(b, h)
    call = lambda: mla_decode(qq, c["cache"], c["block_table"], lens_t, metadata=md, out=out, lse=lse,  # noqa: E731
                              check=False)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in ([0, 1], [640, 2047], [6000, 3], [rng.randint(1, 6000), rng.randint(1, 6000)]):
        lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        c2 = dict(c, cache_seqlens=lens_t.clone())
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(c2, out, lse)
        assert torch.all(md.counters == 0)


def test_default_head_groups_where_measured():
    """``decode_metadata``'s own choice, made from a stated ``max_seqlen`` (no read of the
    lengths, so under capture too): 128 heads at batches 1-4 and 64 at 1-8, one query token,
    short lengths; not without ``max_seqlen``, at longer ones, 128 heads at batch 8, s_q 2,
    32 heads, nor when parts or clusters are given."""
    _need_clusters()
    lens = lambda b, L: torch.full((b,), L, dtype=torch.int32, device="cuda")  # noqa: E731
    for b, h, k in ((1, 128, 8), (2, 128, 4), (3, 128, 2), (4, 128, 2), (4, 64, 4), (8, 64, 2)):
        md = decode_metadata(lens(b, 640), s_q=1, heads=h, max_seqlen=640)
        assert (md.head_groups, md.cluster, md.num_parts) == (h // 16, k, b * h // 16 * k)
        assert default_head_groups(b, 1, h, 640) == (h // 16, k)
    assert decode_metadata(lens(1, 640), s_q=1, heads=128).head_groups == 1
    assert decode_metadata(lens(1, 640), s_q=1, heads=128, max_seqlen=640, num_parts=64).head_groups == 1
    assert decode_metadata(lens(1, 640), s_q=1, heads=128, max_seqlen=640, cluster=1).head_groups == 1
    for b, s_q, h, L in ((1, 1, 128, 8192), (8, 1, 128, 640), (1, 2, 128, 640), (1, 1, 32, 640)):
        assert decode_metadata(lens(b, 640), s_q=s_q, heads=h, max_seqlen=L).head_groups == 1
    graph = torch.cuda.CUDAGraph()
    t = lens(1, 640)
    with torch.cuda.graph(graph):
        md = decode_metadata(t, s_q=1, heads=128, max_seqlen=640)
    assert (md.head_groups, md.cluster) == (8, 8)


def test_head_group_metadata_rejected_where_it_does_not_apply():
    lens = torch.full((1,), 640, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head_groups"):
        decode_metadata(lens, s_q=2, heads=128, head_groups=8)
    with pytest.raises(ValueError, match="head_groups"):
        decode_metadata(lens, s_q=1, heads=128, head_groups=4)
    with pytest.raises(ValueError, match="num_parts"):
        decode_metadata(lens.repeat(2), s_q=1, heads=128, head_groups=8, cluster=8)
    with pytest.raises(ValueError, match="max_seqlen"):
        decode_metadata(lens, s_q=1, heads=128, max_seqlen=-1)
    for bad in (0, 8.0, True, 2):
        with pytest.raises(ValueError, match="head_groups"):
            decode_metadata(lens, s_q=1, heads=128, head_groups=bad)
    c = build_case(1, 1, 128, 64, [640])
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=128, head_groups=8, cluster=8)
    vis = torch.full((1, 1), 640, dtype=torch.int32, device="cuda")
    out, lse = _poisoned(1, 128)
    with pytest.raises(ValueError, match="head_groups"):
        mla_decode(quantize_q(c["q"]), c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out,
                   lse=lse, causal=True, visible=vis)
    assert torch.isnan(out.float()).all()
