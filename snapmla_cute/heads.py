"""Head counts: which ones run, and how a request's heads map onto query tiles, CTAs and
clusters. One place for the rules the host's plan (``planning``), the sparse decode
(``sparse``), the kernel's config (``kernels.decode.config``) and the compile report
(``compile_report``) share. Pure Python (the kernels import it too).

* The supported shapes: ``HEADS`` and ``MAX_S_Q`` (dense), ``SPARSE_HEADS`` and
  ``SPARSE_MAX_S_Q``.
* A request's s_q·h rows in 64-row query tiles (``m_tiles``), a CTA each per part.
* The cluster merge's row ownership (``cluster_rows_per_rank``).
* The head-group plan of small batches: a request's heads in groups of 16, each group a
  kernel request on a cluster of k CTAs (``default_head_groups``, ``head_group_cluster``,
  ``head_group_steps``, ``check_head_groups``).
"""

from __future__ import annotations

from snapmla_cute.kernels.decode_scheduler import MAX_BATCH, MAX_SEQLEN

HEADS = (8, 16, 32, 64, 128)  # 8: 128 heads at TP16, 64 at TP8
MAX_S_Q = 8  # speculative decoding windows up to 7 draft tokens
SPARSE_HEADS = HEADS
SPARSE_MAX_S_Q = 8
TILE_ROWS = 64  # rows of a query tile: WGMMA's M (``layouts.smem.M_TILE``)


def m_tiles(rows: int) -> int:
    """Query tiles of a request's ``rows`` (s_q·h) rows."""
    return (rows + TILE_ROWS - 1) // TILE_ROWS


def cluster_rows_per_rank(rows: int, k: int) -> int:
    """Rows of a tile each rank of a cluster of ``k`` owns in the cluster merge: the live
    rows (``rows``, fewer than the tile's 64 at 8-32 heads) spread over the k ranks where
    they split into 1, 2 or 4 rows a rank (within one 8-row slab) or whole slabs; else 64/k,
    and the ranks past the live rows own dead ones (one rank merged all 16 rows of h16 at
    k = 8 or 2)."""
    live = min(rows, TILE_ROWS)
    if live % k == 0 and (live // k in (1, 2, 4) or live // k % 8 == 0):
        return live // k
    return TILE_ROWS // k


# the head-group plan (``DecodeStepConfig.head_groups``): a request's heads in groups of
# HEAD_GROUP_HEADS, each group a kernel request on a cluster of k CTAs whose portions merge
# on-chip, HEAD_GROUP_PARTS CTAs at most. ``default_head_groups`` takes it where it was
# measured faster than the plain plans (H100, graph replay, ``profiles/small_batches.md``,
# "Small batches: the head-group plan"): batches 1-4 at 64 and 128 heads and 5-8 at 64 heads (at 128
# the 64 CTAs leave k = 1 past batch 4), up to 1024 tokens, a CTA's share at most 5 KV blocks
# (b4 h128 s_k1024 at 8 blocks a CTA: 18.9 against 16.8 µs; b8 h64 s_k640 at 5: 14.8
# against 17.1).
HEAD_GROUP_HEADS = 16
HEAD_GROUP_PARTS = 64
HEAD_GROUP_MIN_HEADS = 64
HEAD_GROUP_MAX_BATCH = 8
HEAD_GROUP_MAX_SEQLEN = 1024
HEAD_GROUP_MAX_BLOCKS = 5


def default_head_groups(batch: int, s_q: int, heads: int, max_seqlen: int, num_sms: int = 132,
                        cluster_tuned: bool = False) -> tuple[int, int]:
    """``(head groups, parts per cluster)`` for a decode whose lengths never pass
    ``max_seqlen``: ``(heads / 16, k)``, k = ``head_group_cluster(b, g)``, for one query token, at
    least ``HEAD_GROUP_MIN_HEADS`` heads, batches up to ``HEAD_GROUP_MAX_BATCH``,
    ``max_seqlen`` up to ``HEAD_GROUP_MAX_SEQLEN`` and at most ``HEAD_GROUP_MAX_BLOCKS`` KV
    blocks a CTA, on a device whose cluster launches were measured (``CLUSTER_SM_COUNTS``);
    else ``(1, 1)``."""
    g = heads // HEAD_GROUP_HEADS
    if (s_q != 1 or heads < HEAD_GROUP_MIN_HEADS or not 1 <= batch <= HEAD_GROUP_MAX_BATCH
            or num_sms not in CLUSTER_SM_COUNTS or cluster_tuned or max_seqlen > HEAD_GROUP_MAX_SEQLEN):
        return 1, 1
    k = head_group_cluster(batch, g)
    blocks = -(-min(max(int(max_seqlen), 0), MAX_SEQLEN) // 64)
    if k < 2 or -(-blocks // k) > HEAD_GROUP_MAX_BLOCKS:
        return 1, 1
    return g, k


def head_group_steps(num_sms: int = 132) -> list[tuple[int, int]]:
    """Every ``(head groups, parts per cluster)`` that ``default_head_groups`` picks on a
    ``num_sms`` device (the steps to compile ahead), 128 heads first, by batch. At one token
    a CTA takes one block, so only the heads and the batch decide."""
    picks = [default_head_groups(b, 1, h, 1, num_sms) for h in sorted(HEADS, reverse=True)
             for b in range(1, HEAD_GROUP_MAX_BATCH + 1)]
    return list(dict.fromkeys(p for p in picks if p != (1, 1)))


def head_group_cluster(batch: int, head_groups: int) -> int:
    """Parts per cluster of the head-group plan: the largest of 2, 4, 8 that keeps b·g·k
    within ``HEAD_GROUP_PARTS``, else 1 (b·g·k then b·g)."""
    x = max(1, min(8, HEAD_GROUP_PARTS // (batch * head_groups)))
    return 1 << (x.bit_length() - 1)


def check_head_groups(head_groups, s_q: int, heads: int, batch: int) -> None:
    """``decode_metadata``'s explicit ``head_groups``: the int 1, or heads / 16 (at least 2) at
    s_q 1 with at most ``MAX_BATCH`` kernel requests (the plans' prefix sums have that room)."""
    g = heads // HEAD_GROUP_HEADS
    allowed = (1, g) if g >= 2 else (1,)
    if (isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups not in allowed
            or (head_groups > 1 and s_q != 1)):
        raise ValueError(f"head_groups: expected one of {allowed} (heads / {HEAD_GROUP_HEADS}, at s_q 1) for heads "
                         f"{heads} and s_q {s_q}, got {head_groups!r}")
    if batch * head_groups > MAX_BATCH:
        raise ValueError(f"head_groups: {batch} requests x {head_groups} groups exceed {MAX_BATCH} kernel requests")



# devices whose one wave of 2-CTA clusters was measured to fit every part (the launch is
# cooperative: a cluster that does not fit fails it). The H100 SXM and the H200 (132 SMs) take
# 66 clusters of two but not 32 of four at 128 parts (28 do); the head-group plan's 64 CTAs
# in clusters of 4 or 8 fit on the H100 (not yet tried on the H200).
CLUSTER_SM_COUNTS = (132,)
