"""GPU tests of the FP8 decode: every case against the bit-faithful emulation and float64."""

import math
import random

import pytest
import torch

from decode_cases import build_case, host_syncs, references
from snapmla_cute import decode_metadata, emulation, mla_decode, quantize_q
from snapmla_cute.kernels.decode.config import MERGE_FEW
from snapmla_cute import reference as ref
from snapmla_cute.tensor_core import tensor_core_mma

pytestmark = pytest.mark.gpu

EMU_REL, EMU_LSE = 2e-3, 1e-3  # vs the emulation (kernel output is bf16: compare with bf16-rounded emulation)
EXACT_REL, EXACT_COS = 5e-2, 1.5e-3  # vs float64 exact attention, FlashMLA-style data


def _run_and_check(b, s_q, h, page_size, lens, causal, *, dist="flashmla", seed=0, softmax_scale=None, metadata=None,
                   peaky=False):
    c = build_case(b, s_q, h, page_size, lens, dist=dist, seed=seed)
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    r_out, r_lse = mla_decode(
        c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, out=out, lse=lse,
        softmax_scale=softmax_scale, metadata=metadata,
    )
    assert r_out is out and r_lse is lse
    assert not torch.isnan(out.float()).any(), "output not fully written, or NaN leaked"
    assert not torch.isnan(lse).any()
    (ox, lx), (oe, le) = references(c, causal, softmax_scale)
    got = out.float()
    emu_err = ref.rel_l2(got, oe.bfloat16().float())
    assert emu_err <= EMU_REL, f"vs emulation rel-L2 {emu_err:.2e}"
    assert ref.lse_max_abs(lse, le) <= EMU_LSE, f"vs emulation LSE {ref.lse_max_abs(lse, le):.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))
    if dist == "flashmla" and not peaky:
        assert ref.rel_l2(got, ox) <= EXACT_REL
        assert ref.cos_diff(got, ox) <= EXACT_COS
    else:
        assert ref.rel_l2(got, ox) <= 1.1 * ref.rel_l2(oe, ox)
    return c, out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("h", [8, 16, 32, 64, 128])
def test_heads_and_query_lengths(seed, h, s_q, causal):
    rng = random.Random(seed)
    page_size = rng.choice([16, 32, 64, 128])
    lens = [0, rng.randint(1, 300), rng.randint(1000, 3000)]
    _run_and_check(3, s_q, h, page_size, lens, causal, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q", [5, 6, 7, 8])
@pytest.mark.parametrize("h", [8, 128])
def test_long_speculative_windows(seed, h, s_q, causal):
    """s_q up to 8 (7 draft tokens): more query rows per request than one tile at h128
    (s_q·h = 1024 rows, 16 tiles) and every row of a tile at h8 (64)."""
    rng = random.Random(seed)
    page_size = rng.choice([16, 64])
    lens = [0, rng.randint(1, 7), rng.randint(1, 300), rng.randint(1000, 3000)]
    _run_and_check(4, s_q, h, page_size, lens, causal, seed=seed)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_page_sizes_and_block_edges(seed, page_size):
    lens = [1, 63, 64, 65, page_size, page_size + 1, 2 * page_size - 1, 777]
    _run_and_check(len(lens), 2, 64, page_size, lens, True, seed=seed)


@pytest.mark.parametrize("h, s_q, causal", [(128, 1, False), (16, 4, True)])
def test_long_varlen_batch(seed, h, s_q, causal):
    lens = [0, 1, 65536 + 37, 20000]
    _run_and_check(4, s_q, h, 64, lens, causal, seed=seed)


def test_large_batch(seed):
    rng = random.Random(seed)
    lens = [rng.randint(0, 2000) for _ in range(256)]
    _run_and_check(256, 1, 32, 64, lens, False, seed=seed)


def test_kv_loads_without_the_l2_hint(seed):
    """``DecodeConfig.kv_evict_first=False``: the KV loads at L2's default policy (the
    default hints evict-first where at most two query tiles read a block, h64 here). A cache
    hint changes no value: the same output and LSE bit for bit, split requests included."""
    from snapmla_cute.tuning import DECODE_TUNING

    rng = random.Random(seed)
    lens = [rng.randint(1, 200), 64, 0, rng.randint(5000, 9000), 1]
    _, out, lse = _run_and_check(len(lens), 1, 64, 64, lens, False, seed=seed)
    DECODE_TUNING.update(kv_evict_first=False)
    try:
        _, out2, lse2 = _run_and_check(len(lens), 1, 64, 64, lens, False, seed=seed)
    finally:
        DECODE_TUNING.clear()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_three_kv_stages(seed):
    """``DecodeConfig.kv_stages=3`` (the accurate mode's ring, beside its second Q tile) with
    the default query: a shallower KV ring (the default 4 is what every other test runs)."""
    from snapmla_cute.tuning import DECODE_TUNING

    rng = random.Random(seed)
    lens = [rng.randint(1, 200), 64, 0, rng.randint(5000, 9000), 1]
    DECODE_TUNING.update(kv_stages=3)
    try:
        _run_and_check(len(lens), 1, 128, 64, lens, False, seed=seed)
        _run_and_check(len(lens), 3, 32, 32, lens, True, seed=seed)
    finally:
        DECODE_TUNING.clear()


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True)])
def test_paper_style_data(seed, s_q, causal):
    _run_and_check(2, s_q, 64, 64, [4000, 1500], causal, dist="paper", seed=seed)


