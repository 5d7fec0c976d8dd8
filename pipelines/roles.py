"""Warp roles, register budgets and barrier ids of the decode kernel.

One CTA = 4 warpgroups (512 threads, ``LAYOUT``):

* WG0 — producer. ``setmaxnreg`` down to 24; warp 0 issues every TMA load (Q once per
  request segment, then per 64-token KV block: e4m3 content, bf16 RoPE, fp32 scales).
* WG1 — transposer. ``setmaxnreg`` down to 40; rewrites each KV block's content as Vᵀ in
  place once the block's owner has finished reading it as K (its QK), zeroing tokens past
  the sequence. Handshakes per KV stage, as mbarriers (a waiter may be any number of
  blocks behind): ``qk_done`` (the owner WG's 128 threads arrive after its QK wait; thread
  0 first leaves the block's valid token count in shared memory) and ``vt_ready`` (the
  transposer's 128 threads arrive after their stores and a proxy fence).
* WG2, WG3 — consumers. ``setmaxnreg`` up to 224 (128·(24 + 40) + 256·224 = 65536);
  consumer ``w`` owns output dims ``[256 w, 256 w + 256)``. They own alternate KV blocks
  (App. C Algorithm 1). For its block j a consumer waits for its QK (issued after its PV
  of block j-2), signals ``qk_done``, waits for the other consumer's softmax state of block
  j-1, runs the softmax, publishes P_j and its state, then (after ``vt_ready`` of block j,
  which implies j-1's: the transposer signals in block order) runs its half of PV for
  block j-1 and block j, in block order (App. C order enforcement: the accumulator's scale
  only moves forward), and issues QK of block j+2 once its KV has landed (a consumer waits
  for the TMA of its own blocks only: of the other's it reads Vᵀ and P).

(The 3-warpgroup layout, each consumer transposing its own blocks at 240 registers, was
measured slower and is at cc70d70.)

Named barriers (hardware ids 1..15; 0 is ``__syncthreads``) between the two consumer WGs
(256 threads each; one side arrives, the other waits, so no side can run two generations
ahead — the reverse barrier bounds it):

* ``STATE[s]`` — the owner of block ``k`` (``s = k % 2``) published P_k in ``sP[s]`` and its
  softmax state (m, σ_p, ℓ, γ) in slot ``s``; the other WG waits.
* ``PFREE[s]`` — the other WG finished its PV GEMM with ``sP[s]``; the owner of block
  ``k + 2`` waits before overwriting it.
* ``WG_SYNC[w]`` — consumer ``w``'s own 128 threads (before a WG reads back its own last
  published state).
* ``PAIR_SYNC`` — both consumer WGs (256 threads) after a split request's epilogue: the
  CTA counts its split once, and the splits that merge use the KV stages as scratch.
* ``TRANSPOSER_SYNC`` — the transposer's 128 threads, between the load and store phases
  of each 8 KiB chunk of the in-place transposition.
"""

import enum
from dataclasses import dataclass

THREADS_PER_WG = 128
NUM_CONSUMER_WGS = 2
PRODUCER_REGS = 24
TRANSPOSER_REGS = 40
# 128·(24 + 40) + 256·224 = 65536 registers
CONSUMER_REGS = 224


@dataclass(frozen=True)
class Layout:
    """Warpgroups of one CTA: the threads, the transposer's index, the first consumer's and
    the consumers' register budget."""

    threads: int
    transposer_wg: int
    first_consumer_wg: int
    consumer_regs: int


# producer, transposer, then the two consumers
LAYOUT = Layout(THREADS_PER_WG * (2 + NUM_CONSUMER_WGS), 1, 2, CONSUMER_REGS)


class Barrier(enum.IntEnum):
    """Named barrier ids (hardware 1..15; 0 is ``__syncthreads``). ``WG_SYNC``, ``STATE`` and
    ``PFREE`` are the first of two: add the consumer index or the slot."""

    WG_SYNC = 1  # 1, 2
    STATE = 3  # 3, 4
    PFREE = 5  # 5, 6
    PAIR_SYNC = 7
    TRANSPOSER_SYNC = 8


PAIR_THREADS = THREADS_PER_WG * NUM_CONSUMER_WGS
