"""Bad input is rejected before any launch, with what/expected/got; and the host-side
plumbing of a decode call (every tuning change drops the compiled steps; the step's
arguments). CPU: no GPU needed."""

import pytest
import torch

from snapmla_cute import FP8KVCache, append_kv, dequantize_kv, quantize_q


def test_quantize_q_rejects():
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q: expected dtype torch.bfloat16, got torch.float32"):
        quantize_q(q.float())
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        quantize_q(q[0])
    with pytest.raises(ValueError, match="q: expected last dim 576"):
        quantize_q(q[..., :512])
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got device cpu"):
        quantize_q(q)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        quantize_q(q.numpy() if False else [1, 2])


def test_append_and_dequant_reject_cpu_and_types():
    cache = FP8KVCache.allocate(2, 16, device="cpu", fill_nan=True)
    before = cache.kv.clone()
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    slots = torch.arange(4)
    with pytest.raises(TypeError, match="cache: expected FP8KVCache"):
        append_kv(cache.kv, kv, slots)
    with pytest.raises(ValueError, match="kv: expected a CUDA tensor"):
        append_kv(cache, kv, slots)
    with pytest.raises(TypeError, match="slot_mapping: expected dtype torch.int64, got torch.int32"):
        append_kv(cache, kv, slots.int())
    with pytest.raises(TypeError, match="kv: expected dtype torch.bfloat16"):
        append_kv(cache, kv.half(), slots)
    with pytest.raises(ValueError, match="slot_mapping: expected 4 entries"):
        append_kv(cache, kv, slots[:3])
    with pytest.raises(ValueError, match="kv: expected a contiguous tensor"):
        append_kv(cache, kv.t().contiguous().t(), slots)
    with pytest.raises(ValueError, match="slots: expected a CUDA tensor"):
        dequantize_kv(cache, slots)
    with pytest.raises(ValueError, match="slots: expected 1 dims"):
        dequantize_kv(cache, slots[None])
    assert torch.equal(cache.kv, before)


def test_every_tuning_change_drops_the_compiled_steps():
    """DECODE_TUNING changes the compiled code: every way of mutating it must empty the hot
    path's table, or a call would keep running the old kernel."""
    from snapmla_cute.steps import HOT_DENSE as _hot_steps
    from snapmla_cute.tuning import DECODE_TUNING

    saved = dict(DECODE_TUNING)
    try:
        mutations = [
            lambda t: t.__setitem__("kv_stages", 3),
            lambda t: t.update(kv_stages=4),
            lambda t: t.setdefault("kv_evict_first", False),
            lambda t: t.__ior__({"trace": True}),
            lambda t: t.pop("trace"),
            lambda t: t.popitem(),
            lambda t: t.__delitem__("kv_stages"),
            lambda t: t.clear(),
        ]
        DECODE_TUNING.update(kv_stages=4, kv_evict_first=False, trace=True)
        for mutate in mutations:
            _hot_steps["sentinel"] = object()
            mutate(DECODE_TUNING)
            assert "sentinel" not in _hot_steps, mutate
    finally:
        DECODE_TUNING.clear()
        DECODE_TUNING.update(saved)
        _hot_steps.pop("sentinel", None)


