"""The plan's rule on the host against the device's, swept over lengths, batches, heads,
s_q, sparse and clusters (CPU).

The host decides with ``planning`` (``plan_config``, ``plan_of``, ``schedule_reference``,
``default_cluster``) and ``heads`` (the head-group plan); the decode kernel re-plans every
call on the device with ``kernels.decode_scheduler``'s code and its own ``DecodeConfig``'s
constants. Here that device code runs as Python on the same lengths (``dsl_on_host``: each
@cute.jit helper's own body on ints), so a change to either side that makes them disagree
fails on the CPU."""

import random

import pytest

from dsl_on_host import as_int, on_host, python_loops
from snapmla_cute import heads as H
from snapmla_cute.kernels import decode_scheduler as ds
from snapmla_cute.kernels.decode import DecodeConfig
from snapmla_cute.planning import default_num_parts, plan_config, plan_of, schedule_reference


def device_plan(lens, parts, cfg):
    """The plan ``decode_scheduler``'s DSL code computes (what ``Planner.plan`` runs in every
    CTA): (rule's answer, rows of (begin req, begin blk, end req, end blk, split), split
    offsets)."""
    k = on_host(ds.DecodeSchedulerKernel(cfg))
    with python_loops(ds):
        ov = cfg.fixed_overhead_blocks
        units = [as_int(k.n_blocks(n)) + ov for n in lens]
        pre = [0]
        for u in units:
            pre.append(pre[-1] + u)
        total, batch = pre[-1], len(lens)
        width = as_int(k.width_of(total, parts))
        whole = None
        if cfg.split_units > 0:
            whole = 0
            if batch <= parts:
                whole = as_int(k.whole_requests(total, max(units), batch, parts, cfg.split_units, cfg.stream_parts,
                                                cfg.cluster))
        split_w = as_int(k.split_width(total, width, whole))
        offsets = [0]
        for r in range(batch):
            offsets.append(offsets[-1] + as_int(k.n_splits(pre, r, split_w)))
        rows = [[as_int(x) for x in k.part_plan(pre, batch, total, width, p, whole)] for p in range(parts)]
    return whole, rows, offsets


def kernel_scheduler(s_q, heads, sparse, cluster):
    """The constants the decode kernel plans with for a launch of this shape (the step's
    ``DecodeConfig``, as ``steps.dense_step`` / ``sparse_step`` build it)."""
    if sparse:
        return DecodeConfig(heads=heads, s_q=1, page_size=1, causal=False, sparse=True, cluster=cluster).scheduler
    return DecodeConfig(heads=heads, s_q=s_q, page_size=64, causal=s_q > 1, cluster=cluster).scheduler


def shapes():
    """(s_q, kernel heads, sparse, cluster, parts per query tile) of every launch kind: plain
    and clusters of two at every head count and s_q, sparse, and the head-group steps."""
    out = []
    for h in H.HEADS:
        for s_q in (1, 2, 5, H.MAX_S_Q):
            tiles = H.m_tiles(s_q * h)
            out += [(s_q, h, False, k, 132 // tiles // k * k) for k in (1, 2)]
    out += [(1, h, True, k, 132 // H.m_tiles(h) // k * k) for h in H.SPARSE_HEADS for k in (1, 2)]
    for g, k in H.head_group_steps():
        out += [(1, H.HEAD_GROUP_HEADS, False, k, b * g * k) for b in (1, 2, 4) if b * g * k <= H.HEAD_GROUP_PARTS]
    return out


@pytest.mark.parametrize("s_q, heads, sparse, cluster, max_parts", shapes())
def test_host_and_device_plan_the_same(s_q, heads, sparse, cluster, max_parts):
    host = plan_config(s_q, heads, sparse=sparse, cluster=cluster)
    assert host == kernel_scheduler(s_q, heads, sparse, cluster)  # one set of constants
    rng = random.Random(hash((s_q, heads, sparse, cluster)) & 0xFFFF)
    for _ in range(5):
        batch = rng.choice([1, 2, 3, 8, 17, 40])
        lens = [rng.choice([0, 1, 63, 64, 65, 640, rng.randint(0, 40000)]) for _ in range(batch)]
        for parts in {max_parts, default_num_parts(batch, 1, max_parts), max(cluster, max_parts // 2 // cluster * cluster)}:
            whole, rows, offsets = device_plan(lens, parts, host)
            assert whole == plan_of(lens, parts, host), (lens, parts)
            sched, ref_offsets = schedule_reference(lens, parts, host)
            assert offsets == ref_offsets, (lens, parts)
            assert rows == [r[:5] for r in sched], (lens, parts)


def test_head_group_rule_keeps_within_one_wave():
    """Every (batch, heads, length) the host's head-group rule takes fits one cooperative
    wave of clusters on the measured device: b·g·k CTAs at most ``HEAD_GROUP_PARTS``, each
    a kernel request of 16 heads (one query tile), at most ``HEAD_GROUP_MAX_BLOCKS`` blocks a
    CTA."""
    for h in H.HEADS:
        for b in range(1, 12):
            for length in (1, 64, 320, 640, 1024, 1025, 8192):
                g, k = H.default_head_groups(b, 1, h, length)
                if (g, k) == (1, 1):
                    continue
                assert g == h // H.HEAD_GROUP_HEADS and H.m_tiles(H.HEAD_GROUP_HEADS) == 1
                assert b * g * k <= H.HEAD_GROUP_PARTS and k in (2, 4, 8)
                assert -(-(-(-length // 64)) // k) <= H.HEAD_GROUP_MAX_BLOCKS
                assert (g, k) in H.head_group_steps()  # compiled ahead (warmup, CI)
