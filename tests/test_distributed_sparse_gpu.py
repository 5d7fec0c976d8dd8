"""GPU tests of sparse decode context parallelism (``snapmla_cute.distributed_sparse``): the
ranks of a group simulated on one GPU (each rank's shard from ``distributed.shard_cache``, its
lists from ``local_topk``, its sparse decode, the DSL merge), CUDA-graph replays with new
positions and lengths, and the checks and host syncs of a call. The two-GPU NCCL test is in
``test_distributed_gpu.py`` (one process group for the dense and the sparse paths)."""

import random

import pytest
import torch

from decode_cases import host_syncs
from snapmla_cute import distributed, quantize_q
from snapmla_cute import distributed_sparse as ds
from sparse_cp_cases import build_sparse_cp_case, check_cp, global_positions, renew_positions, shards_of

pytestmark = pytest.mark.gpu


def _poisoned(b, s_q, h):
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    return out, lse


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("h,s_q,topk", [(128, 1, 2048), (16, 4, 300), (8, 8, 128)])
def test_ranks_simulated_match_the_whole_sparse_decode(seed, placement, world, h, s_q, topk):
    """Every rank's lists translated and decoded on this GPU (its partial poisoned before),
    merged by the DSL kernel: equal to the emulation of the sharded computation, float64
    exact sparse attention and the one-GPU sparse decode of the whole cache; NaN in every
    unused slot, ranks holding no token of a request, empty and partial global lists."""
    rng = random.Random(seed)
    lens = [0, 1, world - 1, 5, 64 * world + 1, rng.randint(1, 3000), rng.randint(3000, 9000)]
    b = len(lens)
    c = build_sparse_cp_case(lens, s_q, h, topk, seed=seed)
    shards = shards_of(c, world, placement)
    md = ds.cp_sparse_decode_metadata(b, s_q, h, topk, world=world)
    outs, lses = torch.empty_like(md.outs), torch.empty_like(md.lses)
    lists = []
    for r, (cache, bt, local, where) in enumerate(shards):
        md.local_out.fill_(float("nan"))
        md.local_lse.fill_(float("nan"))
        o, l_ = ds.decode_sparse_shard(c["q"], cache, c["topk_pos"], bt, local, placement=where, metadata=md,
                                       topk_length=c["topk_length"])
        assert o is md.local_out and l_ is md.local_lse
        outs[r], lses[r] = o, l_
        lists.append((md.indices.clone(), md.topk_length.clone()))
        # compacted: past the length the kernel walks, every entry is -1
        n = int(md.topk_length.max())
        assert torch.all(md.indices[..., n:] == -1)
    assert not torch.isnan(outs.float()).any() and not torch.isnan(lses).any()
    out, lse = _poisoned(b, s_q, h)
    distributed.merge_partials(outs, lses, out=out, lse=lse)
    check_cp(c, out, lse, shards, lists)


