"""The split-KV schedule covers every block of every request exactly once (CPU walk)."""

import random

import pytest

from snapmla_cute.kernels.decode_scheduler import SchedulerConfig
from snapmla_cute.planning import schedule_reference


# the plan's constants: the split-everywhere plan, and the decode's at 64 and at 8 rows
# (whole-request plans where they pay)
CONFIGS = [SchedulerConfig(), SchedulerConfig(split_units=6, stream_parts=105), SchedulerConfig(split_units=1),
           SchedulerConfig(split_units=6, stream_parts=105, cluster=2), SchedulerConfig(split_units=1, cluster=4)]


def _coverage(lens, parts, cfg=SchedulerConfig()):
    sched, offsets = schedule_reference(lens, parts, cfg)
    n_blocks = [(L + 63) // 64 for L in lens]
    seen = {r: [] for r in range(len(lens))}
    splits_seen = {r: set() for r in range(len(lens))}
    for begin_req, begin_blk, end_req, end_blk, begin_split, *_ in sched:
        if begin_req >= len(lens):
            continue  # an idle part
        for r in range(begin_req, end_req + 1):
            lo = begin_blk if r == begin_req else 0
            hi = end_blk if r == end_req else n_blocks[r]
            split = begin_split if r == begin_req else 0
            if hi > lo or n_blocks[r] == 0:
                seen[r].extend(range(lo, hi))
                splits_seen[r].add(split)
                if n_blocks[r] == 0:
                    seen[r].append("empty")  # an empty request is finished by exactly one part
    return n_blocks, seen, splits_seen, offsets


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("parts", [1, 7, 66, 132])
def test_every_block_once_and_split_counts_match(parts, cfg):
    rng = random.Random(parts)
    for _ in range(20):
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 70000)]) for _ in range(rng.randint(1, 40))]
        n_blocks, seen, splits_seen, offsets = _coverage(lens, parts, cfg)
        for r, n in enumerate(n_blocks):
            assert seen[r] == (list(range(n)) if n else ["empty"]), (lens, parts, r)
            n_splits = offsets[r + 1] - offsets[r]
            assert n_splits >= 1
            assert splits_seen[r] == set(range(n_splits)), (lens, parts, r)
        assert offsets[-1] <= len(lens) + parts  # the partial buffers' bound


def test_parts_are_balanced():
    lens = [4096] * 128
    sched, _ = schedule_reference(lens, 66)
    work = []
    for begin_req, begin_blk, end_req, end_blk, *_ in sched:
        w = 0
        for r in range(begin_req, end_req + 1):
            lo = begin_blk if r == begin_req else 0
            hi = end_blk if r == end_req else 64
            w += hi - lo
        work.append(w)
    assert sum(work) == 128 * 64
    assert max(work) - min(work) <= 11  # parts differ by at most two requests' overheads


def test_default_parts_avoid_splitting_equal_batches():
    from snapmla_cute.planning import default_num_parts

    assert default_num_parts(128, 2, 132) == 64  # 2 requests per part, unsplit, 128 of 132 SMs
    assert default_num_parts(128, 4, 132) == 32
    assert default_num_parts(32, 1, 132) == 132  # few requests: split them over every SM
    assert default_num_parts(1, 2, 132) == 66
    assert default_num_parts(100, 2, 132) == 66  # 50 parts would idle 24% of the SMs
    assert default_num_parts(128, 1, 132) == 128  # one whole request per part, 4 SMs idle
    assert default_num_parts(118, 1, 132) == 132  # 14 idle SMs (over 10%): split
    sched, offsets = schedule_reference([4096] * 128, 64)
    assert offsets[-1] == 128  # no request split


