"""The decode kernel's compile key (``DecodeConfig``) and its fixed constants.

A config's fields are the whole compile key (``jit_cache``); tensor values never are. They
come in three groups: the shape and mode of a call, what the library sets per launch
(clusters, the KV ring's depth, the L2 hint), and profiling switches that the library never
sets. The schedule choices measured once and fixed are constants here (``PV_TEMPS``,
``MERGE_FEW``; ``profiles/NOTES.md``, "Schedule switches and fixed behaviour").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass

from snapmla_cute import heads
from snapmla_cute.format import CONTENT_DIM, FP8_MAX
from snapmla_cute.kernels.decode_scheduler import SchedulerConfig
from snapmla_cute.layouts import smem as L
from snapmla_cute.pipelines import roles

FP8 = cutlass.Float8E4M3FN
LN2 = math.log(2.0)
OOB_PAGE = 1 << 30  # TMA zero-fills coordinates past the cache
SM90_SMEM_BYTES = 232448  # dynamic shared memory a CTA may use (227 KB)
# Each consumer WG runs its 256 output dims as PV_SPLITS GEMMs of N = 64, each into a zeroed
# temporary that is then added to O in fp32 (o = γ·o + P·V): FP8 WGMMA accumulates with a
# narrower adder than fp32, and adding every block into one long-lived accumulator loses
# about 2^-13 of |O| per block. N = 64 also gives S and the temporaries one WGMMA shape; with
# N = 128 ptxas serialized every warpgroup MMA (C7511) in some variants.
PV_SPLITS = 4
PV_N = CONTENT_DIM // roles.NUM_CONSUMER_WGS // PV_SPLITS
# PV temporaries per consumer: with two, a GEMM is issued before the previous one is added
PV_TEMPS = 2
# A request of at most MERGE_FEW splits (a divisor of MERGE_BATCH) writes f16 partials with a
# per-row scale and merges with a thread per row and all its splits' loads issued together
# (``Merger.few_split_lse``); more splits write fp32 and take the general merge
MERGE_FEW = 8
# the part's plan in shared memory (``plan.PartWork``): begin req, begin blk, end req, end
# blk, begin split, (first split row, splits) of the begin and of the end request, then the
# merge helper's assignment (helpers, request, first split row, merger index, splits, mergers)
PLAN_WORDS = 16
# A split waits at most this long (ns, %globaltimer) for the other splits' partials, then
# traps (the launch fails with an error): a correct wait lasts at most one part's work.
MERGE_WAIT_LIMIT_NS = 4_000_000_000
# The merge's scratch in the (idle) KV stages: final LSEs at 0, the group sums at 1024, the
# splits' weights at MERGE_W_OFFSET, (64 rows, MERGE_MAX_SPLITS) floats. A request has at
# most num_parts <= SMs splits.
MERGE_W_OFFSET = 16384
MERGE_MAX_SPLITS = 160
MERGE_BATCH = 16  # partial rows a merging thread loads at once
# TMA's L2 cache hint EVICT_FIRST (CUTLASS's TMA::CacheHintSm90)
L2_EVICT_FIRST = 0x12F0000000000000
# P' below this is treated as 0 (the block's σ_p is kept): against the running max such a
# block is negligible, and 448/P'max would otherwise overflow (scores > ~100 log2 units
# below the max made NaN).
P_TINY = 2.0**-64
# σ_p = rowmax(P')·fp32(1/448) (a multiply, not a second IEEE division per row; the
# emulation uses the same constant)
INV_FP8_MAX = 1.0 / FP8_MAX
# the epilogue's shared buffer per consumer warp: 8 rows of 128 bytes (``Epilogue.store_tile``)
EPI_ROWS = 8
EPI_ROW_BYTES = 128
EPI_BYTES = EPI_ROWS * EPI_ROW_BYTES
EPI_BUFFER_BYTES = roles.NUM_CONSUMER_WGS * 4 * EPI_BYTES  # one per consumer warp (``storage.epi``)
# the whole-request plan's constants (``DecodeConfig.scheduler``), fitted on the H100: a
# 64-row split's partial traffic in KV blocks, and the CTAs that stream at full rate
SPLIT_UNITS_PER_TILE = 6
STREAM_PARTS = 105
CLUSTER_SIZES = (1, 2, 4, 8)
# KV stages of the accurate mode (``DecodeConfig.q_split``): Q's second content tile takes
# one stage's shared memory (four do not fit the 227 KB)
Q_SPLIT_KV_STAGES = 3
# the largest cluster whose merge buffer (``DecodeConfig.cluster_recv_bytes``) fits those
# three stages (98304 B; eight ranks need 116480 B)
Q_SPLIT_MAX_CLUSTER = 4


@dataclass(frozen=True)
class DecodeConfig:
    # ---- shape and mode
    heads: int
    s_q: int
    page_size: int
    causal: bool
    # the sparse decode (``mla_decode_sparse``): a request is one query token with its own
    # list of slot ids (its "block table", ``page_size`` 1), gathered by cp.async; listed
    # ids outside the cache, -1 and positions past the list's length are masked keys
    # (zero-filled, score -inf). ``heads`` rows per request, ``s_q`` 1, not causal.
    sparse: bool = False
    # causal by per-(request, query token) visible-key counts read from a tensor instead of
    # ``seqlen - s_q + 1 + t``: a context-parallel shard, whose keys' global positions are
    # not their indices (``snapmla_cute.distributed``). Each count is clamped to
    # [seqlen - s_q + 1 + t, seqlen], the window the causal mask code assumes. Needs causal.
    visible: bool = False
    # the accurate mode (``q_precision="e4m3x2"``): Q's content as two e4m3 terms on one
    # scale, hi + lo (``quantize_q``'s ``q_lo``); a second Q tile in shared memory (32 KB:
    # at most 3 KV stages fit) and a second QK content chain on the same accumulator
    q_split: bool = False
    # ---- what the library sets
    # CTAs per cluster along the parts (1, 2, 4 or 8; the part count a multiple of it): where
    # the plan gives cluster c request c (``decode_scheduler``'s rule), its CTAs take a
    # k-th of its blocks each and merge through distributed shared memory (``cluster_epilogue``)
    cluster: int = 1
    # KV ring depth: 4, or ``Q_SPLIT_KV_STAGES`` beside the accurate mode's second Q tile
    kv_stages: int = 4
    # the KV loads (TMA, or the sparse gather's cp.async) hint L2 to evict their lines
    # first where at most two CTAs read each block (``l2_evict_first``): the stream, read
    # once, then does not push the split partials, queries and block table out of L2; off
    # for the sparse step past one query token (``step``)
    kv_evict_first: bool = True
    # ---- profiling (wrong results or extra writes; never set by the library)
    # stages left out to time the rest, e.g. ("transpose",): "qk", "pv", "transpose",
    # "softmax", "store" (timing variants that leave one stage out; "softmax" leaves a finite
    # stand-in state, so the merge still reads every split's partial); "launch": the grid
    # returns at entry (the launch's own cost)
    skip: tuple = ()
    # %globaltimer stamps of each CTA's milestones at the end of the fp32 partials
    # (``trace.trace_words``, ``trace.TRACE_EVENTS``; read back by ``profiles/experiments/trace_small.py``)
    trace: bool = False

    @property
    def pv_n(self) -> int:
        """N of one PV GEMM: a consumer WG's 256 output dims over ``PV_SPLITS``."""
        return PV_N

    @property
    def rows(self) -> int:
        return self.heads * self.s_q

    @property
    def m_tiles(self) -> int:
        return heads.m_tiles(self.rows)

    @property
    def l2_evict_first(self) -> bool:
        """The KV loads carry L2's evict-first hint: ``kv_evict_first`` where a block is read
        by at most two query tiles' CTAs (H100, same build off / on: dense b32 h64 s_k8192
        -8%; two tiles, h128 s_q1, within ±3% with no consistent sign; four tiles, b128 h128
        s_q2, +1%). The head-group plan's steps (16 heads, one tile) keep it although g CTAs
        read each block: their timings were taken so; off there is not measured yet."""
        return self.kv_evict_first and self.m_tiles <= 2

    @property
    def scheduler(self) -> SchedulerConfig:
        """The plan's constants for this shape: one split's partial (``rows`` of one query
        tile, 2 KB each as fp32, written and read back; fitted before few-split partials
        became f16, 1 KB) is about 6 KV blocks per 64 rows; the
        dense decode of the H100 streams at full rate on up to STREAM_PARTS CTAs, the sparse
        gather (slower per CTA) on all of them."""
        rows = min(self.rows, L.M_TILE)
        return SchedulerConfig(split_units=-(-SPLIT_UNITS_PER_TILE * rows // L.M_TILE),
                               stream_parts=0 if self.sparse else STREAM_PARTS, cluster=self.cluster)

    @property
    def cluster_rows_per_rank(self) -> int:
        """Rows of a tile each rank of the cluster merge owns (``heads.cluster_rows_per_rank``)."""
        return heads.cluster_rows_per_rank(self.rows, self.cluster)

    @property
    def cluster_merge_spread(self) -> bool:
        """The cluster merge by every consumer thread (``Epilogue.spread_merge``): in clusters
        of 4 or 8 whose ranks own only live rows, fewer than a tile (``cluster_rows_per_rank``
        spreads them: 8-32 heads, the head-group plan's 16), where a rank's rows are held by
        a few threads (16 of 256 at 16 heads and k = 8). Each rank's own rows then go
        through shared memory too. Elsewhere the holders merge in their registers: whole
        tiles, and clusters of two, where that was faster (H100, b1 h128 s_k640 as 16-head
        groups in clusters of two: 14.3-14.4 µs against 14.9-15.1 merged by every thread)."""
        return self.cluster >= 4 and self.cluster_rows_per_rank * self.cluster < L.M_TILE

    @property
    def issue_qk_early(self) -> bool:
        """QK of block j+2 issued right after PV(j) instead of when j+2 starts, except with
        ``cluster_merge_spread``: there QK is issued when its block starts. With both, ptxas spilled an accumulator register in the consumers'
        last blocks (``finish_blocks``); those launches give a CTA at most a few blocks, and
        the later issue cost little (H100, b1 h128 s_k640 on the head-group plan, k = 8:
        11.1-11.3 µs against 10.9-11.1 with the early issue and the spill)."""
        return not self.cluster_merge_spread

    @property
    def cluster_recv_bytes(self) -> tuple[int, int]:
        """The cluster merge's receive buffer in the (idle) KV stages: the k - 1 peers' rows
        of o/ℓ from 0 (fp32, each peer's owned rows, at least one 8-row slab), then their
        LSEs ((k - 1) x 64 floats); with ``cluster_merge_spread`` a k-th slot and LSE column,
        this rank's own (the LSEs may then reach into the epilogue's staging buffers, which
        follow the stages and which that merge does not use): (offset of the LSEs, bytes
        in all)."""
        k = self.cluster
        slots = k if self.cluster_merge_spread else k - 1
        o = slots * max(self.cluster_rows_per_rank, 8) * CONTENT_DIM * 4
        return o, o + slots * L.M_TILE * 4

    @property
    def box_rows(self) -> int:
        return min(L.BLOCK_N, self.page_size)

    @property
    def scale_box(self) -> int:
        """Scales per shared-memory scale slot: a TMA box's, or a whole block's when the
        producer gathers them (sparse)."""
        return L.BLOCK_N if self.sparse else self.box_rows