def test_world_one_call_replays_in_a_cuda_graph(seed):
    """``mla_decode_sparse_cp`` without a process group (world 1): eager with a fresh
    metadata, then captured once and replayed with new positions and lengths in place."""
    h, s_q, topk = 16, 4, 300
    lens = [700, 1500, 33, 0]
    b = len(lens)
    c = build_sparse_cp_case(lens, s_q, h, topk, seed=seed)
    where = distributed.RoundRobin(0, 1)
    whole = [(c["cache"], c["block_table"], c["cache_seqlens"], where)]
    out, lse = ds.mla_decode_sparse_cp(c["q"], c["cache"], c["topk_pos"], c["block_table"], c["cache_seqlens"],
                                       placement=where, topk_length=c["topk_length"])
    lists = [ds.local_topk(c["topk_pos"], c["block_table"], c["cache_seqlens"], placement=where,
                           page_size=c["page_size"], topk_length=c["topk_length"])]
    check_cp(c, out, lse, whole, lists)

    qq = quantize_q(c["q"])
    pos, tl = c["topk_pos"].clone(), c["topk_length"].clone()
    md = ds.cp_sparse_decode_metadata(b, s_q, h, topk, world=1)
    out, lse = _poisoned(b, s_q, h)

    def call():
        ds.mla_decode_sparse_cp(qq, c["cache"], pos, c["block_table"], c["cache_seqlens"], placement=where,
                                topk_length=tl, metadata=md, out=out, lse=lse, check=False)

    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    gen = torch.Generator().manual_seed(seed + 7)
    for new_lengths in ([topk, topk, topk, topk], [0, 299, 7, topk], [1, topk // 2, topk, 0]):
        pos.copy_(global_positions(lens, s_q, topk, gen))
        tl.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        c2 = renew_positions(c, pos, tl)
        want = ds.local_topk(pos, c["block_table"], c["cache_seqlens"], placement=where, page_size=c["page_size"],
                             topk_length=tl)
        assert torch.equal(md.indices, want[0]) and torch.equal(md.topk_length, want[1]), new_lengths
        check_cp(c2, out, lse, whole, [(md.indices.clone(), md.topk_length.clone())])


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
def test_simulated_ranks_replay_in_a_cuda_graph(seed, placement):
    """Two ranks' translations and sparse decodes and the merge captured once, replayed with
    new positions and lengths."""
    world, h, s_q, topk = 2, 16, 4, 300
    lens = [700, 1500, 33]
    b = len(lens)
    c = build_sparse_cp_case(lens, s_q, h, topk, seed=seed)
    shards = shards_of(c, world, placement)
    qq = quantize_q(c["q"])
    md = [ds.cp_sparse_decode_metadata(b, s_q, h, topk, world=world) for _ in range(world)]
    pos, tl = c["topk_pos"].clone(), c["topk_length"].clone()
    outs, lses = torch.empty_like(md[0].outs), torch.empty_like(md[0].lses)
    out, lse = _poisoned(b, s_q, h)

    def step():
        for r, (cache, bt, local, where) in enumerate(shards):
            o, l_ = ds.decode_sparse_shard(qq, cache, pos, bt, local, placement=where, metadata=md[r], topk_length=tl,
                                           check=False)
            outs[r].copy_(o)
            lses[r].copy_(l_)
        distributed.merge_partials(outs, lses, out=out, lse=lse)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    gen = torch.Generator().manual_seed(seed + 11)
    for new_lengths in ([topk, topk, topk], [5, 0, topk], [topk // 3, topk, 1]):
        pos.copy_(global_positions(lens, s_q, topk, gen))
        tl.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_cp(renew_positions(c, pos, tl), out, lse, shards,
                 [(m.indices.clone(), m.topk_length.clone()) for m in md])


def test_checked_call_reads_back_once(seed):
    """check=True reads the positions, lengths, the block table's used ids and the query
    back in one sync; check=False in none (the translation runs on the device)."""
    h, s_q, topk = 16, 1, 64
    c = build_sparse_cp_case([100, 200], s_q, h, topk, seed=seed)
    md = ds.cp_sparse_decode_metadata(2, s_q, h, topk, world=1)
    out, lse = _poisoned(2, s_q, h)
    where = distributed.Contiguous(torch.zeros(2, dtype=torch.int32, device="cuda"))
    for q in (c["q"], quantize_q(c["q"])):
        for check, want in ((True, 1), (False, 0)):
            syncs = host_syncs(lambda: ds.mla_decode_sparse_cp(
                q, c["cache"], c["topk_pos"], c["block_table"], c["cache_seqlens"], placement=where,
                topk_length=c["topk_length"], metadata=md, out=out, lse=lse, check=check))
            assert len(syncs) == want, (isinstance(q, tuple), check, syncs)


def test_bad_values_are_refused_before_any_launch(seed):
    """check=True: positions below -1, lengths past topk and block-table ids outside the
    cache are refused; nothing is written (the outputs and the metadata's lists keep their
    poison)."""
    h, s_q, topk = 16, 2, 64
    c = build_sparse_cp_case([100, 200], s_q, h, topk, seed=seed)
    md = ds.cp_sparse_decode_metadata(2, s_q, h, topk, world=1)
    md.indices.fill_(7)
    out = torch.full((2, s_q, h, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((2, h, s_q), 7.0, device="cuda")
    where = distributed.RoundRobin(0, 1)
    bad_pos = c["topk_pos"].clone()
    bad_pos[1, 1, 3] = -2
    bad_table = c["block_table"].clone()
    bad_table[0, 0] = c["cache"].kv.shape[0]
    for kw, message in ((dict(topk_pos=bad_pos), "topk_pos: expected values in"),
                        (dict(topk_length=torch.tensor([topk + 1, 0], dtype=torch.int32, device="cuda")),
                         "topk_length: expected values in"),
                        (dict(block_table=bad_table), "block_table: expected page ids in")):
        args = {"topk_pos": c["topk_pos"], "block_table": c["block_table"], "topk_length": c["topk_length"], **kw}
        with pytest.raises(ValueError, match=message):
            ds.mla_decode_sparse_cp(c["q"], c["cache"], args["topk_pos"], args["block_table"], c["cache_seqlens"],
                                    placement=where, topk_length=args["topk_length"], metadata=md, out=out, lse=lse)
    torch.cuda.synchronize()
    assert torch.all(out == 7) and torch.all(lse == 7) and torch.all(md.indices == 7)


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("with_length", [False, True])
def test_translation_kernel_matches_a_loop_and_the_torch_ops(placement, world, with_length):
    """``kernels.topk_translate`` (what ``local_topk`` runs on the GPU): the lists a plain loop
    gives, and the torch version's, for lists shorter and longer than one 256-entry chunk,
    junk positions (-1, negatives, past the end, int32's extremes) and junk page ids past
    every request's pages; the output poisoned before."""
    from test_distributed_sparse import _expected, _positions, _shard_table

    rng = random.Random(world)
    gen = torch.Generator().manual_seed(world + 10 * with_length)
    for s_q, topk, ps in ((1, 2048, 64), (3, 300, 16), (8, 5, 64), (2, 256, 32)):
        lens = [0, 1, world - 1, world, 7, 100, rng.randint(1, 700), rng.randint(5000, 70000)]
        pos = _positions(lens, s_q, topk, gen)
        topk_length = None
        if with_length:
            topk_length = torch.tensor([rng.choice([-3, 0, 1, topk // 2, topk, topk + 9]) for _ in lens],
                                       dtype=torch.int32)
        for rank in sorted({0, world - 1}):
            table, local, where = _shard_table(lens, world, rank, placement, ps, rng)
            want, want_len = _expected(pos, table, local, where, ps, topk_length)
            cuda_where = where if placement == "round_robin" else distributed.Contiguous(where.starts.cuda())
            args = (pos.cuda(), table.cuda(), local.cuda())
            glen = None if topk_length is None else topk_length.cuda()
            out = torch.full(pos.shape, 12345, dtype=torch.int32, device="cuda")
            out_len = torch.full((len(lens),), 12345, dtype=torch.int32, device="cuda")
            ds.local_topk(*args, placement=cuda_where, page_size=ps, topk_length=glen, out=out, out_length=out_len)
            assert torch.equal(out.cpu(), want) and torch.equal(out_len.cpu(), want_len), (placement, world, rank, s_q)
            ref_out, ref_len = torch.empty_like(out), torch.empty_like(out_len)
            ds._translate_torch(*args, cuda_where, ps, glen, ref_out, ref_len)
            assert torch.equal(out, ref_out) and torch.equal(out_len, ref_len)