def test_step_arguments_one_builder_for_every_path():
    """The hot path and the full path, dense and sparse, build the compiled step's arguments
    with one helper into one bundle (``launch.StepArgs``): a quantized q as a tuple or a list
    gives the same call, a bf16 q goes in ``q`` with the metadata's query buffers in front,
    the accurate mode's q_lo last, and the softmax scale arrives in the log2 domain."""
    import math
    from types import SimpleNamespace

    from snapmla_cute.kernels.decode.launch import StepArgs
    from snapmla_cute.steps import step_args

    t = [torch.zeros(1) for _ in range(12)]
    cache = (t[0], t[1])
    md = SimpleNamespace(q_args=(t[2], t[3], t[4]), step_args=(t[5], t[6], t[7], t[8], t[9]))
    qq = (t[10], t[11], torch.zeros(1))
    bt, lens, out, lse = (torch.zeros(1) for _ in range(4))
    a = step_args(qq, bt, lens, out, lse, cache, md, None)
    b = step_args(list(qq), bt, lens, out, lse, cache, md, None)
    assert a[0] is False and b[0] is False and isinstance(a[1], StepArgs) and len(a[1]) == len(StepArgs._fields)
    assert all(x is y for x, y in zip(a[1], b[1]))
    args = a[1]
    assert (args.q_nope, args.q_rope, args.q_scale) == qq and (args.table, args.lengths, args.out, args.lse) == (
        bt, lens, out, lse)
    assert (args.kv, args.kv_scale) == cache
    assert (args.sched, args.split_offsets, args.o_partial, args.lse_partial, args.counters) == md.step_args
    assert args.scale_log2 == pytest.approx(576**-0.5 * math.log2(math.e))
    # no visible counts, no bf16 query, no q_lo: a compiled call takes every optional tensor
    assert (args.visible, args.q, args.q_lo) == (None, None, None)
    vis = torch.zeros(1)
    assert step_args(qq, bt, lens, out, lse, cache, md, None, vis)[1].visible is vis
    q_lo = torch.zeros(1)
    split = step_args((*qq, q_lo), bt, lens, out, lse, cache, md, None)[1]
    assert split[:3] == qq and split[-3:] == (None, None, q_lo)  # the accurate mode's q_lo last
    q = torch.zeros(1)
    bf16_q, args = step_args(q, bt, lens, out, lse, cache, md, 0.1)
    # the step quantizes the bf16 query into the metadata's query buffers, which take the
    # quantized query's place
    assert bf16_q is True and args[:3] == (t[2], t[3], t[4]) and args.q is q and args.q_lo is None
    assert args.scale_log2 == pytest.approx(0.1 * math.log2(math.e))
    with pytest.raises(TypeError, match="q_nope"):  # a short tuple: the hot path falls back to the checks
        step_args(qq[:2], bt, lens, out, lse, cache, md, None)


@pytest.fixture
def no_cuda_check(monkeypatch):
    """CPU stand-in for the decode checks that come after the CUDA-device one."""
    import snapmla_cute.fused as fused
    import snapmla_cute.planning as planning
    import snapmla_cute.sparse as sp
    import snapmla_cute.validation as validation

    for module in (fused, planning, sp, validation):
        monkeypatch.setattr(module, "_check_cuda", lambda **k: None)


