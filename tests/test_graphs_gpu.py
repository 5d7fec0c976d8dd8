"""CUDA graphs and torch.compile on the GPU: captured/compiled decode steps match eager."""

import random

import pytest
import torch

from snapmla_cute import FP8KVCache, append_kv, decode_metadata, mla_decode, quantize_q
from snapmla_cute import reference as ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("check", [True, False])  # False: the one-FFI-call hot path is captured
def test_graph_replays_with_changing_lengths_match_eager(seed, check):
    rng = random.Random(seed)
    b, h, s_q, ps, pages_per = 4, 64, 1, 64, 8
    pool = b * pages_per
    cache = FP8KVCache.allocate(pool, ps)
    history = (torch.randn(pool * ps, 576, device="cuda") / 10).to(torch.bfloat16)
    append_kv(cache, history, torch.arange(pool * ps, device="cuda"))
    q = torch.empty(b, s_q, h, 576, dtype=torch.bfloat16, device="cuda")
    new_kv = torch.empty(b, 576, dtype=torch.bfloat16, device="cuda")
    slots = torch.empty(b, dtype=torch.int64, device="cuda")
    block_table = torch.empty(b, pages_per, dtype=torch.int32, device="cuda")
    seqlens = torch.full((b,), pages_per * ps, dtype=torch.int32, device="cuda")
    md = decode_metadata(seqlens, s_q=s_q, heads=h)
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device="cuda")

    def fill(lens):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
        new_kv.copy_((torch.randn(b, 576, device="cuda") / 10).to(torch.bfloat16))
        perm = torch.randperm(pool, device="cuda").int().view(b, pages_per)
        block_table.copy_(perm)
        s = [-1 if L == 0 else int(perm[i, (L - 1) // ps]) * ps + (L - 1) % ps for i, L in enumerate(lens)]
        slots.copy_(torch.tensor(s, device="cuda"))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32, device="cuda"))

    def step():
        append_kv(cache, new_kv, slots)
        mla_decode(q, cache, block_table, seqlens, metadata=md, out=out, lse=lse, check=check)

    fill([ps * pages_per] * b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(50):
        lens = [rng.randint(1, pages_per * ps) for _ in range(b)]
        if replay % 7 == 3:
            lens[rng.randrange(b)] = 0  # a request dropping to length 0
        fill(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got_out, got_lse = out.clone(), lse.clone()
        want_out, want_lse = mla_decode(q, cache, block_table, seqlens)  # eager, same cache
        assert torch.equal(got_out, want_out), f"replay {replay}: lens {lens}"
        assert torch.equal(got_lse, want_lse)
        written = slots >= 0
        c, r, s = ref.quantize_rows(new_kv[written])
        assert torch.equal(cache.kv.view(-1, 640)[slots[written]], ref.pack_kv_rows(c, r))
        for i, L in enumerate(lens):
            if L == 0:
                assert torch.all(got_out[i] == 0) and torch.all(got_lse[i] == float("-inf"))


def test_capture_without_metadata_is_refused(seed):
    cache = FP8KVCache.allocate(2, 64)
    q = torch.randn(1, 1, 16, 576, device="cuda").to(torch.bfloat16)
    bt = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    mla_decode(q, cache, bt, lens)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="capture needs metadata"):
        with torch.cuda.graph(graph):
            mla_decode(q, cache, bt, lens)


@pytest.mark.parametrize("s_q, h", [(2, 32), (8, 8)])
def test_compiled_step_matches_eager(seed, s_q, h):
    from test_torch_ops import decode_step

    b, ps, pages = 3, 64, 12
    lens = torch.tensor([200, 1, 64], dtype=torch.int32, device="cuda")
    md = decode_metadata(lens, s_q=s_q, heads=h)

    def inputs():
        cache = FP8KVCache.allocate(pages, ps)
        append_kv(cache, (torch.randn(pages * ps, 576, device="cuda", generator=None) / 10).to(torch.bfloat16), torch.arange(pages * ps, device="cuda"))
        return cache

    torch.manual_seed(seed)
    cache_a = inputs()
    cache_b = FP8KVCache(cache_a.kv.clone(), cache_a.kv_scale.clone())
    q = torch.randn(b, s_q, h, 576, device="cuda").to(torch.bfloat16)
    new_kv = (torch.randn(b * s_q, 576, device="cuda") / 10).to(torch.bfloat16)
    slots = torch.randperm(pages * ps, device="cuda")[: b * s_q]
    bt = torch.randperm(pages, device="cuda").int()[: 3 * 4].view(3, 4)
    args = lambda c: (q, c.kv, c.kv_scale, new_kv, slots, bt, lens, md.sched, md.split_offsets, md.o_partial, md.lse_partial, md.counters)
    eager = decode_step(*args(cache_a))
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True)(*args(cache_b))
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert torch.equal(cache_a.kv, cache_b.kv)


def test_back_to_back_decodes_in_one_graph(seed):
    """Decode calls back to back in one stream share a metadata (split counters, partial
    buffers), and with programmatic dependent launch (always on) the next may be
    scheduled while the previous one still merges: each call must still read only its own
    inputs and leave the counters at zero. Six calls captured in one graph, each with its
    own (pre-quantized: the graph holds decode kernels only) query and outputs, split
    requests (b2 over the default 66 parts), replayed twice; each against the eager call
    (bit for bit), the emulation and float64 attention."""
    from decode_cases import build_case, references
    from test_decode_gpu import EMU_LSE, EMU_REL, EXACT_COS, EXACT_REL

    calls = 6
    c = build_case(2, 1, 128, 64, [640, 3000], seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=128)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qs = [torch.randn(c["q"].shape, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(calls)]
    qqs = [quantize_q(q) for q in qs]
    outs = [torch.empty(2, 1, 128, 512, dtype=torch.bfloat16, device="cuda") for _ in range(calls)]
    lses = [torch.empty(2, 128, 1, dtype=torch.float32, device="cuda") for _ in range(calls)]

    def step():
        for qq, out, lse in zip(qqs, outs, lses):
            mla_decode(qq, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse, check=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert md.split_offsets[-1].item() > 2  # requests were split
    # the inputs are the same in both replays: eager results and references once
    eager = [mla_decode(qq, c["cache"], c["block_table"], c["cache_seqlens"]) for qq in qqs]
    refs = [references(dict(c, q=q), False) for q in qs]
    for _ in range(2):
        for out, lse in zip(outs, lses):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(md.counters == 0)
        for i, (out, lse, (want_out, want_lse), ((ox, lx), (oe, le))) in enumerate(zip(outs, lses, eager, refs)):
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"call {i}"
            assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL, f"call {i}"
            assert ref.lse_max_abs(lse, le) <= EMU_LSE, f"call {i}"
            assert ref.rel_l2(out.float(), ox) <= EXACT_REL and ref.cos_diff(out.float(), ox) <= EXACT_COS, f"call {i}"
