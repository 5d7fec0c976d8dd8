"""The split-KV plan of a decode, host side: the plan's buffers (``DecodeMetadata``, made by
``decode_metadata``), what is chosen before a launch (parts per query tile, parts per
cluster, the scheduler's constants of a shape: ``plan_config``). The supported head
counts and the head-group plan's rule are ``heads``'.

The plan itself is computed on the device (``kernels.decode_scheduler``, and inside the
decode kernel at every call), so a captured CUDA graph replays with new lengths. The same
plan in plain Python (``schedule_reference``, ``plan_of``) is what tests hold the kernels
to and what ``default_cluster`` reads.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_plan_buffers as _check_plan_buffers
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.format import CONTENT_DIM, ROPE_DIM
from snapmla_cute.kernels import decode_scheduler as _scheduler
from snapmla_cute.kernels.decode_scheduler import (
    CLUSTER_FIXED_UNITS,
    MAX_BATCH,
    MAX_SEQLEN,
    PLAN_CLUSTER,
    PLAN_SPLIT,
    PLAN_WHOLE,
    SPLIT_FIXED_UNITS,
    SchedulerConfig,
)
from snapmla_cute.heads import (
    CLUSTER_SM_COUNTS,
    HEAD_GROUP_PARTS,
    HEADS,
    MAX_S_Q,
    check_head_groups,
    default_head_groups,
    head_group_cluster,
    m_tiles as query_tiles,
)
from snapmla_cute.tuning import DECODE_TUNING, launcher



class DecodeMetadata:
    """Device-side split-KV work plan plus the partial-result buffers it indexes.

    Made once per (batch, s_q, heads) shape by :func:`decode_metadata`; every
    :func:`mla_decode` call that gets it re-plans into these same buffers from the current
    ``cache_seqlens`` (inside the decode kernel: no allocation, no host sync), so it is safe
    to capture in a CUDA graph and replay with new lengths.
    """

    def __init__(self, batch: int, s_q: int, heads: int, num_parts: int, device, head_groups: int = 1):
        # the kernel's requests: with head groups g, each request's heads as g requests of
        # heads / g (``DecodeStepConfig.head_groups``); the plan's buffers are theirs
        n, rows = batch * head_groups, s_q * heads // head_groups
        self.batch, self.s_q, self.heads, self.num_parts = batch, s_q, heads, num_parts
        self.head_groups = head_groups
        self.max_seqlen = None  # the longest length its calls will see, where stated (``decode_metadata``)
        self.cluster = 1  # parts per cluster of the launch (``decode_metadata`` may choose 2, or 2-8 with head groups)
        self.sched = torch.zeros(num_parts, 8, dtype=torch.int32, device=device)
        self.split_offsets = torch.zeros(n + 1, dtype=torch.int32, device=device)
        max_splits = n + num_parts  # each part boundary adds at most one split
        self.o_partial = torch.empty(max_splits, rows, CONTENT_DIM, dtype=torch.float32, device=device)
        self.lse_partial = torch.empty(max_splits, rows, dtype=torch.float32, device=device)
        # per (request, m-tile): splits counted, mergers done; the last merger zeroes both
        self.counters = torch.zeros(n, 2 * query_tiles(rows), dtype=torch.int32, device=device)
        # the quantized query of a bf16 q, so a captured decode allocates nothing
        self.q_nope = torch.empty(batch, s_q, heads, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=device)
        self.q_rope = torch.empty(batch, s_q, heads, ROPE_DIM, dtype=torch.bfloat16, device=device)
        self.q_scale = torch.empty(batch, s_q, heads, dtype=torch.float32, device=device)
        self._set_step_args()

    def _set_step_args(self):
        # what the decode step takes, prebuilt; split_offsets goes as its first `batch`
        # entries so TVM-FFI ties the plan to the call's batch size (the step reads all b + 1);
        # with head groups, per call request: [b, g] and [b, g, 2·m_tiles]
        g = self.head_groups
        offsets, counters = self.split_offsets[: self.batch * g], self.counters
        if g > 1:
            offsets, counters = offsets.view(self.batch, g), counters.view(self.batch, g, -1)
        self.step_args = (self.sched, offsets, self.o_partial, self.lse_partial, counters)
        self.q_args = None if self.q_nope is None else (self.q_nope, self.q_rope, self.q_scale)

    @classmethod
    def from_buffers(cls, sched, split_offsets, o_partial, lse_partial, counters, *, s_q: int, heads: int) -> "DecodeMetadata":
        """Wraps buffers made by an earlier ``decode_metadata`` (the custom-op path); checks
        their shapes against each other (the kernel writes by them)."""
        rows = s_q * heads
        batch = split_offsets.shape[0] - 1 if isinstance(split_offsets, torch.Tensor) and split_offsets.dim() == 1 else -1
        _check_plan_buffers(sched, split_offsets, o_partial, lse_partial, counters, lists=batch, rows=rows,
                            counters_shape=(batch, 2 * query_tiles(rows)), max_lists=MAX_BATCH,
                            max_parts=merge_max_splits())
        md = cls.__new__(cls)
        md.batch, md.s_q, md.heads, md.num_parts = batch, s_q, heads, sched.shape[0]
        md.cluster, md.head_groups, md.max_seqlen = 1, 1, None  # the custom op's metadata: plain launches
        md.sched, md.split_offsets, md.o_partial, md.lse_partial = sched, split_offsets, o_partial, lse_partial
        md.counters = counters
        md.q_nope = md.q_rope = md.q_scale = None
        md._set_step_args()
        return md

    def update(self, cache_seqlens: torch.Tensor) -> None:
        """Plans into ``sched`` / ``split_offsets`` as the decode kernel will (which re-plans
        at every call and writes back the plan it ran; the cluster plan is the kernel's only)."""
        g = self.head_groups
        c = plan_config(self.s_q, self.heads // g)
        lens = cache_seqlens.repeat_interleave(g) if g > 1 else cache_seqlens  # the kernel's requests
        launcher(_scheduler.compile)(lens, self.sched, self.split_offsets, c.split_units, c.stream_parts)


_MERGE_MAX_SPLITS = []


def merge_max_splits() -> int:
    """Splits one request may have (the in-kernel merge's room); imported on first use."""
    if not _MERGE_MAX_SPLITS:
        from snapmla_cute.kernels.decode.config import MERGE_MAX_SPLITS

        _MERGE_MAX_SPLITS.append(MERGE_MAX_SPLITS)
    return _MERGE_MAX_SPLITS[0]


def device_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_config(s_q: int, heads: int, *, sparse: bool = False, cluster: int = 1) -> SchedulerConfig:
    """The split-KV plan's constants of a decode shape (``DecodeConfig.scheduler`` under
    ``DECODE_TUNING``; ``cluster``: the launch's parts per cluster, ``metadata.cluster``):
    ``schedule_reference(lengths, parts, plan_config(...))`` is the plan the
    decode kernel runs."""
    from snapmla_cute.kernels.decode.config import DecodeConfig

    tuning = {"cluster": DECODE_TUNING.get("cluster", cluster)}
    return DecodeConfig(heads=heads, s_q=1 if sparse else s_q, page_size=1 if sparse else 64, causal=False,
                        sparse=sparse, **tuning).scheduler


def default_num_parts(batch: int, m_tiles: int, num_sms: int) -> int:
    """CTAs per query tile. Up to one wave (SMs / query tiles); with at least 90% of that
    many requests, the smallest count that keeps the same requests per part (b128 on 66
    slots → 64 parts of 2 requests; b128 on 132 → 128 parts of 1) if it leaves at most 10%
    of the slots idle: equal-length batches then run unsplit, with no split partials written
    and no combine work (sparse b128 h16 topk2048 on the H100: 81.9 µs on 128 parts, 94.7
    on 132). Fewer requests split over every slot (b64 on 128 parts, two even splits
    each, is no faster than on 132)."""
    slots = max(1, num_sms // m_tiles)
    if batch < slots:
        return batch if 10 * batch >= 9 * slots else slots
    per_part = -(-batch // slots)
    even = -(-batch // per_part)
    return even if 10 * even >= 9 * slots else slots  # idle SMs cost more than splits past 10%


def decode_metadata(
    cache_seqlens: torch.Tensor, *, s_q: int, heads: int, num_parts: int | None = None, cluster: int | None = None,
    head_groups: int | None = None, max_seqlen: int | None = None,
) -> DecodeMetadata:
    """Allocates the split-KV plan for a decode shape and fills it from ``cache_seqlens``.

    ``num_parts`` (default: :func:`default_num_parts`, at most SMs / query tiles: the decode
    launch is cooperative) is how many CTAs share the KV work of one query tile; requests
    cut by a part boundary are split, and their splits merged inside the decode kernel.
    ``cluster`` (1 or 2; default: :func:`default_cluster` from these lengths, which reads
    them to the host once, or 1 under graph capture) launches the decode in clusters of that
    many parts, so the kernel may merge a request's halves on-chip.

    ``max_seqlen``: the longest length any call with this metadata will see (a captured
    graph's replays included), or None (any). Where it is short and the batch small,
    :func:`default_head_groups` takes the head-group plan: each request's heads as groups of
    16, a cluster of CTAs each, merged on-chip (b1 h128 s_k640 on the H100: 14.7 -> 12.9
    µs). Calls past ``max_seqlen`` stay correct but slow down several-fold (every KV block is
    read by heads / 16 CTAs). ``head_groups`` (1 or heads / 16, at s_q 1) sets the plan
    instead, with ``cluster`` 1, 2, 4 or 8 (default ``head_group_cluster``: up to 64 CTAs in
    all) and ``num_parts`` (default b·g·k, one cluster a group).
    """
    _check_tensor("cache_seqlens", cache_seqlens, torch.int32, dim=1)
    if isinstance(s_q, bool) or not isinstance(s_q, int) or not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"s_q: expected an int in [1, {MAX_S_Q}], got {s_q!r}")
    if heads not in HEADS:
        raise ValueError(f"heads: expected one of {HEADS}, got {heads!r}")
    if not 1 <= cache_seqlens.shape[0] <= MAX_BATCH:
        raise ValueError(
            f"cache_seqlens: expected a batch of 1..{MAX_BATCH} requests, got {cache_seqlens.shape[0]}"
        )
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or not 0 <= max_seqlen <= MAX_SEQLEN):
        raise ValueError(f"max_seqlen: expected None or an int in [0, {MAX_SEQLEN}], got {max_seqlen!r}")
    _check_cuda(cache_seqlens=cache_seqlens)
    batch = cache_seqlens.shape[0]
    sms = device_sms(cache_seqlens.device)
    if head_groups is None:
        head_groups, k = 1, None
        if num_parts is None and cluster is None and max_seqlen is not None:
            head_groups, k = default_head_groups(batch, s_q, heads, max_seqlen, sms, "cluster" in DECODE_TUNING)
        cluster = cluster if head_groups == 1 else k
    else:
        check_head_groups(head_groups, s_q, heads, batch)
        if head_groups > 1 and cluster is None:
            cluster = head_group_cluster(batch, head_groups)
    rows = s_q * heads // head_groups
    m_tiles = query_tiles(rows)
    # one wave (the launch is cooperative), and no more splits per request than the
    # in-kernel merge has room for
    slots = max(1, min(sms // m_tiles, merge_max_splits()))
    if head_groups > 1 and num_parts is None:
        num_parts = batch * head_groups * cluster  # one cluster a kernel request
        if num_parts > slots:
            raise ValueError(f"head_groups: {batch} requests x {head_groups} groups x clusters of {cluster} need "
                             f"{num_parts} CTAs, more than one wave ({slots}); pass fewer requests or head_groups=1")
    if num_parts is None:
        num_parts = default_num_parts(batch, m_tiles, slots * m_tiles)
    elif isinstance(num_parts, bool) or not isinstance(num_parts, int) or not 1 <= num_parts <= slots:
        # the decode launch is cooperative (split requests merge in-kernel): one wave at most
        raise ValueError(f"num_parts: expected an int in [1, {slots}] (SMs / query tiles), got {num_parts!r}")
    sizes = (1, 2) if head_groups == 1 else (1, 2, 4, 8)
    if cluster is not None and (cluster not in sizes or num_parts % cluster):
        raise ValueError(f"cluster: expected one of {sizes} (dividing num_parts {num_parts}), got {cluster!r}")
    if head_groups > 1 and cluster >= 4 and num_parts > HEAD_GROUP_PARTS:
        # the cooperative launch refused 128 CTAs in clusters of 4 and of 8 (H100)
        raise ValueError(f"num_parts: at most {HEAD_GROUP_PARTS} in clusters of {cluster}, got {num_parts}")
    md = DecodeMetadata(batch, s_q, heads, num_parts, cache_seqlens.device, head_groups)
    md.max_seqlen = max_seqlen
    if cluster is not None:
        md.cluster = cluster
    elif not torch.cuda.is_current_stream_capturing():  # reads the lengths (one sync); captured: plain launches
        md.cluster = default_cluster(cache_seqlens.tolist(), num_parts, plan_config(s_q, heads, cluster=2), sms)
    md.update(cache_seqlens)
    return md




def default_cluster(lengths, num_parts: int, cfg, num_sms: int = 132) -> int:
    """Parts per cluster for a decode launch: 2 where the plan's rule, at these lengths (a
    graph replays the launch with others; the kernel re-plans each call and may then take
    the split or whole-request plan in the same clusters), takes the cluster plan: each
    request's halves on the two CTAs of a cluster, merged through distributed shared memory.
    Clusters of 4 and 8 are correct but gained at most 3% on the H100 and do not all fit one
    wave at 128 parts (``profiles/merge.md``, "Whole-request and cluster plans")."""
    if num_parts % 2 or "cluster" in DECODE_TUNING or num_sms not in CLUSTER_SM_COUNTS:
        return 1
    return 2 if plan_of(lengths, num_parts, cfg) == PLAN_CLUSTER else 1


def check_cluster_parts(metadata) -> None:
    """A clustered launch needs a part count the cluster divides (``DECODE_TUNING`` may set
    clusters of 4 or 8; the metadata's own choice always fits)."""
    k = DECODE_TUNING.get("cluster", metadata.cluster)
    if metadata.num_parts % k:
        raise ValueError(f"metadata: {metadata.num_parts} parts do not divide into clusters of {k}")


# --------------------------------------------------------------------------------------------
# The scheduler's plan on the host (``kernels.decode_scheduler`` computes it on the device)
# --------------------------------------------------------------------------------------------


def clamp_len_host(seqlen) -> int:
    """``decode_scheduler.clamp_len`` on the host (a DSL function does not run on Python ints)."""
    return min(max(int(seqlen), 0), MAX_SEQLEN)


def whole_requests_host(total: int, c_max: int, batch: int, num_parts: int, split_units: int, stream_parts: int,
                        cluster: int = 1, ov: int = 5) -> int:
    """``decode_scheduler.DecodeSchedulerKernel.whole_requests`` on the host: ``PLAN_SPLIT``,
    ``PLAN_WHOLE`` or ``PLAN_CLUSTER``."""
    if split_units <= 0 or batch > num_parts:
        return PLAN_SPLIT
    s = min(num_parts, stream_parts) if stream_parts > 0 else num_parts
    w = max(-(-total // num_parts), 1)
    n_s = batch + -(-total // w) - 1
    t_split = max(w, -(-(total + n_s * split_units) // s)) + SPLIT_FIXED_UNITS
    t_whole = max(c_max, -(-total // s))
    res, best = (PLAN_WHOLE, t_whole) if t_whole <= t_split else (PLAN_SPLIT, t_split)
    if cluster > 1 and batch * cluster <= num_parts:
        t_cl = max(-(-(c_max - ov) // cluster) + ov, -(-total // s))
        if t_cl + CLUSTER_FIXED_UNITS <= best:
            res = PLAN_CLUSTER
    return res


def plan_of(cache_seqlens, num_parts: int, cfg: SchedulerConfig = SchedulerConfig()) -> int:
    """The plan the rule takes for these lengths (``PLAN_SPLIT``, ``PLAN_WHOLE`` or
    ``PLAN_CLUSTER``), as the kernel computes it: clamped lengths, blocks plus overhead."""
    ov = cfg.fixed_overhead_blocks
    units = [(clamp_len_host(x) + cfg.block_n - 1) // cfg.block_n + ov for x in cache_seqlens]
    return whole_requests_host(sum(units), max(units, default=0), len(units), num_parts, cfg.split_units,
                               cfg.stream_parts, cfg.cluster, ov)


def schedule_reference(cache_seqlens, num_parts: int, cfg: SchedulerConfig = SchedulerConfig()):
    """The same plan in plain Python: ``(sched rows, split_offsets)``, for tests and planning."""
    lens = [clamp_len_host(x) for x in cache_seqlens]
    ov = cfg.fixed_overhead_blocks
    n_blocks = [(L + cfg.block_n - 1) // cfg.block_n for L in lens]
    pre = [0]
    for n in n_blocks:
        pre.append(pre[-1] + n + ov)
    total = pre[-1]
    width = max((total + num_parts - 1) // num_parts, 1)
    plan = plan_of(lens, num_parts, cfg)
    if plan != PLAN_SPLIT:
        k = cfg.cluster if plan == PLAN_CLUSTER else 1
        rows = [[r, q * n_blocks[r] // k, r, (q + 1) * n_blocks[r] // k, 0, 0, 0, 0]
                for r in range(len(lens)) for q in range(k)]
        rows += [[len(lens), 0, 0, 0, 0, 0, 0, 0]] * (num_parts - len(rows))
        return rows[:num_parts], list(range(len(lens) + 1))
    offsets = [0]
    for r, n in enumerate(n_blocks):
        first = pre[r] + ov
        offsets.append(offsets[-1] + ((pre[r + 1] - 1) // width - first // width + 1 if n else 1))
    sched = []
    for p in range(num_parts):
        u0, u1 = p * width, min(p * width + width, total)
        if u0 >= total:
            sched.append([len(lens), 0, 0, 0, 0, 0, 0, 0])
            continue
        b = max(r for r in range(len(lens)) if pre[r] <= u0)
        first = pre[b] + ov
        split = p - first // width if (n_blocks[b] and u0 > first) else 0
        keys = [pre[r] + ov - (1 if n_blocks[r] == 0 else 0) for r in range(len(lens))]
        e = max((r for r in range(len(lens)) if keys[r] < u1), default=-1)
        e_blk = min(n_blocks[e], u1 - pre[e] - ov) if e >= 0 else 0
        sched.append([b, max(u0 - first, 0), e, e_blk, split, 0, 0, 0])
    return sched, offsets