def _dense_case(lens, table, num_pages=4):
    cache = FP8KVCache.allocate(num_pages, 64, device="cpu")
    q = torch.zeros(len(lens), 1, 16, 576, dtype=torch.bfloat16)
    return q, cache, torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def test_block_table_ids_are_checked_where_requests_have_tokens(no_cuda_check):
    """An id outside the cache would read as a zero key (score 0, counted): check=True
    rejects it in a column a request uses, before any launch; unused columns may hold anything."""
    from snapmla_cute import mla_decode
    from snapmla_cute.checks import check_values
    from snapmla_cute.validation import table_stats

    out = torch.full((2, 1, 16, 512), float("nan"), dtype=torch.bfloat16)
    for table, lens, where in (([[0, 1], [2, 999]], [100, 65], "got 999 at request 1, column 1"),
                               ([[-5, 1], [2, 3]], [1, 128], "got -5 at request 0, column 0")):
        q, cache, bt, cl = _dense_case(lens, table)
        with pytest.raises(ValueError, match=f"block_table: expected page ids in \\[0, 4\\).*{where}"):
            mla_decode(q, cache, bt, cl, out=out)
        assert torch.isnan(out.float()).all()  # nothing written
    q, cache, bt, cl = _dense_case([100, 64, 0], [[0, 1], [2, 999], [-1, -1]])
    check_values(extra=table_stats(bt, cl, cache))  # only used columns count
    q, cache, bt, cl = _dense_case([100, 200], [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="block_table: a sequence of 200 tokens needs 4 pages, table has 2 columns"):
        check_values(extra=table_stats(bt, cl, cache))
    q, cache, bt, cl = _dense_case([100, -3], [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="cache_seqlens: expected values >= 0, got min -3"):
        check_values(extra=table_stats(bt, cl, cache))


def test_quantized_query_values_are_checked(no_cuda_check):
    from snapmla_cute import mla_decode

    q, cache, bt, cl = _dense_case([10], [[0]])
    qq = (torch.zeros(1, 1, 16, 512, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16),
          torch.ones(1, 1, 16))
    bad_nope = qq[0].clone()
    bad_nope.view(torch.uint8)[0, 0, 3, 7] = 0xFF  # e4m3 NaN
    bad_scale = qq[2].clone()
    bad_scale[0, 0, 1] = float("inf")
    for qx, name in (((bad_nope, qq[1], qq[2]), "q_nope"), ((qq[0], qq[1], bad_scale), "q_scale")):
        with pytest.raises(ValueError, match=f"{name}: expected finite values, got NaN or Inf"):
            mla_decode(qx, cache, bt, cl)


def test_softmax_scale_and_output_memory_are_checked(no_cuda_check):
    from snapmla_cute import mla_decode

    q, cache, bt, cl = _dense_case([10], [[0]])
    for bad in (float("nan"), 0.0, -0.1, float("inf")):
        with pytest.raises(ValueError, match="softmax_scale: expected a finite value > 0"):
            mla_decode(q, cache, bt, cl, softmax_scale=bad)
    with pytest.raises(TypeError, match="softmax_scale: expected a float or None, got bool"):
        mla_decode(q, cache, bt, cl, softmax_scale=True)
    buf = torch.empty(16 * 512 + 64, dtype=torch.bfloat16)
    out = buf[: 16 * 512].view(1, 1, 16, 512)
    lse = buf[16 * 512 - 32 :].view(torch.float32)[:16].view(1, 16, 1)
    with pytest.raises(ValueError, match="out and lse: expected separate memory"):
        mla_decode(q, cache, bt, cl, out=out, lse=lse)
    big = torch.zeros(2 * 16 * 576, dtype=torch.bfloat16)
    q = big[: 16 * 576].view(1, 1, 16, 576)
    out = big[16 * 576 - 8 : 16 * 576 - 8 + 16 * 512].view(1, 1, 16, 512)  # q's last 8 values
    with pytest.raises(ValueError, match="out and q: expected separate memory"):
        mla_decode(q, cache, bt, cl, out=out)
    with pytest.raises(ValueError, match="lse and kv: expected separate memory"):
        mla_decode(q, cache, bt, cl, lse=cache.kv.view(-1).view(torch.float32)[:16].view(1, 16, 1))


def test_decode_metadata_checks_its_shape():
    from snapmla_cute.planning import decode_metadata

    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="s_q: expected an int in \\[1, 8\\], got 0"):
        decode_metadata(lens, s_q=0, heads=16)
    with pytest.raises(ValueError, match="heads: expected one of .*, got 7"):
        decode_metadata(lens, s_q=1, heads=7)


def test_plan_buffers_from_the_caller_are_checked():
    """The custom ops wrap buffers they are handed: one too short for the plan's splits (or
    a batch past the planner's shared memory) is refused, not written past."""
    import snapmla_cute.sparse as sp
    from snapmla_cute.kernels.decode_scheduler import MAX_BATCH
    from snapmla_cute.planning import DecodeMetadata

    b, h, parts = 4, 16, 8
    bufs = dict(sched=torch.zeros(parts, 8, dtype=torch.int32), split_offsets=torch.zeros(b + 1, dtype=torch.int32),
                o_partial=torch.empty(b + parts, h, 512), lse_partial=torch.empty(b + parts, h),
                counters=torch.zeros(b, 2, dtype=torch.int32))
    md = DecodeMetadata.from_buffers(*bufs.values(), s_q=1, heads=h)
    assert (md.batch, md.num_parts) == (b, parts)
    bad = [
        (dict(o_partial=torch.empty(b + parts - 1, h, 512), lse_partial=torch.empty(b + parts - 1, h)),
         "o_partial: expected shape \\(>= 12, 16, 512\\)"),
        (dict(lse_partial=torch.empty(b + parts, h + 1)), "lse_partial: expected shape"),
        (dict(counters=torch.zeros(b, 4, dtype=torch.int32)), "counters: expected shape \\(4, 2\\)"),
        (dict(sched=torch.zeros(parts, 7, dtype=torch.int32)), "sched: expected shape \\(parts, 8\\)"),
        (dict(sched=torch.zeros(161, 8, dtype=torch.int32)), "sched: expected shape"),
        (dict(split_offsets=torch.zeros(MAX_BATCH + 2, dtype=torch.int32),
              counters=torch.zeros(MAX_BATCH + 1, 2, dtype=torch.int32)), "split_offsets: expected 1..8192 requests"),
        (dict(o_partial=torch.empty(b + parts, h, 512, dtype=torch.float64)), "o_partial: expected dtype torch.float32"),
    ]
    for change, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            DecodeMetadata.from_buffers(*dict(bufs, **change).values(), s_q=1, heads=h)
    s_q = 2
    sbufs = dict(sched=torch.zeros(parts, 8, dtype=torch.int32),
                 split_offsets=torch.zeros(b * s_q + 1, dtype=torch.int32),
                 o_partial=torch.empty(b * s_q + parts, h, 512), lse_partial=torch.empty(b * s_q + parts, h),
                 counters=torch.zeros(b, s_q, 2, dtype=torch.int32), full_lengths=torch.full((b,), 64, dtype=torch.int32))
    smd = sp.SparseDecodeMetadata.from_buffers(*sbufs.values(), s_q=s_q, heads=h, topk=64)
    assert (smd.batch, smd.num_parts) == (b, parts)
    with pytest.raises(ValueError, match="s_q: expected an int in \\[1, 8\\], got 0"):
        sp.SparseDecodeMetadata.from_buffers(*sbufs.values(), s_q=0, heads=h, topk=64)
    with pytest.raises(ValueError, match="o_partial: expected shape \\(>= 16, 16, 512\\)"):
        sp.SparseDecodeMetadata.from_buffers(*dict(sbufs, o_partial=torch.empty(b * s_q, h, 512)).values(),
                                             s_q=s_q, heads=h, topk=64)


def test_sparse_hot_path_explains_bad_indices(no_cuda_check, monkeypatch):
    """With check=False and a compiled step at hand, indices that are not a tensor fall back to
    the Python checks (a clear error), not an AttributeError."""
    import snapmla_cute.sparse as sp
    from snapmla_cute import steps

    b, s_q, h = 2, 1, 16
    cache = FP8KVCache.allocate(4, 64, device="cpu")
    qq = (torch.zeros(b, s_q, h, 512, dtype=torch.float8_e4m3fn), torch.zeros(b, s_q, h, 64, dtype=torch.bfloat16),
          torch.ones(b, s_q, h))
    smd = sp.SparseDecodeMetadata.from_buffers(
        torch.zeros(1, 8, dtype=torch.int32), torch.zeros(b * s_q + 1, dtype=torch.int32), torch.empty(3, h, 512),
        torch.empty(3, h), torch.zeros(b, s_q, 2, dtype=torch.int32), torch.full((b,), 4, dtype=torch.int32),
        s_q=s_q, heads=h, topk=4)
    monkeypatch.setitem(steps.HOT_SPARSE, (h, s_q, False, smd.cluster, False), lambda *a: pytest.fail("launched"))
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16)
    lse = torch.empty(b, h, s_q)
    with pytest.raises(TypeError, match="indices: expected a torch.Tensor, got list"):
        sp.mla_decode_sparse(qq, cache, [[1, 2]], metadata=smd, out=out, lse=lse, check=False)


