"""Builders and checks of sparse context-parallel cases shared by the GPU tests (ranks simulated
on one GPU, and two GPUs over NCCL): a whole cache (``decode_cases.build_case``), global top-k
positions as an indexer gives them, the same lists as slot ids of the whole cache (the one-GPU
decode's input, computed here without ``local_topk``), and the comparisons of a merged result
with the emulation of the sharded computation, float64 exact attention and the one-GPU decode."""

import random

import torch

from decode_cases import build_case
from snapmla_cute import distributed, mla_decode_sparse, sparse_reference
from snapmla_cute import reference as ref

# the dense context-parallel tests' tolerances (test_distributed_gpu.py)
EMU_REL, EMU_LSE = 2e-3, 1e-3
EXACT_REL, EXACT_COS = 5e-2, 1.5e-3


def global_positions(lens, s_q, topk, gen, device="cuda"):
    """Per query token ``topk`` positions of its request (duplicates among them), 5% -1 and 3%
    past the request's end (no token on any rank); int32 ``[b, s_q, topk]``."""
    pos = torch.empty(len(lens), s_q, topk, dtype=torch.int64)
    for i, L in enumerate(lens):
        pos[i] = torch.randint(0, max(L, 1), (s_q, topk), generator=gen)
        r = torch.rand(s_q, topk, generator=gen)
        pos[i][r < 0.05] = -1
        past = (r >= 0.05) & (r < 0.08)
        pos[i][past] = L + torch.randint(0, 100, (int(past.sum()),), generator=gen)
    return pos.to(torch.int32).to(device)


def whole_indices(topk_pos, block_table, cache_seqlens, page_size, topk_length=None):
    """The global lists as slot ids of the whole cache (-1 for no token and past each list's length)."""
    b, s_q, topk = topk_pos.shape
    p = topk_pos.long()
    valid = (p >= 0) & (p < cache_seqlens.long().view(b, 1, 1))
    if topk_length is not None:
        valid &= torch.arange(topk, device=p.device) < topk_length.long().view(b, 1, 1)
    col = torch.where(valid, p // page_size, 0)
    page = block_table.long().gather(1, col.view(b, -1)).view(b, s_q, topk)
    return torch.where(valid, page * page_size + p % page_size, -1).to(torch.int32).contiguous()


def build_sparse_cp_case(lens, s_q, h, topk, *, seed, page_size=64, lengths=None, device="cuda"):
    """``build_case``'s whole cache (NaN in unused slots) plus ``topk_pos``, the global
    ``topk_length`` (drawn from ``lengths``; default full, half, one and none) and the whole
    cache's ``indices``. The same on every rank for the same seed."""
    c = build_case(len(lens), s_q, h, page_size, lens, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    rng = random.Random(seed)
    choices = lengths or [topk, topk, topk // 2, 1, 0]
    c["topk_pos"] = global_positions(lens, s_q, topk, gen, device)
    c["topk_length"] = torch.tensor([rng.choice(choices) for _ in lens], dtype=torch.int32, device=device)
    c["page_size"] = page_size
    c["indices"] = whole_indices(c["topk_pos"], c["block_table"], c["cache_seqlens"], page_size, c["topk_length"])
    return c


def renew_positions(c, topk_pos, topk_length):
    """``c`` with new global lists (and the whole cache's indices for them)."""
    c = dict(c, topk_pos=topk_pos.clone(), topk_length=topk_length.clone())
    c["indices"] = whole_indices(c["topk_pos"], c["block_table"], c["cache_seqlens"], c["page_size"],
                                 c["topk_length"])
    return c


def shards_of(c, world, placement):
    """Every rank's ``(cache, block_table, cache_seqlens, placement)`` (``distributed.shard_cache``)."""
    return [distributed.shard_cache(c["cache"], c["block_table"], c["cache_seqlens"], world, r, placement)
            for r in range(world)]


def emulated_cp(c, shards, lists):
    """Each rank's sparse decode of its lists ``(indices, topk_length)`` emulated (bf16 out as
    the kernel writes it), merged in float64."""
    outs, lses = [], []
    for (cache, _, _, _), (idx, n) in zip(shards, lists):
        o, l_ = sparse_reference.mla_decode_sparse_emulated(c["q"], (cache.kv, cache.kv_scale), idx, topk_length=n)
        outs.append(o.bfloat16())
        lses.append(l_)
    return ref.merge_partials(torch.stack(outs), torch.stack(lses))


def check_cp(c, out, lse, shards, lists, *, whole=True):
    """A merged result against the emulation of the sharded computation, float64 exact sparse
    attention of the global lists and (``whole``) the one-GPU sparse decode of the whole
    cache: the shards group keys into other P blocks, so P's e4m3 roundings differ from it; as
    accurate, and the same LSE. Returns the errors."""
    assert not torch.isnan(out.float()).any(), "out not fully written, or NaN leaked"
    assert not torch.isnan(lse).any()
    oe, le = emulated_cp(c, shards, lists)
    emu = (ref.rel_l2(out.float(), oe.bfloat16().float()), ref.lse_max_abs(lse, le.float()))
    assert emu[0] <= EMU_REL and emu[1] <= EMU_LSE, f"vs emulation: rel-L2 {emu[0]:.2e}, LSE {emu[1]:.2e}"
    ox, lx = sparse_reference.mla_decode_sparse_exact(c["q"], c["k_pages"], c["indices"], topk_length=c["topk_length"])
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    exact = ref.rel_l2(out.float(), ox)
    assert exact <= EXACT_REL and ref.cos_diff(out.float(), ox) <= EXACT_COS, f"vs float64: rel-L2 {exact:.2e}"
    if whole:
        wo, wl = mla_decode_sparse(c["q"], c["cache"], c["indices"], topk_length=c["topk_length"])
        assert exact <= 1.25 * ref.rel_l2(wo.float(), ox), (exact, ref.rel_l2(wo.float(), ox))
        assert ref.lse_max_abs(lse, wl) <= EMU_LSE
    return emu, exact
