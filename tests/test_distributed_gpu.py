"""GPU tests of decode context parallelism (``snapmla_cute.distributed``): the visible-count
causal mask of a shard, the DSL LSE merge, the ranks of a group simulated on one GPU (every
shard decoded, merged), and the real thing over NCCL on two GPUs (skipped with fewer), dense
and sparse (``distributed_sparse``; its one-GPU tests are in ``test_distributed_sparse_gpu.py``)."""

import os
import random
import tempfile
import traceback

import pytest
import torch

from decode_cases import build_case, references
from snapmla_cute import distributed, emulation, mla_decode, quantize_q
from snapmla_cute import reference as ref

pytestmark = pytest.mark.gpu

EMU_REL, EMU_LSE = 2e-3, 1e-3
EXACT_REL, EXACT_COS = 5e-2, 1.5e-3


def _poisoned(b, s_q, h):
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    return out, lse


@pytest.mark.parametrize("h,s_q", [(8, 8), (16, 4), (128, 2), (64, 3)])
def test_visible_counts_mask_like_the_emulation(seed, h, s_q):
    """``mla_decode(visible=...)``: any counts, clamped to the causal window, as the emulation."""
    rng = random.Random(seed)
    lens = [0, 1, s_q - 1, 5, 64, 65, 300, rng.randint(1, 2000)]
    b = len(lens)
    c = build_case(b, s_q, h, 64, lens, seed=seed)
    vis = torch.tensor([[rng.randint(-3, L + 3) for _ in range(s_q)] for L in lens], dtype=torch.int32, device="cuda")
    out, lse = _poisoned(b, s_q, h)
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=True, visible=vis, out=out, lse=lse)
    oe, le = emulation.mla_decode_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"],
                                           c["cache_seqlens"], causal=True, visible=vis)
    ox, lx = ref.mla_decode_exact(c["q"], c["k_pages"], c["block_table"], c["cache_seqlens"], causal=True, visible=vis)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse, le) <= EMU_LSE
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    assert ref.rel_l2(out.float(), ox) <= EXACT_REL


def test_visible_needs_causal_and_its_shape(seed):
    c = build_case(2, 2, 16, 64, [10, 20], seed=seed)
    out, lse = _poisoned(2, 2, 16)
    vis = torch.ones(2, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="visible"):
        mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], visible=vis, out=out, lse=lse)
    with pytest.raises(ValueError, match="visible"):
        mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=True, visible=vis[:1], out=out,
                   lse=lse)
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()


@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("h,s_q", [(128, 1), (8, 8), (16, 3)])
def test_merge_kernel_matches_float64(seed, W, h, s_q):
    b = 5
    outs = torch.randn(W, b, s_q, h, 512, device="cuda").to(torch.bfloat16)
    lses = torch.randn(W, b, h, s_q, device="cuda") * 5
    lses[0, 1] = -float("inf")  # one shard saw nothing of request 1
    lses[:, 2, :3] = -float("inf")  # no shard saw these rows
    out, lse = _poisoned(b, s_q, h)
    distributed.merge_partials(outs, lses, out=out, lse=lse)
    oe, le = ref.merge_partials(outs, lses)
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= 1e-3
    assert torch.equal(torch.isinf(lse), torch.isinf(le))
    fin = torch.isfinite(le)
    assert (lse[fin].double() - le[fin]).abs().max() <= 1e-5
    assert torch.all(out[2].view(s_q, h, 512)[torch.isinf(le[2]).T] == 0)


def _shards(c, world, placement):
    return [distributed.shard_cache(c["cache"], c["block_table"], c["cache_seqlens"], world, r, placement)
            for r in range(world)]


