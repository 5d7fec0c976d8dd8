"""The KV ring: stage and phase of the g-th KV block a CTA consumes, from both sides.

The producer fills ``stages`` shared-memory stages in order through
``cutlass.pipeline.PipelineTmaAsync``; block g lives in stage ``g mod S`` with mbarrier
phase ``(g / S) mod 2``. The consumer warpgroups wait the stages in block order but hold
up to three blocks at once (their own, the other warpgroup's, and the next QK's), so the
pipeline states are computed from g instead of carried through the loops. The TMA producer
(one thread) goes through the pipeline's own producer participant; the sparse decode's
gathering threads use ``wait_free`` and ``full_addr`` (each arrives when its cp.async
copies land).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


# The state objects of the kernels are frozen dataclasses: the DSL passes them through its
# run-time `if`s and loops unchanged (a plain object whose method is called inside one
# would have to be carried as a run-time value).
@dataclass(frozen=True)
class KVRing:
    """``stages`` KV stages, optionally over the TMA pipeline ``pipe`` (wait / release by g)."""

    stages: int
    pipe: object = None
    # the stages are written by cp.async (generic proxy): a consumer fences the async proxy
    # after its wait, before WGMMA reads them
    generic_writes: bool = False

    def stage_of(self, g: Int32):
        """g mod stages for g ≥ 0: a mask when the stage count is a power of two (Int32 % and
        // compile to signed-division fix-ups, per use, in the hot loop)."""
        S = self.stages
        if S & (S - 1) == 0:
            return g & (S - 1)
        return g % S

    @cute.jit
    def state(self, g: Int32):
        """Pipeline state of block g: stage g % S, phase (g / S) % 2."""
        S = self.stages
        if cutlass.const_expr(S & (S - 1) == 0):
            phase = (g >> (S.bit_length() - 1)) & 1
        else:
            phase = (g // S) % 2
        return pipeline.PipelineState(S, g, self.stage_of(g), phase)

    @cute.jit
    def wait(self, g: Int32):
        """Waits until block g's TMA loads have landed."""
        self.pipe.consumer_wait(self.state(g))
        if cutlass.const_expr(self.generic_writes):
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def release(self, g: Int32):
        """This warpgroup is done with block g's stage (the producer may refill it)."""
        self.pipe.consumer_release(self.state(g))

    @cute.jit
    def wait_free(self, g: Int32):
        """Producer: waits until block g's stage is free (its previous block released);
        returns the stage."""
        st = self.state(g)
        # a producer waits the empty barrier's previous phase
        self.pipe.sync_object_empty.wait(st.index, st.phase ^ 1)
        return st.index

    def full_addr(self, index: Int32) -> Int32:
        """The full barrier of stage ``index`` (shared address): the gathering threads'
        ``cp.async.mbarrier.arrive.noinc`` target."""
        return self.pipe.sync_object_full.get_barrier(index).toint()