@pytest.mark.parametrize("dist, h, s_q, causal", [("realistic", 128, 1, False), ("stress", 128, 1, False), ("stress", 16, 4, True)])
def test_realistic_and_stress_data(seed, dist, h, s_q, causal):
    """The accuracy study's MLA-like data sets (per-token RMS-normalized latents with outlier
    channels; the stress set with 10^3-10^4 scale spreads inside a block and sink tokens):
    the kernel matches the emulation, and is as close to exact attention."""
    _run_and_check(2, s_q, h, 64, [3000, 777], causal, dist=dist, seed=seed)


def test_custom_softmax_scale(seed):
    _run_and_check(2, 1, 32, 64, [500, 900], False, seed=seed, softmax_scale=0.07)


@pytest.mark.parametrize("softmax_scale", [1.0, 30.0])
def test_extreme_score_ranges(seed, softmax_scale):
    """Scores spread over hundreds of log2 units (softmax scale 14x and 400x the default):
    blocks far below the running max have P' under P_TINY and keep their σ_p (before, the
    emulation turned such cases into NaN); the kernel follows the emulation. Against exact
    attention the FP8 score error is amplified here, so the kernel must be as close as
    the emulation is."""
    _run_and_check(3, 2, 64, 64, [3000, 1500, 64 * 9 + 5], True, seed=seed, softmax_scale=softmax_scale, peaky=True)


