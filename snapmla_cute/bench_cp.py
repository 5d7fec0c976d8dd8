"""``snapmla-cute bench cp``: decode context parallelism at b8 h128 s_q1 — one GPU decoding the
whole cache against a round-robin shard per GPU, with each rank's shard decode, the exchange
(NCCL all-gather of out + LSE), the merge and the whole distributed call timed apart. Rows of
two kinds (column ``kind``):

- ``dense``: ``mla_decode`` over 256K and 1M tokens per request against ``mla_decode_cp``;
- ``sparse``: ``mla_decode_sparse`` over 1M tokens per request with 2048 global top-k
  positions per query token (random, from a seeded generator: the same on every rank)
  against ``mla_decode_sparse_cp``. A rank's shard time includes ``local_topk`` (also timed
  alone: ``translate_us``); the one-GPU time is the decode alone (its lists are slot ids of
  the whole cache already).

Plain (one process): the one-GPU call, rank 0's shard of ``--world`` ranks (default 2) on
this GPU and the merge of ``world`` partials; ``projected_no_exchange_us`` = shard + merge.
Under ``torchrun --nproc-per-node N -m snapmla_cute.cli bench cp`` (any N) every rank times
its own shard (``shard_us_r0`` .. ``shard_us_r{N-1}``), rank 0 gathers the figures and
prints them with the exchange, the merge and the whole call (``cp_us``; of these three the
slowest rank's figure: every rank waits for the others) and the one-GPU call (rank 0's; the
whole cache lives on rank 0 only). ``speedup`` = one GPU ÷ the whole call (or the
projection); ``slowest_share`` = the slowest rank's shard ÷ the same.

A request of 1M tokens is 644 MB of cache, b8 about 5.4 GB (rank 0 holds the whole cache and
its shard)."""

from __future__ import annotations

import torch

from snapmla_cute.bench import time_us

CP_SHAPES = [(8, 128, 1, 262144), (8, 128, 1, 1048576)]  # (b, h, s_q, tokens per request)
CP_SPARSE_SHAPES = [(8, 128, 1, 1048576, 2048)]  # (b, h, s_q, tokens per request, topk)


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


def _positions(b, s_q, topk, L):
    """Global top-k positions, the same on every rank (a seeded CPU generator)."""
    gen = torch.Generator().manual_seed(L + topk)
    return torch.randint(0, L, (b, s_q, topk), generator=gen, dtype=torch.int32).cuda()