def test_context_parallel_rank_must_be_the_process_rank(monkeypatch):
    import torch.distributed as dist

    from snapmla_cute import distributed

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    cache = FP8KVCache.allocate(1, 64, device="cpu")
    lens = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="placement: expected RoundRobin.rank 1 .*, got 0"):
        distributed.mla_decode_cp(q, cache, torch.zeros(1, 1, dtype=torch.int32), lens,
                                  placement=distributed.RoundRobin(0, 2))


def test_lengths_past_the_plans_range_are_refused(no_cuda_check):
    """The plan counts blocks in int32: lengths above MAX_SEQLEN (its sums could wrap) are
    refused with check=True, as sparse lists longer than that."""
    import snapmla_cute.sparse as sp
    from snapmla_cute.checks import check_values
    from snapmla_cute.kernels.decode_scheduler import MAX_BATCH, MAX_SEQLEN
    from snapmla_cute.validation import table_stats

    assert MAX_BATCH * (MAX_SEQLEN // 64 + 5) < 2**31
    cache = FP8KVCache.allocate(1, 64, device="cpu")
    bt = torch.zeros(1, 0, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"cache_seqlens: expected values <= {MAX_SEQLEN} .*, got max {MAX_SEQLEN + 1}"):
        check_values(extra=table_stats(bt, torch.tensor([MAX_SEQLEN + 1], dtype=torch.int32), cache))
    with pytest.raises(ValueError, match=f"topk: expected an int in \\[1, {MAX_SEQLEN}\\]"):
        sp.sparse_decode_metadata(1, 1, 16, MAX_SEQLEN + 1, device="cpu")


def test_merge_refuses_outputs_inside_its_partials(no_cuda_check, monkeypatch):
    from snapmla_cute import distributed

    monkeypatch.setattr(distributed, "_check_cuda", lambda **k: None)
    outs = torch.zeros(2, 1, 1, 16, 512, dtype=torch.bfloat16)
    lses = torch.zeros(2, 1, 16, 1)
    with pytest.raises(ValueError, match="out and outs: expected separate memory"):
        distributed.merge_partials(outs, lses, out=outs[1], lse=torch.empty(1, 16, 1))


def test_fused_ops_explain_non_tensors_without_checks():
    """check=False skips the Python checks, not the explanation of a wrong type."""
    cache = FP8KVCache.allocate(2, 16, device="cpu")
    slots = torch.arange(4)
    q_out = (torch.empty(1, 1, 16, 512, dtype=torch.float8_e4m3fn), torch.empty(1, 1, 16, 64, dtype=torch.bfloat16),
             torch.empty(1, 1, 16))
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        quantize_q([1, 2], check=False, out=q_out)
    with pytest.raises(TypeError, match="kv: expected a torch.Tensor, got list"):
        append_kv(cache, [1, 2], slots, check=False)
    with pytest.raises(TypeError, match="cache: expected FP8KVCache, got str"):
        dequantize_kv("cache", slots, out=torch.empty(4, 576, dtype=torch.bfloat16), check=False)


def test_accurate_mode_arguments_are_checked(no_cuda_check):
    """q_precision and the four-tensor query (``quantize_q(precision="e4m3x2")``) are checked
    before any launch; nothing is written on error."""
    from snapmla_cute import mla_decode, mla_decode_sparse, quantize_q

    q, cache, bt, cl = _dense_case([10], [[0]])
    out = torch.full((1, 1, 16, 512), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_precision: expected one of \\('e4m3', 'e4m3x2'\\), got 'e5m2'"):
        mla_decode(q, cache, bt, cl, out=out, q_precision="e5m2")
    with pytest.raises(ValueError, match="q_precision: expected one of"):
        quantize_q(q, precision="fp8")
    three = (torch.zeros(1, 1, 16, 512, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16),
             torch.ones(1, 1, 16))
    four = (*three, torch.zeros(1, 1, 16, 512, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="out: expected \\(q_nope, q_rope, q_scale, q_lo\\) for q_precision 'e4m3x2'"):
        quantize_q(q, precision="e4m3x2", out=three)
    with pytest.raises(ValueError, match="q_precision: expected e4m3x2 for a quantized query of 4 tensors, got 'e4m3'"):
        mla_decode(four, cache, bt, cl, out=out, q_precision="e4m3")
    with pytest.raises(ValueError, match="q_precision: expected e4m3 for a quantized query of 3 tensors"):
        mla_decode(three, cache, bt, cl, out=out, q_precision="e4m3x2")
    with pytest.raises(ValueError, match="q_lo: expected last dim 512"):
        mla_decode((*three, four[3][..., :256]), cache, bt, cl, out=out)
    with pytest.raises(ValueError, match="q_lo: expected the shape of q_nope"):
        mla_decode((*three, torch.zeros(1, 1, 8, 512, dtype=torch.float8_e4m3fn)), cache, bt, cl, out=out)
    with pytest.raises(ValueError, match="q: expected \\(q_nope, q_rope, q_scale\\) or"):
        mla_decode((*four, four[3]), cache, bt, cl, out=out)
    with pytest.raises(ValueError, match="q_precision"):
        mla_decode_sparse(q, FP8KVCache.allocate(4, 64, device="cpu"), torch.zeros(1, 1, 8, dtype=torch.int32),
                          q_precision="e4m3x3")
    assert torch.isnan(out.float()).all()


def test_accurate_mode_needs_three_kv_stages():
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode.kernel import DecodeKernel

    DecodeKernel(DecodeConfig(128, 1, 64, False, q_split=True, kv_stages=3))
    with pytest.raises(ValueError, match="q_split fits at most 3 KV stages"):
        DecodeKernel(DecodeConfig(128, 1, 64, False, q_split=True))


def test_hot_path_takes_only_a_precision_that_agrees_with_the_query(no_cuda_check, monkeypatch):
    """check=False with a compiled step at hand: an unknown q_precision, or one that
    contradicts the query's tensors, goes to the full path and its clear error, never to a
    launch; a precision that agrees launches the compiled step at once."""
    import snapmla_cute.sparse as sp
    from snapmla_cute import steps

    b, s_q, h = 2, 1, 16
    cache = FP8KVCache.allocate(4, 64, device="cpu")
    hi = (torch.zeros(b, s_q, h, 512, dtype=torch.float8_e4m3fn), torch.zeros(b, s_q, h, 64, dtype=torch.bfloat16),
          torch.ones(b, s_q, h))
    lo = torch.zeros(b, s_q, h, 512, dtype=torch.float8_e4m3fn)
    smd = sp.SparseDecodeMetadata.from_buffers(
        torch.zeros(1, 8, dtype=torch.int32), torch.zeros(b * s_q + 1, dtype=torch.int32), torch.empty(3, h, 512),
        torch.empty(3, h), torch.zeros(b, s_q, 2, dtype=torch.int32), torch.full((b,), 4, dtype=torch.int32),
        s_q=s_q, heads=h, topk=4)
    launched = []
    for split in (False, True):
        monkeypatch.setitem(steps.HOT_SPARSE, (h, s_q, False, smd.cluster, split), lambda *a: launched.append(a))
    out, lse = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16), torch.empty(b, h, s_q)
    idx = torch.zeros(b, s_q, 4, dtype=torch.int32)
    for q, precision in ((hi, "e5m2"), (hi, "e4m3x2"), ((*hi, lo), "e4m3")):
        with pytest.raises(ValueError, match="q_precision"):
            sp.mla_decode_sparse(q, cache, idx, metadata=smd, out=out, lse=lse, check=False, q_precision=precision)
    assert not launched
    for q, precision in ((hi, None), (hi, "e4m3"), ((*hi, lo), None), ((*hi, lo), "e4m3x2")):
        sp.mla_decode_sparse(q, cache, idx, metadata=smd, out=out, lse=lse, check=False, q_precision=precision)
    assert len(launched) == 4 and launched[-1][-1] is lo


def test_accurate_mode_bf16_query_is_refused_under_capture(no_cuda_check, monkeypatch):
    """A bf16 query with q_precision='e4m3x2' is quantized into new tensors: under capture
    it is refused before anything runs (the four tensors, made before capture, are the way)."""
    import snapmla_cute.sparse as sp
    from snapmla_cute import steps

    b, s_q, h = 2, 1, 16
    cache = FP8KVCache.allocate(4, 64, device="cpu")
    smd = sp.SparseDecodeMetadata.from_buffers(
        torch.zeros(1, 8, dtype=torch.int32), torch.zeros(b * s_q + 1, dtype=torch.int32), torch.empty(3, h, 512),
        torch.empty(3, h), torch.zeros(b, s_q, 2, dtype=torch.int32), torch.full((b,), 4, dtype=torch.int32),
        s_q=s_q, heads=h, topk=4)
    monkeypatch.setattr(steps, "capturing", lambda: True)
    monkeypatch.setattr(sp, "quantize_q", lambda *a, **k: pytest.fail("quantized"))
    monkeypatch.setattr(sp, "sparse_step", lambda *a, **k: pytest.fail("launched"))
    out = torch.full((b, s_q, h, 512), 7.0, dtype=torch.bfloat16)
    lse = torch.full((b, h, s_q), 7.0)
    q = torch.zeros(b, s_q, h, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="under CUDA-graph capture"):
        sp.mla_decode_sparse(q, cache, torch.zeros(b, s_q, 4, dtype=torch.int32), metadata=smd, out=out, lse=lse,
                             check=False, q_precision="e4m3x2")
    assert (out.float() == 7.0).all() and (lse == 7.0).all()