def test_prequantized_q_matches_bf16_path(seed):
    c = build_case(2, 2, 64, 32, [300, 1200], seed=seed)
    a = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=True)
    b = mla_decode(quantize_q(c["q"]), c["cache"], c["block_table"], c["cache_seqlens"], causal=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_metadata_reused_with_new_lengths(seed):
    b, h = 4, 64
    c = build_case(b, 1, h, 64, [3000, 3000, 3000, 3000], seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h)
    for new in ([3000, 5, 0, 2999], [1, 2, 3, 4], [3000, 3000, 3000, 3000]):
        lens = torch.tensor(new, dtype=torch.int32, device="cuda")
        out, lse = mla_decode(c["q"], c["cache"], c["block_table"], lens, metadata=md)
        want = emulation.mla_decode_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"], lens)
        assert ref.rel_l2(out.float(), want[0].bfloat16().float()) <= EMU_REL
        assert ref.lse_max_abs(lse, want[1]) <= EMU_LSE


def test_bad_inputs_rejected_before_launch(seed):
    c = build_case(2, 1, 64, 64, [100, 200], seed=seed)
    q, cache, bt, lens = c["q"], c["cache"], c["block_table"], c["cache_seqlens"]
    out = torch.full((2, 1, 64, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    cases = [
        (lambda: mla_decode(q.float(), cache, bt, lens), TypeError, "bfloat16"),
        (lambda: mla_decode(q[:, :, :48].contiguous(), cache, bt, lens), ValueError, "heads in"),
        (lambda: mla_decode(torch.zeros(2, 9, 64, 576, dtype=torch.bfloat16, device="cuda"), cache, bt, lens), ValueError, "s_q"),
        (lambda: mla_decode(q, cache, bt.long(), lens), TypeError, "block_table"),
        (lambda: mla_decode(q, cache, bt, lens.long()), TypeError, "cache_seqlens"),
        (lambda: mla_decode(q, cache, bt[:1], lens), ValueError, "batch"),
        (lambda: mla_decode(q, cache, bt[:, :1], lens), ValueError, "needs 4 pages"),
        (lambda: mla_decode(q, cache, bt.t().contiguous().t(), lens), ValueError, "unit stride"),
        (lambda: mla_decode(q, cache, bt, lens - 500), ValueError, ">= 0"),
        (lambda: mla_decode(q, cache, bt.cpu(), lens), ValueError, "CUDA"),
        (lambda: mla_decode(q, cache.kv, bt, lens), TypeError, "FP8KVCache"),
        (lambda: mla_decode(q, cache, bt, lens, out=torch.empty(2, 1, 32, 512, dtype=torch.bfloat16, device="cuda")), ValueError, "out: expected shape"),
        (lambda: mla_decode(q, cache, bt, lens, out=out.float()), TypeError, "out"),
        (lambda: mla_decode(q, cache, bt, lens, lse=torch.empty(2, 1, 64, device="cuda")), ValueError, "lse: expected shape"),
        (lambda: mla_decode(q, cache, bt, lens, metadata=decode_metadata(lens, s_q=2, heads=64)), ValueError, "metadata"),
        (lambda: mla_decode(q, cache, bad_page, lens, out=out), ValueError, "block_table: expected page ids .* at request 1, column 3"),
        (lambda: mla_decode((qq[0], qq[1], nan_scale), cache, bt, lens, out=out), ValueError, "q_scale: expected finite"),
        (lambda: mla_decode(q, cache, bt, lens, softmax_scale=0.0, out=out), ValueError, "softmax_scale"),
        (lambda: mla_decode(q, cache, bt, lens, out=out, lse=out.view(-1)[:256].view(torch.float32).view(2, 64, 1)),
         ValueError, "out and lse: expected separate memory"),
    ]
    bad_page = bt.clone()
    bad_page[1, 3] = cache.kv.shape[0]  # request 1's last page (200 tokens: 4 pages)
    qq = quantize_q(q)
    nan_scale = qq[2].clone()
    nan_scale[0, 0, 5] = float("nan")
    for call, exc, words in cases:
        with pytest.raises(exc, match=words):
            call()
    assert torch.all(out == 7.0)


def test_checked_call_reads_back_once(seed):
    """check=True reads the lengths, the block table's used ids and the query's values back
    in one sync (bf16 or quantized query); check=False in none."""
    c = build_case(2, 1, 64, 64, [100, 200], seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=64)
    out = torch.empty(2, 1, 64, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 64, 1, device="cuda")
    for q in (c["q"], quantize_q(c["q"])):
        for check, want in ((True, 1), (False, 0)):
            syncs = host_syncs(lambda: mla_decode(q, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md,
                                                  out=out, lse=lse, check=check))
            assert len(syncs) == want, (isinstance(q, tuple), check, syncs)


def test_unchecked_lengths_are_clamped(seed):
    """check=False passes lengths as they come: a negative one is an empty request (zeros,
    -inf) and plans as 0, so no split row lands past the fp32 partials (rows after them,
    poisoned, stay as they were); the other requests are unchanged."""
    from snapmla_cute.planning import DecodeMetadata, plan_config, schedule_reference

    lens = [6400, 6400, 6400]
    c = build_case(3, 1, 64, 64, lens, seed=seed)
    parts = min(torch.cuda.get_device_properties(0).multi_processor_count, 160)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=64, num_parts=parts)
    rows = 3 + parts
    o_all = torch.full((rows + 64, 64, 512), 12345.0, device="cuda")
    l_all = torch.full((rows + 64, 64), 12345.0, device="cuda")
    guarded = DecodeMetadata.from_buffers(md.sched, md.split_offsets, o_all[:rows], l_all[:rows], md.counters,
                                          s_q=1, heads=64)
    bad = c["cache_seqlens"].clone()
    bad[0] = -10000  # unclamped: split rows 141..200 of 135 (profiles/experiments/plan_lengths.py)
    out = torch.full((3, 1, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((3, 64, 1), float("nan"), device="cuda")
    mla_decode(quantize_q(c["q"]), c["cache"], c["block_table"], bad, metadata=guarded, out=out, lse=lse, check=False)
    torch.cuda.synchronize()
    assert torch.all(o_all[rows:] == 12345.0) and torch.all(l_all[rows:] == 12345.0)
    assert md.split_offsets.cpu().tolist() == schedule_reference([0, 6400, 6400], parts,
                                                                 plan_config(1, 64, cluster=md.cluster))[1]
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    (ox, lx), (oe, le) = references(c, False)
    assert ref.rel_l2(out[1:].float(), oe[1:].bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse[1:], le[1:]) <= EMU_LSE
    assert torch.all(md.counters == 0)


def test_block_table_slice_of_a_wider_table(seed):
    c = build_case(3, 1, 32, 64, [700, 64, 1], seed=seed)
    wide = torch.full((3, c["block_table"].shape[1] + 5), 2**30, dtype=torch.int32, device="cuda")
    wide[:, : c["block_table"].shape[1]] = c["block_table"]
    sliced = wide[:, : c["block_table"].shape[1]]
    assert not sliced.is_contiguous()
    a = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"])
    b = mla_decode(c["q"], c["cache"], sliced, c["cache_seqlens"])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_zero_length_batch_gives_zero_and_neg_inf(seed):
    c = build_case(3, 2, 32, 64, [0, 0, 0], seed=seed)
    out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


@pytest.mark.parametrize("parts", [1, 7, 66, 132, 300])
@pytest.mark.parametrize("units, stream", [(0, 0), (6, 105), (1, 0)])
def test_device_scheduler_matches_reference(parts, units, stream):
    """The standalone scheduler (``DecodeMetadata.update``) against the reference, with the
    whole-request rule off and at two shapes' constants (short batches to reach it)."""
    from snapmla_cute.kernels import decode_scheduler
    from snapmla_cute.kernels.decode_scheduler import SchedulerConfig
    from snapmla_cute.planning import schedule_reference
    from snapmla_cute.tuning import launcher

    rng = random.Random(parts)
    cfg = SchedulerConfig(split_units=units, stream_parts=stream)
    for i in range(6):
        if i < 3:
            lens = [rng.choice([0, 1, 64, 65, rng.randint(0, 70000)]) for _ in range(rng.randint(1, 600))]
        else:
            lens = [rng.choice([0, 1, rng.randint(500, 1500)]) for _ in range(rng.randint(1, parts))]
        sched = torch.full((parts, 8), -7, dtype=torch.int32, device="cuda")
        offsets = torch.full((len(lens) + 1,), -7, dtype=torch.int32, device="cuda")
        launcher(decode_scheduler.compile)(torch.tensor(lens, dtype=torch.int32, device="cuda"), sched, offsets,
                                            units, stream)
        want_sched, want_offsets = schedule_reference(lens, parts, cfg)
        assert sched.cpu().tolist() == want_sched, lens
        assert offsets.cpu().tolist() == want_offsets, lens


def test_num_parts_beyond_one_wave_refused():
    lens = torch.tensor([100, 200], dtype=torch.int32, device="cuda")
    slots = torch.cuda.get_device_properties(0).multi_processor_count // 2
    decode_metadata(lens, s_q=1, heads=128, num_parts=slots)
    with pytest.raises(ValueError, match="num_parts"):
        decode_metadata(lens, s_q=1, heads=128, num_parts=slots + 1)


@pytest.mark.parametrize("h, parts", [(128, 1), (128, 7), (128, 66), (64, 132), (16, 40)])
def test_in_kernel_plan_and_merge(seed, h, parts):
    """The decode kernel plans its own part (the plan it ran is written back to the
    metadata and must be the reference plan) and merges split requests itself (splits
    0..n-2 each merge a share of the rows), from 2 to ~100 splits per request."""
    from snapmla_cute.planning import plan_config, schedule_reference

    rng = random.Random(seed * 1000 + parts)
    lens = [rng.choice([0, 1, 64, 65, rng.randint(0, 3000), rng.randint(0, 9000)]) for _ in range(12)]
    c = build_case(len(lens), 1, h, 64, lens, seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, num_parts=parts)
    md.cluster = 1  # the merge through global memory (a cluster launch may take the cluster plan)
    md.sched.fill_(-7)
    md.split_offsets.fill_(-7)
    for _ in range(2):  # the second call checks the split counters came back to zero
        out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
        sched, offsets = schedule_reference(lens, parts, plan_config(1, h, cluster=md.cluster))
        assert md.sched.cpu().tolist() == sched, lens
        assert md.split_offsets.cpu().tolist() == offsets, lens
        assert torch.all(md.counters == 0)
        (ox, lx), (oe, le) = references(c, False)
        assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL, lens
        assert ref.lse_max_abs(lse, le) <= EMU_LSE, lens
        assert torch.equal(torch.isinf(lse), torch.isinf(lx.float()))


@pytest.mark.parametrize("b, h, parts", [(24, 64, 24), (48, 32, 60), (20, 128, 30)])
def test_whole_request_plan(seed, b, h, parts):
    """Batches that fit the parts, with lengths that would be cut by the split plan: part p
    takes request p whole (the one-warp plan at b <= 32, the CTA-wide one past it), empty
    and one-token requests among them; the plan the kernel ran is the reference's and the
    outputs match the emulation. (The split-everywhere plan, once a switch, is at cc70d70;
    the split plan runs wherever the rule takes it, in the tests above.)"""
    from snapmla_cute.planning import plan_config, schedule_reference

    rng = random.Random(seed * 31 + b)
    lens = [0, 1] + [rng.randint(700, 1300) for _ in range(b - 2)]
    c = build_case(b, 1, h, 64, lens, seed=seed)
    (ox, lx), (oe, le) = references(c, False)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, num_parts=parts)
    md.cluster = 1  # whole requests or splits, not the cluster plan
    sched, offsets = schedule_reference(lens, parts, plan_config(1, h))
    assert offsets[-1] == b, offsets[-1]  # whole requests: one split each
    md.sched.fill_(-7)
    md.split_offsets.fill_(-7)
    out = torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, 1), float("nan"), device="cuda")
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
    assert md.sched.cpu().tolist() == sched, lens
    assert md.split_offsets.cpu().tolist() == offsets, lens
    assert torch.all(md.counters == 0)
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL, lens
    assert ref.lse_max_abs(lse, le) <= EMU_LSE, lens
    assert ref.rel_l2(out.float(), ox) <= 5e-2
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


@pytest.mark.parametrize("b, h, k, parts", [(60, 64, 2, 132), (30, 128, 2, 66), (28, 64, 4, 112), (12, 128, 4, 56),
                                           (7, 16, 8, 56), (14, 8, 8, 112), (28, 8, 4, 112), (14, 32, 4, 56),
                                           (50, 16, 2, 100)])
def test_cluster_plan(seed, b, h, k, parts):
    """The cluster plan: request r's k portions on the k CTAs of cluster r, merged through
    distributed shared memory. Empty, one-token and varied requests (portions with no
    blocks among them), three calls with poisoned outputs; the plan the kernel ran is the
    reference's, the outputs match the emulation and float64, the counters stay zero. At
    8-32 heads each rank owns 1, 2, 4 or 8 of the live rows (``cluster_rows_per_rank``)."""
    from snapmla_cute.kernels.decode_scheduler import PLAN_CLUSTER
    from snapmla_cute.planning import plan_config, plan_of, schedule_reference
    from snapmla_cute.tuning import DECODE_TUNING

    rng = random.Random(seed * 17 + b)
    lens = [0, 1] + [rng.randint(1800, 2200) if i % 3 else rng.randint(1, 2200) for i in range(b - 2)]
    c = build_case(b, 1, h, 64, lens, seed=seed)
    (ox, lx), (oe, le) = references(c, False)
    DECODE_TUNING.update(cluster=k)
    try:
        cfg = plan_config(1, h)
        # lengths chosen so that every draw takes the cluster plan (a test of the plan, not of the rule)
        assert plan_of(lens, parts, cfg) == PLAN_CLUSTER
        md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, num_parts=parts)
        sched, offsets = schedule_reference(lens, parts, cfg)
        for _ in range(3):
            out = torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((b, h, 1), float("nan"), device="cuda")
            mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
            assert md.sched.cpu().tolist() == sched, lens
            assert md.split_offsets.cpu().tolist() == offsets == list(range(b + 1))
            assert torch.all(md.counters == 0)
            assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL, lens
            assert ref.lse_max_abs(lse, le) <= EMU_LSE, lens
            assert ref.rel_l2(out.float(), ox) <= 5e-2
            assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    finally:
        DECODE_TUNING.clear()