def _query(b, s_q, h):
    from snapmla_cute import quantize_q

    q = torch.randn(b, s_q, h, 576, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    return quantize_q(q.to(torch.bfloat16))


def _tail_us(md, cp_call, multi: bool, world: int) -> dict:
    """The merge of ``world`` partials and, under torchrun, the exchange and the whole call
    (``cp_call(out, lse, check)``)."""
    from snapmla_cute import distributed

    if multi:
        outs, lses = md.outs, md.lses
    else:  # this rank's partial standing in for every rank's
        outs = md.local_out.unsqueeze(0).expand(world, *md.local_out.shape).contiguous()
        lses = md.local_lse.unsqueeze(0).expand(world, *md.local_lse.shape).contiguous()
    out, lse = torch.empty_like(md.local_out), torch.empty_like(md.local_lse)
    distributed.merge_partials(outs, lses, out=out, lse=lse)
    figs = dict(merge_us=time_us(lambda: distributed.merge_partials(outs, lses, out=out, lse=lse)))
    if multi:
        exchange = lambda: distributed.exchange_partials(md)  # noqa: E731

        exchange()
        torch.cuda.synchronize()
        figs["exchange_us"] = time_us(exchange)
        cp_call(out, lse, True)  # once with the checks
        figs["cp_us"] = time_us(lambda: cp_call(out, lse, False))
    return figs


def _dense_figs(b, h, s_q, whole, shard, rank, world, multi) -> dict:
    """This rank's figures of a dense row (``one_gpu_us`` where ``whole`` is given)."""
    from snapmla_cute import decode_metadata, distributed, mla_decode

    qq = _query(b, s_q, h)
    figs = {}
    if whole is not None:
        cache, bt, lens = whole
        md = decode_metadata(lens, s_q=s_q, heads=h)
        out, lse = mla_decode(qq, cache, bt, lens, metadata=md)
        figs["one_gpu_us"] = time_us(lambda: mla_decode(qq, cache, bt, lens, metadata=md, out=out, lse=lse, check=False))
    cache, bt, lens = shard
    where = distributed.RoundRobin(rank, world)
    md = distributed.cp_decode_metadata(lens, s_q=s_q, heads=h, world=world)
    distributed.decode_shard(qq, cache, bt, lens, placement=where, metadata=md)
    figs["shard_us"] = time_us(lambda: distributed.decode_shard(qq, cache, bt, lens, placement=where, metadata=md,
                                                                check=False))
    figs.update(_tail_us(md, lambda out, lse, check: distributed.mla_decode_cp(
        qq, cache, bt, lens, placement=where, metadata=md, out=out, lse=lse, check=check), multi, world))
    return figs


def _sparse_figs(b, h, s_q, L, topk, page_size, whole, shard, rank, world, multi) -> dict:
    """This rank's figures of a sparse row (``one_gpu_us`` where ``whole`` is given)."""
    from snapmla_cute import distributed, mla_decode_sparse, sparse_decode_metadata
    from snapmla_cute import distributed_sparse as ds

    qq = _query(b, s_q, h)
    pos = _positions(b, s_q, topk, L)
    figs = {}
    if whole is not None:
        cache, bt, lens = whole
        indices, _ = ds.local_topk(pos, bt, lens, placement=distributed.RoundRobin(0, 1), page_size=page_size)
        md = sparse_decode_metadata(b, s_q, h, topk)
        out, lse = mla_decode_sparse(qq, cache, indices, metadata=md)
        figs["one_gpu_us"] = time_us(lambda: mla_decode_sparse(qq, cache, indices, metadata=md, out=out, lse=lse,
                                                               check=False))
    cache, bt, lens = shard
    where = distributed.RoundRobin(rank, world)
    md = ds.cp_sparse_decode_metadata(b, s_q, h, topk, world=world)
    ds.decode_sparse_shard(qq, cache, pos, bt, lens, placement=where, metadata=md)
    figs["shard_us"] = time_us(lambda: ds.decode_sparse_shard(qq, cache, pos, bt, lens, placement=where, metadata=md,
                                                              check=False))
    figs["translate_us"] = time_us(lambda: ds.local_topk(pos, bt, lens, placement=where, page_size=page_size,
                                                         out=md.indices, out_length=md.topk_length))
    figs.update(_tail_us(md, lambda out, lse, check: ds.mla_decode_sparse_cp(
        qq, cache, pos, bt, lens, placement=where, metadata=md, out=out, lse=lse, check=check), multi, world))
    return figs


def _row(kind: str, shape: str, world: int, multi: bool, figs: list[dict]) -> dict:
    """One table row from every rank's figures (``figs[r]``; one entry in a plain run)."""
    row = dict(kind=kind, shape=shape, world=world, one_gpu_us=figs[0].get("one_gpu_us"))
    for r, f in enumerate(figs):
        row[f"shard_us_r{r}"] = f["shard_us"]
    if kind == "sparse":
        row["translate_us"] = max(f["translate_us"] for f in figs)
    slowest = max(f["shard_us"] for f in figs)
    row["merge_us"] = max(f["merge_us"] for f in figs)
    if multi:
        row["exchange_us"] = max(f["exchange_us"] for f in figs)
        row["cp_us"] = whole = max(f["cp_us"] for f in figs)
    else:
        row["exchange_us"] = None
        row["projected_no_exchange_us"] = whole = slowest + row["merge_us"]
    row = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
    if figs[0].get("one_gpu_us"):
        row["speedup"] = round(figs[0]["one_gpu_us"] / whole, 2)
    row["slowest_share"] = round(slowest / whole, 2)
    return row


def bench_cp(shapes=CP_SHAPES, sparse_shapes=CP_SPARSE_SHAPES, page_size: int = 64, world: int = 2) -> list[dict]:
    """The table's rows (the same on every rank under torchrun; ``world`` is the group's size
    there, the projected ranks in a plain run)."""
    import torch.distributed as dist

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if multi else 0
    world = dist.get_world_size() if multi else world
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")
    rows = []
    caches = list(dict.fromkeys([(b, L) for b, _, _, L in shapes] + [(b, L) for b, _, _, L, _ in sparse_shapes]))
    for b, L in caches:  # each cache built once for the rows of its size
        whole = _cache_of(b, L, page_size) if rank == 0 else None
        shard = _cache_of(b, L, page_size, world, rank)
        jobs = [("dense", f"b{b} h{h} s_q{s_q} {L} tokens",
                 lambda h=h, s_q=s_q: _dense_figs(b, h, s_q, whole, shard, rank, world, multi))
                for b_, h, s_q, L_ in shapes if (b_, L_) == (b, L)]
        jobs += [("sparse", f"b{b} h{h} s_q{s_q} topk{topk} of {L} tokens",
                  lambda h=h, s_q=s_q, topk=topk: _sparse_figs(b, h, s_q, L, topk, page_size, whole, shard, rank,
                                                               world, multi))
                 for b_, h, s_q, L_, topk in sparse_shapes if (b_, L_) == (b, L)]
        for kind, shape, run in jobs:
            mine = run()
            figs = [mine]
            if multi:
                figs = [None] * world
                dist.all_gather_object(figs, mine)
            rows.append(_row(kind, shape, world, multi, figs))
        del whole, shard
        torch.cuda.empty_cache()
    return rows
