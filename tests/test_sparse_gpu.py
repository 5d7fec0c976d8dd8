"""GPU tests of the sparse (top-k) FP8 decode: every case against the bit-faithful emulation
and float64 exact attention over the same index lists."""

import random

import pytest
import torch

from snapmla_cute import FP8KVCache, mla_decode_sparse, quantize_q, sparse_decode_metadata, sparse_reference
from snapmla_cute import reference as ref
from snapmla_cute.heads import SPARSE_HEADS

pytestmark = pytest.mark.gpu

EMU_REL, EMU_LSE = 2e-3, 1e-3
EXACT_REL, EXACT_COS = 5e-2, 1.5e-3


def build_sparse_case(b, s_q, h, page_size, ctx, topk, *, seed=0, dup=False, minus_one=0.0, lengths=None,
                      device="cuda"):
    """A cache whose slots hold b requests' contexts (``ctx`` tokens each, at shuffled slots;
    every other slot NaN), and per query token ``topk`` ids drawn from its request's slots
    (distinct unless ``dup``), a fraction ``minus_one`` of them -1."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n_pages = (b * ctx + page_size - 1) // page_size + 3
    n_slots = n_pages * page_size
    k = (torch.randn(n_slots, 576, generator=gen) / 10).clamp(-1, 1).to(torch.bfloat16)
    k_pages = k.view(n_pages, page_size, 576)
    q = torch.randn(b, s_q, h, 576, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(n_slots, generator=gen)
    own = perm[: b * ctx].view(b, ctx)  # request i's context slots
    cache = FP8KVCache.allocate(n_pages, page_size, device=device, fill_nan=True)
    kv, kv_scale = ref.quantize_kv_cache(k_pages)
    used = torch.zeros(n_slots, dtype=torch.bool)
    used[own.flatten()] = True
    cache.kv.view(n_slots, -1)[used.to(device)] = kv.view(n_slots, -1).to(device)[used.to(device)]
    cache.kv_scale.view(-1)[used.to(device)] = kv_scale.view(-1).to(device)[used.to(device)]
    idx = torch.empty(b, s_q, topk, dtype=torch.int64)
    for i in range(b):
        for t in range(s_q):
            if dup:
                pick = torch.randint(0, ctx, (topk,), generator=gen)
            else:
                assert topk <= ctx
                pick = torch.randperm(ctx, generator=gen)[:topk]
            idx[i, t] = own[i, pick]
    if minus_one:
        idx[torch.rand(idx.shape, generator=gen) < minus_one] = -1
    topk_length = None
    if lengths is not None:
        topk_length = torch.tensor([rng.choice(lengths) for _ in range(b)], dtype=torch.int32, device=device)
    return dict(q=q.to(device), k_pages=k_pages.to(device), cache=cache, indices=idx.to(torch.int32).to(device),
                topk_length=topk_length)


def check_sparse(c, out, lse, *, softmax_scale=None):
    kw = dict(topk_length=c["topk_length"], softmax_scale=softmax_scale)
    ox, lx = sparse_reference.mla_decode_sparse_exact(c["q"], c["k_pages"], c["indices"], **kw)
    oe, le = sparse_reference.mla_decode_sparse_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["indices"],
                                                         **kw)
    assert not torch.isnan(out.float()).any(), "output not fully written, or NaN leaked"
    assert not torch.isnan(lse).any()
    got = out.float()
    emu_err = ref.rel_l2(got, oe.bfloat16().float())
    assert emu_err <= EMU_REL, f"vs emulation rel-L2 {emu_err:.2e}"
    assert ref.lse_max_abs(lse, le) <= EMU_LSE, f"vs emulation LSE {ref.lse_max_abs(lse, le):.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    assert ref.rel_l2(got, ox) <= EXACT_REL
    assert ref.cos_diff(got, ox) <= EXACT_COS


def run_sparse(c, **kw):
    b, s_q, h, _ = c["q"].shape
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    r = mla_decode_sparse(c["q"], c["cache"], c["indices"], topk_length=c["topk_length"], out=out, lse=lse, **kw)
    assert r[0] is out and r[1] is lse
    return out, lse


@pytest.mark.parametrize("s_q", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("h", SPARSE_HEADS)
def test_heads_and_query_tokens(seed, h, s_q):
    rng = random.Random(seed)
    page_size = rng.choice([16, 32, 64, 128])
    topk = rng.choice([1, 63, 64, 65, 300, 777])
    c = build_sparse_case(3, s_q, h, page_size, 1000, topk, seed=seed, minus_one=0.05,
                          lengths=[0, 1, topk // 2, topk])
    out, lse = run_sparse(c)
    check_sparse(c, out, lse)


def test_quantized_query_and_scale(seed):
    c = build_sparse_case(2, 2, 64, 64, 600, 256, seed=seed)
    b, s_q, h, _ = c["q"].shape
    out, lse = mla_decode_sparse(quantize_q(c["q"]), c["cache"], c["indices"], softmax_scale=0.07)
    check_sparse(c, out, lse, softmax_scale=0.07)


@pytest.mark.parametrize("h, s_q", [(128, 2), (8, 7)])
def test_edge_cases(seed, h, s_q):
    """-1 everywhere in one list (zeros, -inf), duplicates counted twice, a length of 0,
    and NaN in every slot no list references."""
    c = build_sparse_case(4, s_q, h, 16, 500, 200, seed=seed, dup=True, minus_one=0.2)
    c["indices"][1, 0] = -1  # no token at all
    c["indices"][2, 1, :100] = c["indices"][2, 1, 0]  # one token 100 times
    c["topk_length"] = torch.tensor([200, 200, 150, 0], dtype=torch.int32, device="cuda")
    out, lse = run_sparse(c)
    check_sparse(c, out, lse)
    assert torch.all(out[1, 0] == 0) and torch.all(torch.isneginf(lse[1, :, 0]))
    assert torch.all(out[3] == 0) and torch.all(torch.isneginf(lse[3]))


def test_out_of_range_ids(seed):
    """check=True: a clear error and nothing written; check=False: such an id is no token
    (never read), as -1 is."""
    c = build_sparse_case(2, 1, 64, 32, 400, 300, seed=seed)
    n_slots = c["cache"].num_slots
    bad = c["indices"].clone()
    bad[0, 0, 3] = n_slots
    bad[1, 0, 7] = -5
    bad[1, 0, 9] = 2**31 - 1
    b, s_q, h, _ = c["q"].shape
    out = torch.full((b, s_q, h, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), 7.0, device="cuda")
    with pytest.raises(ValueError, match="indices"):
        mla_decode_sparse(c["q"], c["cache"], bad, out=out, lse=lse)
    assert torch.all(out == 7) and torch.all(lse == 7)
    with pytest.raises(ValueError, match="topk_length"):
        mla_decode_sparse(c["q"], c["cache"], c["indices"], topk_length=torch.tensor([301, 0], dtype=torch.int32,
                                                                                      device="cuda"))
    md = sparse_decode_metadata(b, s_q, h, 300)
    out, lse = mla_decode_sparse(c["q"], c["cache"], bad, metadata=md, out=out, lse=lse, check=False)
    torch.cuda.synchronize()
    masked = bad.clone()
    masked[(masked < 0) | (masked >= n_slots)] = -1
    c["indices"] = masked
    check_sparse(c, out, lse)


def test_unchecked_negative_length_is_an_empty_list(seed):
    """check=False: a negative topk_length plans as 0 (an empty list: zeros, -inf), not as
    split rows outside the partials; the other requests as the emulation."""
    c = build_sparse_case(3, 2, 64, 64, 600, 300, seed=seed)
    b, s_q, h, _ = c["q"].shape
    md = sparse_decode_metadata(b, s_q, h, 300)
    lengths = torch.tensor([-100000, 300, 250], dtype=torch.int32, device="cuda")
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    mla_decode_sparse(quantize_q(c["q"]), c["cache"], c["indices"], topk_length=lengths, metadata=md, out=out,
                      lse=lse, check=False)
    torch.cuda.synchronize()
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    c["topk_length"] = lengths.clamp_min(0)
    check_sparse(c, out, lse)


@pytest.mark.parametrize("h, b, topk", [(128, 1, 32768), (64, 2, 16384), (16, 3, 5000), (8, 1, 20000)])
def test_long_lists_split(seed, h, b, topk):
    """Few lists over many CTAs: split-KV over the lists, merged in the launch."""
    c = build_sparse_case(b, 1, h, 64, topk + 100, topk, seed=seed, minus_one=0.01, lengths=[topk, topk - 33])
    out, lse = run_sparse(c)
    check_sparse(c, out, lse)


def test_gather_without_the_l2_hint(seed):
    """``DecodeConfig.kv_evict_first=False``: the gather's cp.async at L2's default policy
    (the default hints evict-first at one query token per request): the same output and LSE
    bit for bit, over a list split across CTAs."""
    from snapmla_cute.tuning import DECODE_TUNING

    c = build_sparse_case(2, 1, 64, 64, 6000, 5000, seed=seed, minus_one=0.01)
    out, lse = run_sparse(c)
    check_sparse(c, out, lse)
    DECODE_TUNING.update(kv_evict_first=False)
    try:
        out2, lse2 = run_sparse(c)
    finally:
        DECODE_TUNING.clear()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_matches_dense_over_the_same_tokens(seed):
    """Lists of a request's whole context in order: the dense decode's work; both kernels
    match the same emulation."""
    from snapmla_cute import mla_decode

    b, h, L, ps = 3, 128, 2048, 64
    c = build_sparse_case(b, 1, h, ps, L, L, seed=seed)
    own = torch.sort(c["indices"][:, 0], dim=-1).values  # any order works; sorted is the dense one
    c["indices"] = own[:, None].contiguous()
    out, lse = run_sparse(c)
    check_sparse(c, out, lse)
    # the same tokens copied into pages of their own, decoded by the dense kernel
    kv = c["cache"].kv.view(-1, 640)[own.flatten().long()].view(b * L // ps, ps, 640)
    ks = c["cache"].kv_scale.view(-1)[own.flatten().long()].view(b * L // ps, ps)
    dense = FP8KVCache(kv.contiguous(), ks.contiguous())
    bt = torch.arange(b * L // ps, dtype=torch.int32, device="cuda").view(b, L // ps)
    od, ld = mla_decode(c["q"], dense, bt, torch.full((b,), L, dtype=torch.int32, device="cuda"))
    assert ref.rel_l2(out.float(), od.float()) <= EMU_REL
    assert ref.lse_max_abs(lse, ld) <= EMU_LSE


@pytest.mark.parametrize("h, s_q", [(64, 2), (8, 8)])
def test_graph_replay_with_new_indices(seed, h, s_q):
    """Captured once with its metadata, replayed with new indices and lengths in place."""
    b, topk = 4, 512
    c = build_sparse_case(b, s_q, h, 64, 1500, topk, seed=seed, lengths=[topk, 100])
    md = sparse_decode_metadata(b, s_q, h, topk)
    q, idx, tl = c["q"].clone(), c["indices"].clone(), c["topk_length"].clone()
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, h, s_q, device="cuda")
    mla_decode_sparse(q, c["cache"], idx, topk_length=tl, metadata=md, out=out, lse=lse, check=False)  # compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_decode_sparse(q, c["cache"], idx, topk_length=tl, metadata=md, out=out, lse=lse, check=False)
    for k in range(3):
        c2 = build_sparse_case(b, s_q, h, 64, 1500, topk, seed=seed + 1 + k, lengths=[topk, 7, 0])
        # the same cache; new lists into it (the cache of c2 is not used)
        own = c["indices"].flatten().unique()
        pick = own[torch.randint(0, own.numel(), (b, s_q, topk), device="cuda")]
        idx.copy_(pick.to(torch.int32))
        tl.copy_(c2["topk_length"])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        c["indices"], c["topk_length"] = idx.clone(), tl.clone()
        check_sparse(c, out, lse)


def test_custom_op(seed):
    b, s_q, h, topk = 2, 1, 16, 300
    c = build_sparse_case(b, s_q, h, 32, 700, topk, seed=seed, lengths=[topk, 50])
    md = sparse_decode_metadata(b, s_q, h, topk)
    qn, qr, qs = quantize_q(c["q"])
    out, lse = torch.ops.snapmla.mla_decode_sparse(
        qn, qr, qs, c["cache"].kv, c["cache"].kv_scale, c["indices"], c["topk_length"], md.sched,
        md.split_offsets, md.o_partial, md.lse_partial, md.counters, 576**-0.5,
    )
    check_sparse(c, out, lse)


def test_cluster_plan(seed):
    """Lists that fill half the SMs: the metadata launches in clusters of two and each list's
    halves merge on-chip (distributed shared memory), against the emulation and float64."""
    from snapmla_cute.heads import CLUSTER_SM_COUNTS

    if torch.cuda.get_device_properties(0).multi_processor_count not in CLUSTER_SM_COUNTS:
        pytest.skip("clusters of two are not launched on this device")
    b, h, topk = 40, 64, 1500
    c = build_sparse_case(b, 1, h, 64, 4000, topk, seed=seed, minus_one=0.01, lengths=[topk, 0, 700])
    md = sparse_decode_metadata(b, 1, h, topk)
    assert md.cluster == 2
    out = torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, 1), float("nan"), device="cuda")
    mla_decode_sparse(c["q"], c["cache"], c["indices"], topk_length=c["topk_length"], metadata=md, out=out, lse=lse)
    check_sparse(c, out, lse)