def test_default_metadata_takes_clusters_where_they_pay():
    """b64 h64 s_k2048 (the cluster plan: 54.8 -> 44.9 µs on the H100) launches in clusters of
    two; b32 h64 s_k8192 (split over every SM) and b128 h128 do not."""
    from snapmla_cute.heads import CLUSTER_SM_COUNTS

    lens = lambda b, L: torch.full((b,), L, dtype=torch.int32, device="cuda")  # noqa: E731
    if torch.cuda.get_device_properties(0).multi_processor_count not in CLUSTER_SM_COUNTS:
        pytest.skip("clusters of two are not launched on this device")
    assert decode_metadata(lens(64, 2048), s_q=1, heads=64).cluster == 2
    assert decode_metadata(lens(32, 8192), s_q=1, heads=64).cluster == 1
    assert decode_metadata(lens(128, 2048), s_q=1, heads=128).cluster == 1


@pytest.mark.parametrize("b, s_q, h, causal", [(40, 1, 64, False), (30, 2, 32, True)])
def test_cluster_plan_by_default(seed, b, s_q, h, causal):
    """The metadata's own choice (no tuning): clusters of two, the cluster plan at every call,
    against the emulation and float64, s_q 2 causal included."""
    from snapmla_cute.heads import CLUSTER_SM_COUNTS

    if torch.cuda.get_device_properties(0).multi_processor_count not in CLUSTER_SM_COUNTS:
        pytest.skip("clusters of two are not launched on this device")
    rng = random.Random(seed)
    lens = [0] + [rng.randint(1300, 1700) for _ in range(b - 1)]
    c = build_case(b, s_q, h, 64, lens, seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h)
    assert md.cluster == 2
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse, causal=causal)
    assert md.split_offsets.cpu().tolist() == list(range(b + 1))  # no split: the cluster plan
    (ox, lx), (oe, le) = references(c, causal)
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse, le) <= EMU_LSE
    assert ref.rel_l2(out.float(), ox) <= 5e-2
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))




