"""``snapmla-cute bench cp``: decode context parallelism, b8 h128 s_q1 at 256K and 1M tokens
per request — one GPU decoding the whole cache against a round-robin shard per GPU, with the
shard's decode, the exchange (NCCL all-gather of out + LSE) and the merge timed apart.

Run plainly, it times the one-GPU decode, one shard of ``world`` (default 2) on this GPU and
the merge, and projects the multi-GPU time without the exchange. Under ``torchrun
--nproc-per-node 2 -m snapmla_cute.cli bench cp`` every rank decodes its own shard and the
table (printed by rank 0) adds the measured exchange and the whole distributed call."""

from __future__ import annotations

import torch

from snapmla_cute.bench import time_us

CP_SHAPES = [(8, 128, 1, 262144), (8, 128, 1, 1048576)]


def _cache_of(b, L, page_size, world=1, rank=0):
    """A round-robin shard (``world`` 1: the whole cache) of b requests of L tokens, random
    content, pages shuffled."""
    from snapmla_cute import FP8KVCache, append_kv

    n = (L - rank + world - 1) // world
    pages_per = (n + page_size - 1) // page_size
    cache = FP8KVCache.allocate(b * pages_per, page_size)
    chunk = 1 << 20
    for s in range(0, b * pages_per * page_size, chunk):  # bounded temporaries at 1M tokens
        m = min(chunk, b * pages_per * page_size - s)
        kv = (torch.randn(m, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
        append_kv(cache, kv, torch.arange(s, s + m, device="cuda"), check=False)
    bt = torch.randperm(b * pages_per, device="cuda").int().view(b, pages_per)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return cache, bt, lens


def bench_cp(shapes=CP_SHAPES, page_size: int = 64, world: int = 2) -> list[dict]:
    import torch.distributed as dist

    from snapmla_cute import decode_metadata, distributed, mla_decode, quantize_q

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if multi else 0
    world = dist.get_world_size() if multi else world
    rows = []
    for b, h, s_q, L in shapes:
        q = torch.randn(b, s_q, h, 576, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        qq = quantize_q(q.to(torch.bfloat16))
        row = dict(shape=f"b{b} h{h} s_q{s_q} {L} tokens", world=world)
        if rank == 0 or not multi:
            cache, bt, lens = _cache_of(b, L, page_size)
            md = decode_metadata(lens, s_q=s_q, heads=h)
            out, lse = mla_decode(qq, cache, bt, lens, metadata=md)
            row["one_gpu_us"] = round(time_us(lambda: mla_decode(qq, cache, bt, lens, metadata=md, out=out, lse=lse,
                                                                 check=False)), 1)
        cache, bt, lens = _cache_of(b, L, page_size, world, rank)
        where = distributed.RoundRobin(rank, world)
        md = distributed.cp_decode_metadata(lens, s_q=s_q, heads=h, world=world)
        distributed.decode_shard(qq, cache, bt, lens, placement=where, metadata=md)
        shard_us = time_us(lambda: distributed.decode_shard(qq, cache, bt, lens, placement=where, metadata=md,
                                                            check=False))
        outs = md.outs if multi else md.local_out.unsqueeze(0).expand(world, -1, -1, -1, -1).contiguous()
        lses = md.lses if multi else md.local_lse.unsqueeze(0).expand(world, -1, -1, -1).contiguous()
        out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(b, h, s_q, device="cuda")
        distributed.merge_partials(outs, lses, out=out, lse=lse)
        merge_us = time_us(lambda: distributed.merge_partials(outs, lses, out=out, lse=lse))
        row.update(shard_us=round(shard_us, 1), merge_us=round(merge_us, 1))
        if multi:
            def exchange():
                dist.all_gather_into_tensor(md.outs, md.local_out)
                dist.all_gather_into_tensor(md.lses, md.local_lse)

            exchange()
            torch.cuda.synchronize()
            row["exchange_us"] = round(time_us(exchange), 1)
            distributed.mla_decode_cp(qq, cache, bt, lens, placement=where, metadata=md, out=out, lse=lse)
            total = time_us(lambda: distributed.mla_decode_cp(qq, cache, bt, lens, placement=where, metadata=md,
                                                              out=out, lse=lse, check=False))
            row["cp_us"] = round(total, 1)
        else:
            row["exchange_us"] = None
            row["cp_us"] = None
            row["projected_no_exchange_us"] = round(shard_us + merge_us, 1)
        ref_us = row.get("cp_us") or row.get("projected_no_exchange_us")
        if row.get("one_gpu_us") and ref_us:
            row["speedup"] = round(row["one_gpu_us"] / ref_us, 2)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows
