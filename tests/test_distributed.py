"""CPU tests of the context-parallel pieces: the visible-key counts of a shard against brute
force over global positions, and the float64 LSE merge of shards against exact attention."""

import random

import pytest
import torch

from snapmla_cute import distributed
from snapmla_cute import reference as ref


def _positions(L, world, rank, placement):
    if placement == "round_robin":
        return list(range(rank, L, world))
    return list(range(L * rank // world, L * (rank + 1) // world))


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_visible_counts_are_global_causal_prefixes(placement, world):
    rng = random.Random(world)
    for s_q in (1, 2, 4, 8):
        lens = [0, 1, 2, s_q, world, 7, 64, rng.randint(1, 500)]
        for rank in range(world):
            pos = [_positions(L, world, rank, placement) for L in lens]
            local = torch.tensor([len(p) for p in pos], dtype=torch.int32)
            glob = torch.tensor(lens, dtype=torch.int32)
            where = (distributed.RoundRobin(rank, world) if placement == "round_robin"
                     else distributed.Contiguous(torch.tensor([p[0] if p else L * rank // world
                                                               for p, L in zip(pos, lens)], dtype=torch.int32)))
            got = distributed.visible_counts(local, glob, s_q, where)
            for i, (L, p) in enumerate(zip(lens, pos)):
                for t in range(s_q):
                    want = sum(1 for g in p if g <= L - s_q + t)  # a prefix: positions increase
                    assert int(got[i, t]) == want, (placement, world, rank, s_q, L, t)
                    # inside the window the kernel assumes (it clamps to it)
                    assert len(p) - (s_q - 1 - t) <= want <= len(p)


def test_round_robin_checks_its_fields():
    with pytest.raises(ValueError, match="rank"):
        distributed.RoundRobin(2, 2)
    with pytest.raises(TypeError, match="world"):
        distributed.RoundRobin(0, 2.0)


@pytest.mark.parametrize("causal", [False, True])
def test_float64_merge_of_shards_is_the_whole_attention(causal):
    """Exact attention of each shard (masked by global position), merged by LSE: the exact
    attention of the whole cache, to float64 rounding."""
    gen = torch.Generator().manual_seed(0)
    b, s_q, h, ps, world = 3, 3, 4, 16, 2
    lens = [0, 5, 40]
    q = torch.randn(b, s_q, h, 576, generator=gen, dtype=torch.float64)
    k = torch.randn(b * 3, ps, 576, generator=gen, dtype=torch.float64)
    bt = torch.arange(b * 3, dtype=torch.int32).view(b, 3)
    cl = torch.tensor(lens, dtype=torch.int32)
    whole, whole_lse = ref.mla_decode_exact(q, k, bt, cl, causal=causal)
    outs, lses = [], []
    for rank in range(world):
        pos = [_positions(L, world, rank, "round_robin") for L in lens]
        n = max(1, max(len(p) for p in pos))
        kp = torch.zeros(b, n, 576, dtype=torch.float64)
        for i, p in enumerate(pos):
            if p:
                kp[i, : len(p)] = k.view(b, 3 * ps, 576)[i, p]
        local = torch.tensor([len(p) for p in pos], dtype=torch.int32)
        vis = distributed.visible_counts(local, cl, s_q, distributed.RoundRobin(rank, world))
        o, l_ = ref.mla_decode_exact(q, kp, torch.arange(b, dtype=torch.int32).view(b, 1), local, causal=causal,
                                     visible=vis if causal else None)
        outs.append(o)
        lses.append(l_)
    out, lse = ref.merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.equal(torch.isinf(lse), torch.isinf(whole_lse))
    fin = torch.isfinite(whole_lse)
    assert (lse[fin] - whole_lse[fin]).abs().max() < 1e-10
    assert (out - whole).abs().max() < 1e-10


@pytest.mark.parametrize("b, s_q, h, world", [(1, 1, 8, 2), (3, 2, 16, 4), (2, 8, 128, 3), (0, 1, 64, 2)])
def test_partials_share_one_exchange_row(b, s_q, h, world):
    """A rank's out and LSE are views of one byte row (one all-gather moves both); the
    gathered rows read back as every rank's out and LSE, each partial contiguous and
    16-byte aligned, which merge_partials' checks accept."""
    from snapmla_cute.distributed import _check_stacked, partial_buffers

    local_out, local_lse, outs, lses, send, gathered = partial_buffers(b, s_q, h, world, "cpu")
    assert local_out.is_contiguous() and local_lse.is_contiguous()
    assert send.shape[0] % 256 == 0 and tuple(gathered.shape) == (world, send.shape[0])
    expect_out, expect_lse = [], []
    for w in range(world):  # each rank's partial, as the all-gather would place it
        local_out.copy_(torch.randn(b, s_q, h, 512).bfloat16())
        local_lse.copy_(torch.randn(b, h, s_q))
        expect_out.append(local_out.clone())
        expect_lse.append(local_lse.clone())
        gathered[w].copy_(send)
    assert torch.equal(outs, torch.stack(expect_out)) and torch.equal(lses, torch.stack(expect_lse))
    _check_stacked("outs", outs, torch.bfloat16, 5, 512)
    _check_stacked("lses", lses, torch.float32, 4)
    if b:
        assert all(outs[w].is_contiguous() and outs[w].data_ptr() % 16 == 0 for w in range(world))


def test_stacked_partials_must_stay_apart():
    from snapmla_cute.distributed import _check_stacked

    outs = torch.zeros(2, 1, 1, 8, 512, dtype=torch.bfloat16)
    overlapping = outs.as_strided(outs.shape, (8, *outs.stride()[1:]))  # rank 1 inside rank 0
    with pytest.raises(ValueError, match="stride between partials"):
        _check_stacked("outs", overlapping, torch.bfloat16, 5, 512)
    with pytest.raises(ValueError, match="contiguous"):
        _check_stacked("outs", torch.zeros(2, 4, 1, 8, 512, dtype=torch.bfloat16)[:, ::2], torch.bfloat16, 5, 512)