@pytest.mark.parametrize("h, k", [(64, 2), (64, 3), (128, MERGE_FEW), (16, MERGE_FEW), (8, 2), (64, MERGE_FEW + 1)])
def test_few_split_merge(seed, h, k):
    """Equal requests cut into about k splits each: up to ``config.MERGE_FEW`` a
    thread per row for the LSE and several items per thread at once, past it the general
    merge; partials poisoned with NaN before the call, against the emulation and float64."""
    b = 8
    lens = [4096 - 64 * (i % 2) for i in range(b)]  # 64 or 63 blocks: some parts cut mid-request
    c = build_case(b, 1, h, 64, lens, seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, num_parts=b * k)
    md.cluster = 1  # the merge through global memory (a cluster launch would take the cluster plan)
    md.o_partial.fill_(float("nan"))
    md.lse_partial.fill_(float("nan"))
    out = torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, 1), float("nan"), device="cuda")
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
    splits = md.split_offsets.diff()[:b].cpu()
    assert splits.min() >= 2, splits.tolist()
    # each case pins one path: up to MERGE_FEW // 2 splits (more items per thread), up to
    # MERGE_FEW, or past it the general merge for some request
    if k <= MERGE_FEW // 2:
        assert splits.max() <= MERGE_FEW // 2, splits.tolist()
    elif k == MERGE_FEW:
        assert splits.min() > MERGE_FEW // 2 and splits.max() <= MERGE_FEW, splits.tolist()
    else:
        # past MERGE_FEW for some requests (fp32 partials) and not for others (f16): both
        # formats in one launch's partial buffer
        assert splits.min() <= MERGE_FEW < splits.max(), splits.tolist()
    (ox, lx), (oe, le) = references(c, False)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse, le) <= EMU_LSE
    assert ref.rel_l2(out.float(), ox) <= 5e-2
    assert torch.all(md.counters == 0)


