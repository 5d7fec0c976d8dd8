"""CPU tests of the sparse context-parallel pieces (``snapmla_cute.distributed_sparse``): the
rank-local translation and compaction of global top-k positions against a plain loop, the
float64 exact attention of the shards' lists merged against the whole, and the checks that
refuse bad input before anything runs."""

import random

import pytest
import torch

from snapmla_cute import FP8KVCache, distributed
from snapmla_cute import distributed_sparse as ds
from snapmla_cute import reference as ref
from snapmla_cute import sparse_reference
from snapmla_cute.sparse import SparseDecodeMetadata

HUGE = 2**30
_REAL_TRANSLATE = ds._translate  # the cpu_call fixture makes it fail; one test puts it back


def _held(L, world, rank, placement):
    """The global positions of a request of L tokens that ``rank`` holds, in order."""
    if placement == "round_robin":
        return list(range(rank, L, world))
    return list(range(L * rank // world, L * (rank + 1) // world))


def _shard_table(lens, world, rank, placement, ps, rng, width_extra=2):
    """A rank's (block_table, cache_seqlens, placement) with shuffled page ids and huge ids
    past every request's pages."""
    held = [_held(L, world, rank, placement) for L in lens]
    n_pages = [(len(p) + ps - 1) // ps for p in held]
    ids = list(range(sum(n_pages)))
    rng.shuffle(ids)
    width = max(n_pages) + width_extra
    table = torch.full((len(lens), width), HUGE, dtype=torch.int32)
    used = 0
    for i, n in enumerate(n_pages):
        table[i, :n] = torch.tensor(ids[used : used + n], dtype=torch.int32)
        used += n
    local = torch.tensor([len(p) for p in held], dtype=torch.int32)
    if placement == "round_robin":
        where = distributed.RoundRobin(rank, world)
    else:
        where = distributed.Contiguous(torch.tensor([L * rank // world for L in lens], dtype=torch.int32))
    return table, local, where


def _expected(pos, table, local, where, ps, topk_length):
    """The compacted lists by a plain loop over every entry."""
    b, s_q, topk = pos.shape
    ids = torch.full((b, s_q, topk), -1, dtype=torch.int32)
    lengths = torch.zeros(b, dtype=torch.int32)
    for i in range(b):
        n = topk if topk_length is None else max(0, min(topk, int(topk_length[i])))
        for t in range(s_q):
            row = []
            for j in range(n):
                g = int(pos[i, t, j])
                if g < 0:
                    continue
                if isinstance(where, distributed.RoundRobin):
                    if g % where.world != where.rank:
                        continue
                    tok = g // where.world
                else:
                    tok = g - int(where.starts[i])
                if not 0 <= tok < int(local[i]):
                    continue
                row.append(int(table[i, tok // ps]) * ps + tok % ps)
            ids[i, t, : len(row)] = torch.tensor(row, dtype=torch.int32)
            lengths[i] = max(int(lengths[i]), len(row))
    return ids, lengths


def _positions(lens, s_q, topk, gen):
    """Global lists as an indexer (and a careless caller) might give them: real positions with
    duplicates, -1, other negatives, positions past the request's end, int32's extremes."""
    b = len(lens)
    pos = torch.empty(b, s_q, topk, dtype=torch.int64)
    for i, L in enumerate(lens):
        pos[i] = torch.randint(0, max(L, 1), (s_q, topk), generator=gen)
        r = torch.rand(s_q, topk, generator=gen)
        pos[i][r < 0.1] = -1
        pos[i][(r >= 0.1) & (r < 0.15)] = L + torch.randint(0, 50, (s_q, topk), generator=gen)[(r >= 0.1) & (r < 0.15)]
        pos[i][(r >= 0.15) & (r < 0.16)] = -7
    pos.view(-1)[:2] = torch.tensor([2**31 - 1, -(2**31)])
    return pos.to(torch.int32)


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("with_length", [False, True])
def test_local_topk_matches_a_loop(placement, world, with_length):
    rng = random.Random(world)
    gen = torch.Generator().manual_seed(world + 10 * with_length)
    for s_q, topk, ps in ((1, 64, 16), (3, 37, 64), (8, 5, 16)):
        lens = [0, 1, world - 1, world, 7, 100, rng.randint(1, 700)]
        pos = _positions(lens, s_q, topk, gen)
        topk_length = None
        if with_length:
            topk_length = torch.tensor([rng.choice([-3, 0, 1, topk // 2, topk, topk + 9]) for _ in lens],
                                       dtype=torch.int32)
        for rank in range(world):
            table, local, where = _shard_table(lens, world, rank, placement, ps, rng)
            got, got_len = ds.local_topk(pos, table, local, placement=where, page_size=ps, topk_length=topk_length)
            want, want_len = _expected(pos, table, local, where, ps, topk_length)
            assert torch.equal(got, want), (placement, world, rank, s_q)
            assert torch.equal(got_len, want_len), (placement, world, rank, s_q)


def test_local_topk_writes_into_the_buffers_given():
    pos = torch.tensor([[[5, -1, 2, 4, 2]], [[0, 1, 2, 3, 4]]], dtype=torch.int32)
    table = torch.tensor([[1, 0], [0, HUGE]], dtype=torch.int32)
    out = torch.full((2, 1, 5), 99, dtype=torch.int32)
    out_length = torch.full((2,), 99, dtype=torch.int32)
    r = ds.local_topk(pos, table, torch.tensor([3, 1], dtype=torch.int32), placement=distributed.RoundRobin(0, 2),
                      page_size=2, out=out, out_length=out_length)
    assert r[0] is out and r[1] is out_length
    # rank 0 of 2 holds positions 0, 2, 4 of request 0 (locals 0, 1, 2: pages 1, 1, 0) and
    # position 0 of request 1 (page 0); 5 is rank 1's, -1 none, 2 listed twice counts twice
    assert out.tolist() == [[[1 * 2 + 1, 0 * 2 + 0, 1 * 2 + 1, -1, -1]], [[0, -1, -1, -1, -1]]]
    assert out_length.tolist() == [3, 1]


def test_local_topk_with_no_page_and_no_token():
    """A table without columns (no rank token anywhere) and a rank holding none of a request."""
    pos = torch.tensor([[[0, 3, -1]], [[1, 2, 2**31 - 1]]], dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    ids, n = ds.local_topk(pos, torch.zeros(2, 0, dtype=torch.int32), lens, placement=distributed.RoundRobin(1, 3),
                           page_size=64)
    assert torch.all(ids == -1) and n.tolist() == [0, 0]
    starts = distributed.Contiguous(torch.tensor([0, 3], dtype=torch.int32))
    ids, n = ds.local_topk(pos, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32),
                           placement=starts, page_size=64)
    assert ids.tolist() == [[[-1, -1, -1]], [[-1, -1, -1]]] and n.tolist() == [0, 0]  # 1, 2 < starts[1]
    # -1 is no token whatever the starts (check=True refuses negative ones)
    ids, n = ds.local_topk(pos[:1], torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                           placement=distributed.Contiguous(torch.tensor([-3], dtype=torch.int32)), page_size=64)
    assert ids.tolist() == [[[3, -1, -1]]] and n.tolist() == [1]  # position 0: local 3


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [2, 3])
def test_float64_merge_of_shard_lists_is_the_whole_sparse_attention(placement, world):
    """Exact sparse attention of each rank's compacted lists over its own pages, merged by
    LSE: the exact sparse attention of the global lists over the whole cache."""
    gen = torch.Generator().manual_seed(world)
    rng = random.Random(world)
    b, s_q, h, ps, topk = 4, 2, 4, 16, 40
    lens = [0, 1, 30, 90]
    width = (max(lens) + ps - 1) // ps
    k = torch.randn(b, width * ps, 576, generator=gen, dtype=torch.float64)  # request i's token g: k[i, g]
    q = torch.randn(b, s_q, h, 576, generator=gen, dtype=torch.float64)
    pos = _positions(lens, s_q, topk, gen)
    topk_length = torch.tensor([topk, 0, 25, topk], dtype=torch.int32)
    # the whole cache: request i's tokens on pages of its own, in order
    whole_pages = k.view(b * width, ps, 576)
    whole_table = torch.arange(b * width, dtype=torch.int32).view(b, width)
    whole_ids, _ = _expected(pos, whole_table, torch.tensor(lens, dtype=torch.int32), distributed.RoundRobin(0, 1),
                             ps, topk_length)
    want, want_lse = sparse_reference.mla_decode_sparse_exact(q, whole_pages, whole_ids)
    outs, lses = [], []
    for rank in range(world):
        table, local, where = _shard_table(lens, world, rank, placement, ps, rng)
        pages = torch.zeros(int((table < HUGE).sum()) + 1, ps, 576, dtype=torch.float64)
        for i, L in enumerate(lens):
            for n, g in enumerate(_held(L, world, rank, placement)):
                pages[table[i, n // ps], n % ps] = k[i, g]
        ids, n = ds.local_topk(pos, table, local, placement=where, page_size=ps, topk_length=topk_length)
        o, l_ = sparse_reference.mla_decode_sparse_exact(q, pages, ids, topk_length=n)
        outs.append(o)
        lses.append(l_)
    out, lse = ref.merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.isinf(lse[1]).all()  # request 1: an empty global list
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max() < 1e-10
    assert (out - want).abs().max() < 1e-10


# ---------------------------------------------------------------------------------------------
# Bad input: refused with what was expected and what came, before anything runs
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_call(monkeypatch):
    """``mla_decode_sparse_cp`` on CPU tensors: the CUDA-device checks stood in for, and every
    launch (translation, decode, exchange) made to fail the test."""
    import snapmla_cute.validation as validation

    for module in (ds, validation):
        monkeypatch.setattr(module, "_check_cuda", lambda **k: None)
    launched = lambda *a, **k: pytest.fail("launched")  # noqa: E731
    for name in ("_translate", "mla_decode_sparse", "exchange_and_merge"):
        monkeypatch.setattr(ds, name, launched)
    b, s_q, h, topk, ps = 2, 2, 16, 8, 64
    cache = FP8KVCache.allocate(4, ps, device="cpu")
    args = dict(
        q=torch.zeros(b, s_q, h, 576, dtype=torch.bfloat16),
        cache=cache,
        topk_pos=torch.zeros(b, s_q, topk, dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        cache_seqlens=torch.tensor([100, 5], dtype=torch.int32),
    )
    kw = dict(placement=distributed.RoundRobin(0, 1), metadata=_cpu_metadata(b, s_q, h, topk, 1))
    return args, kw


def _cpu_metadata(b, s_q, h, topk, world):
    local = SparseDecodeMetadata(b, s_q, h, topk, 1, "cpu")
    return ds.CPSparseDecodeMetadata(local, topk, world, "cpu")


def _call(args, kw, **changes):
    a = {**args, **{k: v for k, v in changes.items() if k in args}}
    k = {**kw, **{k: v for k, v in changes.items() if k not in args}}
    return ds.mla_decode_sparse_cp(a.pop("q"), a.pop("cache"), a.pop("topk_pos"), a.pop("block_table"),
                                   a.pop("cache_seqlens"), **k)


@pytest.mark.parametrize("change,error,message", [
    (dict(topk_pos=torch.zeros(2, 2, 8, dtype=torch.int64)), TypeError,
     "topk_pos: expected dtype torch.int32, got torch.int64"),
    (dict(topk_pos=torch.zeros(2, 3, 8, dtype=torch.int32)), ValueError, r"topk_pos: expected shape \(2, 2, 1 <= topk"),
    (dict(topk_pos=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "topk_pos: expected 3 dims"),
    (dict(topk_pos=torch.zeros(2, 2, 8, dtype=torch.int32, device="meta")), ValueError, "tensors on different devices"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     "block_table/cache_seqlens: expected batch 2, got 3 and 2"),
    (dict(cache_seqlens=torch.zeros(1, dtype=torch.int32)), ValueError,
     "block_table/cache_seqlens: expected batch 2, got 2 and 1"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, "block_table: expected dtype torch.int32"),
    (dict(topk_length=torch.zeros(3, dtype=torch.int32)), ValueError, r"topk_length: expected shape \(2,\), got \(3,\)"),
    (dict(topk_length=torch.zeros(2)), TypeError, "topk_length: expected dtype torch.int32"),
    (dict(q=torch.zeros(2, 2, 4, 576, dtype=torch.bfloat16)), ValueError, "q: expected heads in"),
    (dict(q=torch.zeros(2, 9, 16, 576, dtype=torch.bfloat16)), ValueError, r"q: expected s_q in \[1, 8\]"),
    (dict(q=torch.zeros(2, 2, 16, 576)), TypeError, "q: expected dtype torch.bfloat16"),
    (dict(cache="cache"), TypeError, "cache: expected FP8KVCache, got str"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale: expected a finite value > 0"),
    (dict(placement="rr"), TypeError, "placement: expected RoundRobin or Contiguous, got str"),
    (dict(placement=distributed.RoundRobin(0, 2)), ValueError, "placement: RoundRobin over 2 ranks, the group has 1"),
    (dict(placement=distributed.Contiguous(torch.zeros(3, dtype=torch.int32))), ValueError,
     r"placement.starts: expected shape \(2,\), got \(3,\)"),
    (dict(metadata=_cpu_metadata(2, 2, 16, 9, 1)), ValueError,
     r"metadata: made for \(batch, s_q, heads, topk, world\) = \(2, 2, 16, 9, 1\), got \(2, 2, 16, 8, 1\)"),
    (dict(metadata=_cpu_metadata(2, 2, 16, 8, 2)), ValueError,
     r"metadata: made for .* = \(2, 2, 16, 8, 2\), got \(2, 2, 16, 8, 1\)"),
    (dict(metadata=_cpu_metadata(2, 1, 16, 8, 1)), ValueError, "metadata: made for"),
    (dict(metadata="md"), TypeError, "metadata: expected CPSparseDecodeMetadata"),
    (dict(out=torch.zeros(2, 2, 16, 512)), TypeError, "out: expected dtype torch.bfloat16"),
    (dict(lse=torch.zeros(2, 2, 16)), ValueError, r"lse: expected shape \(2, 16, 2\)"),
])
def test_bad_input_is_refused_before_anything_runs(cpu_call, change, error, message):
    args, kw = cpu_call
    with pytest.raises(error, match=message):
        _call(args, kw, **change)


def test_outputs_may_not_overlap_each_other_or_the_partials(cpu_call):
    args, kw = cpu_call
    buf = torch.zeros(2 * 2 * 16 * 512 * 2, dtype=torch.uint8)
    out = buf.view(torch.bfloat16).view(2, 2, 16, 512)
    lse = buf[: 2 * 16 * 2 * 4].view(torch.float32).view(2, 16, 2)
    with pytest.raises(ValueError, match="out and lse: expected separate memory"):
        _call(args, kw, out=out, lse=lse)
    md = kw["metadata"]
    with pytest.raises(ValueError, match="out and metadata.local_out: expected separate memory"):
        _call(args, kw, out=md.local_out, lse=torch.empty(2, 16, 2))


@pytest.mark.parametrize("change,message", [
    (dict(topk_pos=torch.full((2, 2, 8), -2, dtype=torch.int32)),
     r"topk_pos: expected values in \[-1, 2147483647\], got values in \[-2, -2\]"),
    (dict(topk_length=torch.tensor([9, 0], dtype=torch.int32)),
     r"topk_length: expected values in \[0, 8\], got values in \[0, 9\]"),
    (dict(topk_length=torch.tensor([-1, 0], dtype=torch.int32)), r"topk_length: expected values in \[0, 8\]"),
    (dict(placement=distributed.Contiguous(torch.tensor([0, -4], dtype=torch.int32))),
     r"placement.starts: expected values in \[0,"),
    (dict(block_table=torch.tensor([[0, 4], [2, 3]], dtype=torch.int32)),
     r"block_table: expected page ids in \[0, 4\) .*got 4 at request 0, column 1"),
    (dict(cache_seqlens=torch.tensor([129, 5], dtype=torch.int32)),
     "block_table: a sequence of 129 tokens needs 3 pages, table has 2 columns"),
    (dict(cache_seqlens=torch.tensor([-1, 5], dtype=torch.int32)), "cache_seqlens: expected values >= 0, got min -1"),
    (dict(q=torch.full((2, 2, 16, 576), float("nan"), dtype=torch.bfloat16)), "q: expected finite values"),
])
def test_bad_values_are_refused_with_check(cpu_call, change, message):
    args, kw = cpu_call
    with pytest.raises(ValueError, match=message):
        _call(args, kw, **change)


def test_unchecked_values_reach_the_translation(cpu_call, monkeypatch):
    """check=False reads nothing back: positions -2 and lengths past topk are passed on (the
    translation makes them no token / all entries)."""
    args, kw = cpu_call
    seen = []
    monkeypatch.setattr(ds, "_run_shard", lambda *a: seen.append(a))
    monkeypatch.setattr(ds, "exchange_and_merge", lambda *a: "merged")
    assert _call(args, kw, topk_pos=torch.full((2, 2, 8), -2, dtype=torch.int32), check=False) == "merged"
    assert len(seen) == 1


def test_the_call_decodes_the_translated_lists(cpu_call, monkeypatch):
    """A good call on CPU tensors: the metadata's lists are this rank's ``local_topk`` of the
    global positions, and the decode reads them and writes the metadata's partial."""
    args, kw = cpu_call
    monkeypatch.setattr(ds, "_translate", _REAL_TRANSLATE)
    calls = []

    def decode(q, cache, indices, *, topk_length, softmax_scale, metadata, out, lse, check):
        calls.append((indices.clone(), topk_length.clone(), metadata, out, lse, check))
        return out, lse

    monkeypatch.setattr(ds, "mla_decode_sparse", decode)
    monkeypatch.setattr(ds, "exchange_and_merge", lambda md, group, out, lse: (md, group, out, lse))
    pos = torch.tensor([[[0, 64, 65, -1, 99, 100, 3, 3]] * 2, [[4, 0, 5, 6, -1, 1, 2, 3]] * 2], dtype=torch.int32)
    md = kw["metadata"]
    r = _call(args, kw, topk_pos=pos, topk_length=torch.tensor([8, 3], dtype=torch.int32))
    assert r[0] is md and r[1] is None
    (indices, length, local, out, lse, check), = calls
    want, want_len = ds.local_topk(pos, args["block_table"], args["cache_seqlens"], placement=kw["placement"],
                                   page_size=64, topk_length=torch.tensor([8, 3], dtype=torch.int32))
    assert torch.equal(indices, want) and torch.equal(length, want_len)
    assert want_len.tolist() == [6, 2]  # request 0: -1 and 100 (past 100 tokens) are no token; 1: 5 is past 5
    assert local is md.local and out is md.local_out and lse is md.local_lse and check is False


def test_rank_must_be_the_process_rank(cpu_call, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    args, kw = cpu_call
    with pytest.raises(ValueError, match="placement: expected RoundRobin.rank 1 .*, got 0"):
        _call(args, kw, placement=distributed.RoundRobin(0, 2))


def test_without_cuda_the_call_says_so():
    b, s_q, h, topk = 1, 1, 16, 4
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        ds.mla_decode_sparse_cp(torch.zeros(b, s_q, h, 576, dtype=torch.bfloat16), FP8KVCache.allocate(1, 64, device="cpu"),
                                torch.zeros(b, s_q, topk, dtype=torch.int32), torch.zeros(b, 1, dtype=torch.int32),
                                torch.zeros(b, dtype=torch.int32), placement=distributed.RoundRobin(0, 1))


@pytest.mark.parametrize("kw,message", [
    (dict(world=0), "world: expected an int >= 1, got 0"),
    (dict(world=2.0), "world: expected an int >= 1"),
    (dict(world=2, topk=0), r"topk: expected an int in \[1, "),
])
def test_metadata_arguments_are_checked(kw, message):
    args = dict(batch=2, s_q=1, heads=16, topk=8)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        ds.cp_sparse_decode_metadata(args.pop("batch"), args.pop("s_q"), args.pop("heads"), args.pop("topk"), **args)


@pytest.mark.parametrize("change,error,message", [
    (dict(page_size=0), ValueError, "page_size: expected an int >= 1, got 0"),
    (dict(out=torch.zeros(2, 1, 4, dtype=torch.int32)), ValueError, r"out: expected shape \(2, 1, 5\)"),
    (dict(out_length=torch.zeros(2, dtype=torch.int64)), TypeError, "out_length: expected dtype torch.int32"),
    (dict(placement=distributed.Contiguous(torch.zeros(2, dtype=torch.int64))), TypeError,
     "placement.starts: expected dtype torch.int32"),
    (dict(topk_pos=torch.zeros(0, 1, 5, dtype=torch.int32)), ValueError, "with batch >= 1"),
])
def test_local_topk_checks_its_arguments(change, error, message):
    kw = dict(topk_pos=torch.zeros(2, 1, 5, dtype=torch.int32), block_table=torch.zeros(2, 1, dtype=torch.int32),
              cache_seqlens=torch.zeros(2, dtype=torch.int32), placement=distributed.RoundRobin(0, 2), page_size=16)
    kw.update(change)
    with pytest.raises(error, match=message):
        ds.local_topk(kw.pop("topk_pos"), kw.pop("block_table"), kw.pop("cache_seqlens"), **kw)