def _merge_roles(lens, parts, cfg=SchedulerConfig()):
    """The in-kernel merge as the decode kernel's consumers see it: for every visit of a
    split request, (split index, part, is it the part's last request)."""
    sched, offsets = schedule_reference(lens, parts, cfg)
    visits = {}
    for p, (b, _, e, _, begin_split, *_) in enumerate(sched):
        if b >= len(lens):
            continue
        for i, req in enumerate(range(b, e + 1)):
            n_splits = offsets[req + 1] - offsets[req]
            split = begin_split if i == 0 else 0
            if (i == 0 or req == e) and n_splits > 1:
                visits.setdefault(req, []).append((split, p, req == e))
    return visits, offsets


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("parts", [1, 7, 16, 33, 40, 66, 132])
def test_merge_counts_and_waiting_splits(parts, cfg):
    """Each split request is counted by exactly its n splits (indices 0..n-1, once each), and
    the splits that wait for the count (0..n-2) all process that request last in their part,
    so no waiting CTA holds work another split needs."""
    rng = random.Random(1000 + parts)
    for _ in range(200):
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 9000)]) for _ in range(rng.randint(1, 40))]
        visits, offsets = _merge_roles(lens, parts, cfg)
        for req, seen in visits.items():
            n = offsets[req + 1] - offsets[req]
            assert sorted(s for s, _, _ in seen) == list(range(n)), (lens, parts, req)
            assert all(last for s, _, last in seen if s < n - 1), (lens, parts, req)
            assert len({p for _, p, _ in seen}) == n


def test_few_split_merge_cases_take_each_merge_path():
    """The GPU merge test's equal requests (8 of 64 or 63 blocks over 8·k parts) must land on
    each path of the merge: at most MERGE_FEW // 2 splits, up to MERGE_FEW, and past it."""
    from snapmla_cute.kernels.decode.config import MERGE_FEW as few
    lens = [4096 - 64 * (i % 2) for i in range(8)]

    def splits(k):
        _, offsets = schedule_reference(lens, 8 * k)
        return [b - a for a, b in zip(offsets[:8], offsets[1:9])]

    assert 2 <= min(splits(2)) and max(splits(3)) <= few // 2
    assert few // 2 < min(splits(few)) and max(splits(few)) <= few
    assert max(splits(few + 1)) > few


def test_lengths_outside_the_range_plan_as_clamped():
    """Unchecked lengths (check=False, graph replays) are clamped to [0, MAX_SEQLEN] by every
    reader: a negative one plans as an empty request and every split row stays inside the
    b + parts rows of the partials."""
    from snapmla_cute.kernels.decode_scheduler import MAX_SEQLEN

    rng = random.Random(5)
    for parts in (8, 66, 132):
        for _ in range(200):
            lens = [rng.choice([rng.randint(-10**6, -1), rng.randint(0, 20000), MAX_SEQLEN + rng.randint(1, 10**6),
                                -(2**31), 2**31 - 1]) for _ in range(rng.randint(1, 8))]
            clamped = [min(max(L, 0), MAX_SEQLEN) for L in lens]
            assert schedule_reference(lens, parts) == schedule_reference(clamped, parts)
            sched, offsets = schedule_reference(clamped, parts)
            assert offsets[-1] <= len(lens) + parts - 1
            for row in sched:
                if row[0] < len(lens):
                    assert 0 <= offsets[row[0]] + row[4] < len(lens) + parts, (lens, parts, row)


# H100, graph-replay µs, the same run per row (profiles/merge.md, "Whole-request and cluster plans"):
# (batch, length, heads, sparse, parts, µs with part p = request p, µs on the parts' split plan)
MEASURED = [
    (40, 1024, 128, False, 66, 30.9, 39.9), (40, 2048, 128, False, 66, 54.3, 55.2),
    (40, 4096, 128, False, 66, 98.4, 81.0), (48, 1024, 128, False, 66, 31.7, 45.1),
    (48, 2048, 128, False, 66, 53.7, 61.4), (48, 4096, 128, False, 66, 98.7, 96.1),
    (56, 1024, 128, False, 66, 33.9, 49.4), (56, 2048, 128, False, 66, 55.9, 70.5),
    (56, 4096, 128, False, 66, 99.9, 108.6),
    (48, 1024, 64, False, 132, 31.2, 35.3), (48, 2048, 64, False, 132, 54.3, 48.7),
    (48, 4096, 64, False, 132, 96.9, 73.0), (64, 1024, 64, False, 132, 33.4, 41.9),
    (64, 2048, 64, False, 132, 55.9, 59.4), (64, 4096, 64, False, 132, 99.2, 89.0),
    (64, 8192, 64, False, 132, 186.8, 147.6), (64, 16384, 64, False, 132, 353.0, 262.5),
    (96, 1024, 64, False, 132, 37.9, 54.4), (96, 2048, 64, False, 132, 60.7, 78.4),
    (96, 4096, 64, False, 132, 106.7, 123.3), (96, 8192, 64, False, 132, 205.3, 211.3),
    (64, 2048, 16, False, 132, 53.8, 48.9), (64, 8192, 16, False, 132, 185.7, 134.3),
    (96, 2048, 16, False, 132, 57.1, 64.2),
    (64, 2048, 64, True, 132, 70.9, 65.4), (96, 2048, 64, True, 132, 73.0, 87.9),
    (64, 2048, 8, True, 132, 68.3, 53.6),
]