@pytest.mark.parametrize("magnitude", [2.0**20, 2.0**-20])
def test_split_partials_at_extreme_magnitudes(seed, magnitude):
    """A request of at most ``MERGE_FEW`` splits keeps its partials as f16, each row scaled
    by a power of two: KV values times 2^20 (outputs ~1e5, past f16's 65504) or 2^-20
    (~1e-7, below its normal range) with the scores unchanged (the softmax scale divided by
    the same), every request split so: the output is the emulation's, as close as at
    ordinary magnitudes."""
    b, h = 4, 64
    lens = [4096, 4000, 2500, 700]
    c = build_case(b, 1, h, 64, lens, seed=seed)
    c["cache"].kv_scale.mul_(magnitude)  # K and V (content, and RoPE stored over the scale) scale with it
    c["k_pages"] = c["k_pages"] * magnitude  # exact: a power of two
    scale = ref.default_softmax_scale() / magnitude
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, num_parts=16)
    md.cluster = 1  # the merge through global memory
    md.o_partial.fill_(float("nan"))
    out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], softmax_scale=scale, metadata=md)
    splits = md.split_offsets.diff()[:b].cpu()
    assert splits.min() >= 2 and splits.max() <= MERGE_FEW, splits.tolist()
    (ox, lx), (oe, le) = references(c, False, scale)
    got = out.float()
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    assert got.abs().max() > 1e4 if magnitude > 1 else got.abs().max() < 1e-5
    assert ref.rel_l2(got, oe.bfloat16().float()) <= EMU_REL
    assert ref.lse_max_abs(lse, le) <= EMU_LSE
    assert ref.rel_l2(got, ox) <= EXACT_REL


