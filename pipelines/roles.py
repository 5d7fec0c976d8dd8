"""Warp roles, register budgets and barrier ids of the decode kernel.

One CTA = 3 warpgroups (384 threads):

* WG0 — producer. ``setmaxnreg`` down to 24; warp 0 issues every TMA load (Q once per
  request segment, then per 64-token KV block: e4m3 content, bf16 RoPE, fp32 scales).
* WG1, WG2 — consumers. ``setmaxnreg`` up to 240; consumer ``w`` owns output dims
  ``[256 w, 256 w + 256)``. They own alternate KV blocks (App. C Algorithm 1). For its
  block j a consumer waits for its QK (issued after its PV of block j-2), transposes V_j
  in place, waits for the other consumer's softmax state of block j-1, runs the softmax,
  publishes P_j and its state, then runs its half of PV for block j-1 and block j, in
  block order (App. C order enforcement: the accumulator's scale only moves forward), and
  issues QK of block j+2.

Named barriers (hardware ids 1..15; 0 is ``__syncthreads``) between the two consumer WGs
(256 threads each; one side arrives, the other waits, so no side can run two generations
ahead — the reverse barrier bounds it):

* ``STATE[s]`` — the owner of block ``k`` (``s = k % 2``) published P_k in ``sP[s]``, its
  softmax state (m, σ_p, ℓ, γ) in slot ``s`` and Vᵀ_k; the other WG waits.
* ``PFREE[s]`` — the other WG finished its PV GEMM with ``sP[s]``; the owner of block
  ``k + 2`` waits before overwriting it.
* ``WG_SYNC[w]`` — consumer ``w``'s own 128 threads (in-place transpose phases, making its
  shared-memory writes visible to its WGMMAs).
* ``PAIR_SYNC`` — both consumer WGs (256 threads) after a split request's epilogue: the
  CTA counts its split once, and the splits that merge use the KV stages as scratch.
"""

from dataclasses import dataclass

THREADS_PER_WG = 128
NUM_CONSUMER_WGS = 2
THREADS = THREADS_PER_WG * (1 + NUM_CONSUMER_WGS)
PRODUCER_REGS = 24
CONSUMER_REGS = 240


@dataclass(frozen=True)
class BarrierIds:
    wg_sync: tuple = (1, 2)
    state: tuple = (3, 4)
    pfree: tuple = (5, 6)
    pair_sync: int = 7


BARRIERS = BarrierIds()
PAIR_THREADS = THREADS_PER_WG * NUM_CONSUMER_WGS