@pytest.mark.parametrize("b, length, heads, sparse, parts, whole_us, split_us", MEASURED)
def test_whole_request_rule_picks_the_faster_plan(b, length, heads, sparse, parts, whole_us, split_us):
    """The rule's constants against the H100's measurements: equal lengths, the plan with
    the lower time (the rows within 1% either way are left out of this table)."""
    from snapmla_cute.planning import plan_config

    sched, offsets = schedule_reference([length] * b, parts, plan_config(1, heads, sparse=sparse))
    assert (offsets[-1] == b) == (whole_us < split_us), (offsets[-1], whole_us, split_us)


@pytest.mark.parametrize("cfg", CONFIGS[1:3])
def test_whole_plan_is_part_p_request_p(cfg):
    lens = [300 + r for r in range(90)] + [0, 1]
    sched, offsets = schedule_reference(lens, 132, cfg)
    assert offsets == list(range(93))
    for p, row in enumerate(sched):
        if p < len(lens):
            assert row == [p, 0, p, (lens[p] + 63) // 64, 0, 0, 0, 0]
        else:
            assert row == [len(lens), 0, 0, 0, 0, 0, 0, 0]
    # one long request among short ones: splitting it pays, the rule keeps the split plan
    _, offsets = schedule_reference(lens[:-3] + [60000], 132, cfg)
    assert offsets[-1] > 90


def test_plan_config_of_the_decode_shapes():
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.planning import plan_config
    from snapmla_cute.tuning import DECODE_TUNING

    assert plan_config(1, 64) == SchedulerConfig(split_units=6, stream_parts=105)
    assert plan_config(1, 128) == SchedulerConfig(split_units=6, stream_parts=105)
    assert plan_config(1, 16) == SchedulerConfig(split_units=2, stream_parts=105)
    assert plan_config(2, 8) == SchedulerConfig(split_units=2, stream_parts=105)
    assert plan_config(1, 8, sparse=True) == SchedulerConfig(split_units=1, stream_parts=0)
    assert DecodeConfig(heads=64, s_q=1, page_size=64, causal=False, cluster=2).scheduler == plan_config(1, 64, cluster=2)
    DECODE_TUNING.update(cluster=4)
    try:
        assert plan_config(1, 64) == SchedulerConfig(split_units=6, stream_parts=105, cluster=4)
    finally:
        DECODE_TUNING.clear()


@pytest.mark.parametrize("k", [2, 4, 8])
def test_cluster_plan_gives_cluster_c_request_c(k):
    """The cluster plan: parts kc..kc+k-1 take request c's blocks in k near-equal portions
    (some empty for a request shorter than k blocks), one split per request, parts past k·b idle."""
    from snapmla_cute.kernels.decode_scheduler import PLAN_CLUSTER
    from snapmla_cute.planning import plan_of

    cfg = SchedulerConfig(split_units=6, stream_parts=105, cluster=k)
    lens = [0, 1, 130] + [2000 + 5 * r for r in range(100 // k - 3)]
    parts = 132 - 132 % k
    assert plan_of(lens, parts, cfg) == PLAN_CLUSTER
    sched, offsets = schedule_reference(lens, parts, cfg)
    assert offsets == list(range(len(lens) + 1))
    for p, row in enumerate(sched):
        if p < k * len(lens):
            r, q = divmod(p, k)
            n = (lens[r] + 63) // 64
            assert row == [r, q * n // k, r, (q + 1) * n // k, 0, 0, 0, 0]
        else:
            assert row == [len(lens), 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("heads, s_q, k, owned", [
    (16, 1, 8, 2), (8, 1, 8, 1), (16, 1, 2, 8), (32, 1, 8, 4), (32, 1, 4, 8), (8, 1, 4, 2),
    (128, 1, 2, 32), (64, 1, 8, 8), (16, 3, 8, 8), (8, 3, 4, 16), (16, 3, 2, 24),
])
def test_cluster_merge_rows_per_rank(heads, s_q, k, owned):
    """The cluster merge spreads a tile's live rows over the k ranks where they split into
    1, 2 or 4 rows a rank or whole 8-row slabs (else each rank owns 64/k rows, dead ones
    too), and its receive buffer holds the k - 1 peers' owned rows (at least a slab each)
    and their LSEs; in clusters of 4 or 8 whose ranks own only live rows, fewer than a
    tile, every consumer thread merges (``cluster_merge_spread``: the buffer holds this
    rank's rows too, and QK is not issued early)."""
    from snapmla_cute.format import CONTENT_DIM
    from snapmla_cute.kernels.decode.config import DecodeConfig

    cfg = DecodeConfig(heads, s_q, 64, False, cluster=k)
    assert cfg.cluster_rows_per_rank == owned
    spread = k >= 4 and owned * k < 64
    assert cfg.cluster_merge_spread == spread
    assert cfg.issue_qk_early == (not spread)
    slots = k if spread else k - 1
    lse_off, total = cfg.cluster_recv_bytes
    assert lse_off == slots * max(owned, 8) * CONTENT_DIM * 4
    assert total == lse_off + slots * 64 * 4


def test_default_cluster():
    """Clusters of two where the rule takes the cluster plan at the metadata's lengths, on
    devices whose wave of pairs was measured to fit (132 SMs), with an even part count."""
    from snapmla_cute.planning import default_cluster, plan_config

    h64, h128 = plan_config(1, 64, cluster=2), plan_config(1, 128, cluster=2)
    assert default_cluster([2048] * 64, 132, h64) == 2  # b64 h64 s_k2048: 54.8 -> 44.9 µs
    assert default_cluster([4096] * 32, 66, h128) == 2
    assert default_cluster([8192] * 32, 132, h64) == 1  # split over every SM is faster
    assert default_cluster([2048] * 96, 132, h64) == 1  # whole requests (2·b > parts)
    assert default_cluster([2048] * 64, 131, h64) == 1  # an odd part count
    assert default_cluster([2048] * 64, 114, h64, num_sms=114) == 1  # not measured there
    assert default_cluster([2048] * 64, 132, plan_config(1, 64, sparse=True, cluster=2)) == 2
    assert default_cluster([], 132, h64) == 1


# H100, graph-replay µs, one run each (profiles/merge.md, "Whole-request and cluster plans"):
# (batch, length, heads, sparse, parts, µs on the cluster plan of two, µs of the plan picked
# without clusters); the three marked rows are the timing-only ceiling of the halves (no merge)
MEASURED_CLUSTER = [
    (64, 2048, 64, False, 132, 44.9, 54.8), (64, 4096, 64, False, 132, 72.8, 89.0),
    (48, 4096, 64, False, 132, 62.1, 73.7), (32, 4096, 128, False, 66, 59.4, 69.6),
    (64, 2048, 64, True, 132, 49.9, 65.7), (64, 2048, 8, True, 132, 47.9, 53.6),
    (32, 8192, 64, False, 132, 98.9, 86.1), (24, 8192, 128, False, 66, 100.6, 90.5),  # ceilings
    (64, 8192, 64, False, 132, 125.7, 148.3),  # ceiling
]


@pytest.mark.parametrize("b, length, heads, sparse, parts, cluster_us, other_us", MEASURED_CLUSTER)
def test_cluster_rule_picks_the_faster_plan(b, length, heads, sparse, parts, cluster_us, other_us):
    from snapmla_cute.kernels.decode_scheduler import PLAN_CLUSTER
    from snapmla_cute.planning import plan_config, plan_of

    plan = plan_of([length] * b, parts, plan_config(1, heads, sparse=sparse, cluster=2))
    assert (plan == PLAN_CLUSTER) == (cluster_us < other_us), plan


def test_default_head_groups():
    """The head-group plan where it was measured faster: 64 or 128 heads as requests of 16
    on 64 CTAs (k a cluster), one query token, batches 1-4 (128 heads) or 1-8 (64), a stated
    ``max_seqlen`` up to 1024 with at most 5 KV blocks a CTA, devices whose cluster launches
    were measured."""
    from snapmla_cute.heads import default_head_groups, head_group_cluster, head_group_steps

    assert [default_head_groups(b, 1, 128, 640) for b in (1, 2, 3, 4, 5)] == [(8, 8), (8, 4), (8, 2), (8, 2), (1, 1)]
    assert [default_head_groups(b, 1, 64, 1024) for b in (1, 2, 3, 4)] == [(4, 8), (4, 8), (4, 4), (4, 4)]
    assert [default_head_groups(b, 1, 64, 640) for b in (5, 6, 7, 8, 9)] == [(4, 2)] * 4 + [(1, 1)]
    assert [default_head_groups(b, 1, 128, 640) for b in (6, 8)] == [(1, 1)] * 2  # 64 CTAs: k = 1
    assert default_head_groups(8, 1, 64, 1024) == (1, 1)  # 8 blocks a CTA: 19.3 against 17.9 µs
    assert default_head_groups(4, 1, 128, 1024) == (1, 1)  # 8 blocks a CTA: 18.9 against 16.8 µs
    assert default_head_groups(2, 1, 128, 1024) == (8, 4)
    assert default_head_groups(1, 1, 128, 1025) == (1, 1)
    assert default_head_groups(1, 1, 128, 0) == (8, 8)
    assert default_head_groups(1, 2, 128, 640) == (1, 1)  # s_q 2
    assert default_head_groups(1, 1, 32, 640) == (1, 1)
    assert default_head_groups(1, 1, 128, 640, num_sms=114) == (1, 1)
    assert head_group_steps() == [(8, 8), (8, 4), (8, 2), (4, 8), (4, 4), (4, 2)]  # CI compiles these
    assert head_group_steps(num_sms=114) == []
    assert [head_group_cluster(b, 8) for b in (1, 2, 3, 4, 8, 9)] == [8, 4, 2, 2, 1, 1]
    assert head_group_cluster(3, 4) == 4


@pytest.mark.parametrize("b, k", [(1, 8), (2, 4), (4, 2)])
def test_head_group_requests_take_the_cluster_plan(b, k):
    """The kernel's own rule, on the head-group plan's requests (16 heads, 64 parts), takes
    the cluster plan (a cluster a request) at the lengths the choice admits."""
    from snapmla_cute.kernels.decode_scheduler import PLAN_CLUSTER
    from snapmla_cute.heads import HEAD_GROUP_MAX_SEQLEN
    from snapmla_cute.planning import plan_config, plan_of

    for length in (64 * 6, 640, HEAD_GROUP_MAX_SEQLEN):
        assert plan_of([length] * (8 * b), 8 * b * k, plan_config(1, 16, cluster=k)) == PLAN_CLUSTER


def test_explicit_head_groups_checked():
    """``decode_metadata(head_groups=...)``: the int 1 or heads / 16 (2 at least) at s_q 1,
    and at most MAX_BATCH kernel requests; anything else a ValueError naming it."""
    from snapmla_cute.kernels.decode_scheduler import MAX_BATCH
    from snapmla_cute.heads import check_head_groups as _check_head_groups

    _check_head_groups(8, 1, 128, 4)
    _check_head_groups(4, 1, 64, 4)
    _check_head_groups(1, 3, 8, 4)
    for g, s_q, heads, b in ((0, 1, 128, 1), (8.0, 1, 128, 1), (True, 1, 128, 1), (4, 1, 128, 1), (8, 2, 128, 1),
                             (0, 1, 8, 1), (1.0, 1, 16, 1), (8, 1, 128, MAX_BATCH // 8 + 1)):
        with pytest.raises(ValueError, match="head_groups"):
            _check_head_groups(g, s_q, heads, b)