@pytest.mark.parametrize("batch", [32, 33])
def test_in_kernel_plan_at_the_single_warp_limit(seed, batch):
    """Batches of at most 32 requests plan with one warp's shuffle scans, larger ones with
    the CTA-wide scans (``plan.Planner.plan``): both sides of the limit give the
    reference plan, split requests included, and the emulation's output."""
    from snapmla_cute.planning import plan_config, schedule_reference

    rng = random.Random(seed * 7 + batch)
    lens = [rng.choice([0, 1, 64, 65, rng.randint(0, 700)]) for _ in range(batch - 1)] + [3000]
    parts = 16  # the last request (52 units) is longer than a part (at most 35): split
    c = build_case(batch, 1, 16, 64, lens, seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=16, num_parts=parts)
    md.sched.fill_(-7)
    md.split_offsets.fill_(-7)
    out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
    sched, offsets = schedule_reference(lens, parts, plan_config(1, 16, cluster=md.cluster))
    assert md.sched.cpu().tolist() == sched, lens
    assert md.split_offsets.cpu().tolist() == offsets, lens
    assert offsets[-1] > batch  # some request was split
    (ox, lx), (oe, le) = references(c, False)
    assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL, lens
    assert ref.lse_max_abs(lse, le) <= EMU_LSE, lens