def _cp_emulated(c, shards, s_q, causal):
    """Each shard emulated (bf16 out as the kernel writes it), merged in float64."""
    outs, lses = [], []
    for cache, bt, lens, where in shards:
        vis = None
        if causal and s_q > 1:
            vis = distributed.visible_counts(lens, c["cache_seqlens"], s_q, where)
        o, l_ = emulation.mla_decode_emulated(c["q"], (cache.kv, cache.kv_scale), bt, lens, causal=causal and s_q > 1,
                                              visible=vis)
        outs.append(o.bfloat16())
        lses.append(l_)
    return ref.merge_partials(torch.stack(outs), torch.stack(lses))


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("h,s_q,causal", [(128, 1, False), (16, 4, True), (8, 8, True), (64, 2, True), (32, 3, False)])
def test_ranks_simulated_match_the_whole_decode(seed, placement, world, h, s_q, causal):
    """Every rank's shard decoded on this GPU, merged by the DSL kernel: equal to the decode
    of the whole cache (emulation of the sharded computation, float64 exact attention and
    our single-GPU decode), NaN in every unused slot, ranks holding no token of a request."""
    rng = random.Random(seed)
    lens = [0, 1, world - 1, s_q, 64 * world + 1, rng.randint(1, 3000), rng.randint(3000, 9000)]
    b = len(lens)
    c = build_case(b, s_q, h, 64, lens, seed=seed)
    shards = _shards(c, world, placement)
    md = distributed.cp_decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h, world=world)
    outs = torch.empty_like(md.outs)
    lses = torch.empty_like(md.lses)
    for r, (cache, bt, local_lens, where) in enumerate(shards):
        o, l_ = distributed.decode_shard(c["q"], cache, bt, local_lens, placement=where, metadata=md,
                                         global_seqlens=c["cache_seqlens"], causal=causal)
        outs[r], lses[r] = o, l_
    out, lse = _poisoned(b, s_q, h)
    distributed.merge_partials(outs, lses, out=out, lse=lse)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    oe, le = _cp_emulated(c, shards, s_q, causal)
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse, le.float()) <= EMU_LSE
    (ox, lx), _ = references(c, causal)
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    assert ref.rel_l2(out.float(), ox) <= EXACT_REL
    assert ref.cos_diff(out.float(), ox) <= EXACT_COS
    # against the single-GPU decode: the shards group keys into other P blocks, so P's
    # e4m3 roundings differ (~1% rel-L2 apart); as accurate, and the same LSE
    whole, whole_lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal)
    assert ref.rel_l2(out.float(), ox) <= 1.25 * ref.rel_l2(whole.float(), ox)
    assert ref.lse_max_abs(lse, whole_lse) <= EMU_LSE


def test_simulated_ranks_replay_in_a_cuda_graph(seed):
    """Two shards' decodes and the merge captured once, replayed with new lengths."""
    world, h, s_q = 2, 16, 4
    lens = [700, 1500, 33]
    c = build_case(3, s_q, h, 64, lens, seed=seed)
    shards = _shards(c, world, "round_robin")
    qq = quantize_q(c["q"])
    md = [distributed.cp_decode_metadata(s[2], s_q=s_q, heads=h, world=world) for s in shards]
    glob = c["cache_seqlens"].clone()
    local = [s[2].clone() for s in shards]
    outs = torch.empty_like(md[0].outs)
    lses = torch.empty_like(md[0].lses)
    out, lse = _poisoned(3, s_q, h)

    def step():
        for r, (cache, bt, _, where) in enumerate(shards):
            o, l_ = distributed.decode_shard(qq, cache, bt, local[r], placement=where, metadata=md[r],
                                             global_seqlens=glob, causal=True, check=False)
            outs[r].copy_(o)
            lses[r].copy_(l_)
        distributed.merge_partials(outs, lses, out=out, lse=lse)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for new in ([700, 1500, 33], [5, 1499, 0], [640, 17, 32]):
        glob.copy_(torch.tensor(new, dtype=torch.int32))
        for r in range(world):
            local[r].copy_(torch.tensor([max(0, (L - r + world - 1) // world) for L in new], dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        c2 = dict(c, cache_seqlens=glob.clone())
        sh2 = [(s[0], s[1], local[r].clone(), s[3]) for r, s in enumerate(shards)]
        oe, le = _cp_emulated(c2, sh2, s_q, True)
        assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL, new
        assert ref.lse_max_abs(lse, le.float()) <= EMU_LSE, new


# ---------------------------------------------------------------------------------------------
# Two GPUs, NCCL
# ---------------------------------------------------------------------------------------------


def _two_gpu_worker(rank, world, init_file, seed, results):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for placement, h, s_q, causal in (("round_robin", 128, 1, False), ("contiguous", 16, 4, True),
                                          ("round_robin", 8, 8, True)):
            lens = [0, 1, 777, 4100, 9000]
            c = build_case(len(lens), s_q, h, 64, lens, seed=seed)  # the same on every rank
            cache, bt, local, where = distributed.shard_cache(c["cache"], c["block_table"], c["cache_seqlens"],
                                                              world, rank, placement)
            md = distributed.cp_decode_metadata(local, s_q=s_q, heads=h, world=world)
            out, lse = _poisoned(len(lens), s_q, h)
            distributed.mla_decode_cp(c["q"], cache, bt, local, placement=where, global_seqlens=c["cache_seqlens"],
                                      causal=causal, metadata=md, out=out, lse=lse)
            shards = _shards(c, world, placement)
            oe, le = _cp_emulated(c, shards, s_q, causal)
            (ox, lx), _ = references(c, causal)
            errs = (ref.rel_l2(out.float(), oe.bfloat16().float()), ref.lse_max_abs(lse, le.float()),
                    ref.rel_l2(out.float(), ox))
            assert errs[0] <= EMU_REL and errs[1] <= EMU_LSE and errs[2] <= EXACT_REL, (placement, h, s_q, errs)
            # captured with the NCCL exchange, replayed with shorter requests
            qq = quantize_q(c["q"])
            glob = c["cache_seqlens"].clone()
            g = torch.cuda.CUDAGraph()
            distributed.mla_decode_cp(qq, cache, bt, local, placement=where, global_seqlens=glob, causal=causal,
                                      metadata=md, out=out, lse=lse, check=False)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                distributed.mla_decode_cp(qq, cache, bt, local, placement=where, global_seqlens=glob, causal=causal,
                                          metadata=md, out=out, lse=lse, check=False)
            if placement == "round_robin":
                # no request grows past the tokens its shards hold (request 0 stays empty,
                # request 1's one token stays on rank 0 only)
                new = [0, 1, 500, 4099, 8000]
                glob.copy_(torch.tensor(new, dtype=torch.int32))
                local.copy_(torch.tensor([max(0, (L - rank + world - 1) // world) for L in new], dtype=torch.int32))
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                c2 = dict(c, cache_seqlens=glob.clone())
                sh2 = [(s[0], s[1], torch.tensor([max(0, (L - r + world - 1) // world) for L in new],
                                                 dtype=torch.int32, device="cuda"), s[3]) for r, s in enumerate(shards)]
                oe2, le2 = _cp_emulated(c2, sh2, s_q, causal)
                err = ref.rel_l2(out.float(), oe2.bfloat16().float())
                assert err <= EMU_REL and ref.lse_max_abs(lse, le2.float()) <= EMU_LSE, (placement, h, s_q, err)
            del g  # a live graph holding NCCL work makes destroy_process_group hang
        _sparse_worker(rank, world, seed)
        torch.cuda.synchronize()
    except BaseException:
        # the peer may be inside a collective: no teardown (NCCL's shutdown would hang in
        # it, also at interpreter exit); spawn sees the exit code and stops the peer
        results[rank] = traceback.format_exc()
        os._exit(1)
    results[rank] = "ok"
    dist.destroy_process_group()


def _sparse_worker(rank, world, seed):
    """The sparse path on each rank: bad inputs refused before any launch (no rank enters the
    exchange, so none waits in it), then the merged result against the one-GPU sparse decode,
    the same bits on every rank, and (round robin) a captured call with the exchange replayed
    with new positions and lengths."""
    import torch.distributed as dist

    from snapmla_cute import distributed_sparse as ds
    from sparse_cp_cases import build_sparse_cp_case, check_cp, global_positions, renew_positions, shards_of

    for placement, h, s_q, topk in (("round_robin", 128, 1, 2048), ("contiguous", 16, 4, 300)):
        lens = [0, 1, 777, 4100, 9000]
        b = len(lens)
        c = build_sparse_cp_case(lens, s_q, h, topk, seed=seed)  # the same on every rank
        cache, bt, local, where = distributed.shard_cache(c["cache"], c["block_table"], c["cache_seqlens"],
                                                          world, rank, placement)
        md = ds.cp_sparse_decode_metadata(b, s_q, h, topk, world=world)
        out, lse = _poisoned(b, s_q, h)

        def call(q=c["q"], topk_pos=c["topk_pos"], **kw):
            kw = {"placement": where, "topk_length": c["topk_length"], "metadata": md, "out": out, "lse": lse, **kw}
            return ds.mla_decode_sparse_cp(q, cache, topk_pos, bt, local, **kw)

        bad_pos = c["topk_pos"].clone()
        bad_pos[0, 0, 0] = -2
        for kw, error, message in (
            (dict(placement=distributed.RoundRobin(0, 3)), ValueError, "RoundRobin over 3 ranks, the group has 2"),
            (dict(placement=distributed.RoundRobin(1 - rank, 2)), ValueError, "expected RoundRobin.rank"),
            (dict(topk_pos=c["topk_pos"].long()), TypeError, "topk_pos: expected dtype torch.int32"),
            (dict(metadata=ds.cp_sparse_decode_metadata(b, s_q, h, topk, world=1)), ValueError, "metadata: made for"),
            (dict(topk_pos=bad_pos), ValueError, "topk_pos: expected values in"),
        ):
            with pytest.raises(error, match=message):
                call(**kw)
        torch.cuda.synchronize()
        assert torch.isnan(out.float()).all() and torch.isnan(lse).all()
        call()
        shards = shards_of(c, world, placement)  # every rank's, for the emulation

        def lists(pos, tl):
            return [ds.local_topk(pos, s_bt, s_lens, placement=s_where, page_size=s_cache.page_size, topk_length=tl)
                    for s_cache, s_bt, s_lens, s_where in shards]

        check_cp(c, out, lse, shards, lists(c["topk_pos"], c["topk_length"]))
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out)
        assert all(torch.equal(o, gathered[0]) for o in gathered), "ranks merged to different bits"
        if placement != "round_robin":
            continue
        qq = quantize_q(c["q"])
        pos, tl = c["topk_pos"].clone(), c["topk_length"].clone()
        call(q=qq, topk_pos=pos, topk_length=tl, check=False)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call(q=qq, topk_pos=pos, topk_length=tl, check=False)
        pos.copy_(global_positions(lens, s_q, topk, torch.Generator().manual_seed(seed + 5)))  # the same on every rank
        tl.copy_(torch.tensor([topk, 0, 1, topk // 2, topk], dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_cp(renew_positions(c, pos, tl), out, lse, shards, lists(pos, tl))
        del g  # a live graph holding NCCL work makes destroy_process_group hang


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl(seed):
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as d:
        results = mp.Manager().dict()
        try:
            mp.spawn(_two_gpu_worker, args=(2, os.path.join(d, "init"), seed, results), nprocs=2, join=True)
        except Exception as e:  # a rank's own traceback is in results
            raise AssertionError(f"{e}\n" + "\n".join(f"rank {r}: {v}" for r, v in sorted(results.items()))) from None
        assert dict(results) == {0: "ok", 1: "ok"}