@pytest.mark.parametrize("h, s_q, ps, lens, causal", [
    (128, 1, 64, [640], False),
    (32, 2, 16, [0, 77, 3000], True),
    (128, 1, 64, [8192, 100], False),
    (64, 1, 32, [5000, 1, 2500, 129], False),
])
def test_merge_never_reads_unwritten_partials(seed, h, s_q, ps, lens, causal):
    """Repeated calls with the split buffers poisoned with NaN before each: a merge that
    read a partial before its writer finished would show NaN or differ between calls."""
    c = build_case(len(lens), s_q, h, ps, lens, seed=seed)
    md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h)
    first = None
    for it in range(40):
        md.o_partial.fill_(float("nan"))
        md.lse_partial.fill_(float("nan"))
        out = torch.full((len(lens), s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((len(lens), h, s_q), float("nan"), device="cuda")
        mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, metadata=md, out=out, lse=lse, check=False)
        if first is None:
            first = (out.clone(), lse.clone())
            (_, _), (oe, le) = references(c, causal)
            assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
            assert ref.rel_l2(out.float(), oe.bfloat16().float()) <= EMU_REL
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"call {it} differs"
    assert torch.all(md.counters == 0)


STUCK_MERGE = r"""
import sys, time, torch
sys.path.insert(0, "tests")
from decode_cases import build_case
from snapmla_cute import decode_metadata, mla_decode
c = build_case(1, 1, 128, 64, [4096], seed=1)
md = decode_metadata(c["cache_seqlens"], s_q=1, heads=128, num_parts=8)
mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
torch.cuda.synchronize()
md.counters.fill_(-100)  # a count that can never reach the number of splits
t0 = time.time()
try:
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
    torch.cuda.synchronize()
    print("COMPLETED")
except Exception as e:
    print(f"FAILED after {time.time() - t0:.1f} s: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
"""


def test_stuck_merge_fails_the_launch_instead_of_hanging():
    """Splits that wait for a count that never comes trap after MERGE_WAIT_LIMIT_NS (4 s):
    the call raises a CUDA error instead of hanging the stream (child process: the error
    ends its CUDA context)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", STUCK_MERGE], capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert "COMPLETED" not in out, out[-2000:]
    assert "FAILED after" in out, out[-2000:]
    waited = float(out.split("FAILED after ")[1].split(" s")[0])
    assert 3.0 <= waited <= 60.0, out[-2000:]


def test_emulation_is_the_same_on_gpu_and_cpu(seed):
    """The references run on the GPU in these tests: the tensor-core adder model must give
    the CPU's bits there (it did not while 2^e came from pow: a 7e-5 score difference at
    softmax scale 30 made test_extreme_score_ranges miss its LSE tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    a = ref.to_e4m3(torch.randn(64, 512, generator=gen) * 2.0 ** torch.randint(-6, 7, (64, 1), generator=gen)).float()
    b = ref.to_e4m3(torch.randn(256, 512, generator=gen) * 2.0 ** torch.randint(-6, 7, (256, 1), generator=gen)).float()
    ar = torch.randn(64, 64, generator=gen).bfloat16().float()
    br = (torch.randn(256, 64, generator=gen) * 100).bfloat16().float()
    cpu = tensor_core_mma(ar, br, tensor_core_mma(a, b), kind="bf16")
    gpu = tensor_core_mma(ar.cuda(), br.cuda(), tensor_core_mma(a.cuda(), b.cuda()), kind="bf16")
    assert torch.equal(gpu.cpu(), cpu)
