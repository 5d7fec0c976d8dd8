"""Hand-offs between the decode kernel's warpgroups, beside the KV ring's TMA barriers.

``TransposerHandshake`` — per KV stage, two mbarriers (a waiter may be any number of blocks
behind): ``k_read`` (the block's owner has waited for its QK, so K may be overwritten; its
thread 0 first leaves the block's valid token count in shared memory) and ``vt_ready``
(the transposer's 128 threads, after their stores and a proxy fence: Vᵀ may be read by
WGMMA). The transposer signals in block order, so Vᵀ of g ready implies g-1's.

``PairExchange`` — the two consumer warpgroups over named barriers (one side arrives, the
other waits, so neither runs two generations ahead; the reverse barrier bounds it): the
owner of block k publishes P_k in ``sP[k % 2]`` and its softmax state (m, σ_p, ℓ, γ) in
slot ``k % 2`` and arrives on ``STATE[k % 2]``; the other WG waits there, reads it, runs its
PV with that P and arrives on ``PFREE[k % 2]``, which the owner of block k + 2 waits on
before it overwrites the slot.

``ClusterExchange`` — the cluster plan's two mbarriers per CTA, used once per launch: ``free``
(k - 1 arrivals: each peer's KV stages are idle, so rows may be written into them) and
``data`` (one arrival per peer thread and row it sent here, released at cluster scope after
its stores). Every thread arrives on the cluster barrier at kernel start, after the init;
only the consumers wait on it, before their first remote arrival. Each CTA waits for its own
``free`` and ``data`` before it exits, so no peer touches a CTA that has left.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32

from snapmla_cute import ptx
from snapmla_cute.pipelines.kv_ring import KVRing
from snapmla_cute.pipelines.roles import NUM_CONSUMER_WGS, PAIR_THREADS, THREADS_PER_WG, Barrier


@dataclass(frozen=True)
class TransposerHandshake:
    """The KV stages' ``k_read`` / ``vt_ready`` mbarriers (``qk_mbar``, ``vt_mbar``: one per
    stage) and the valid-token words ``s_valid`` (one per stage)."""

    ring: KVRing
    qk_mbar: object
    vt_mbar: object
    s_valid: object

    @cute.jit
    def init(self, tidx):
        """Thread 0 initializes every stage's pair (128 arrivals each)."""
        if tidx == 0:
            for st in cutlass.range_constexpr(self.ring.stages):
                cute.arch.mbarrier_init(self.qk_mbar + st, THREADS_PER_WG)
                cute.arch.mbarrier_init(self.vt_mbar + st, THREADS_PER_WG)

    @cute.jit
    def k_read(self, stage, valid, wg_tidx):
        """Owner WG: K of ``stage`` is read; ``valid`` tokens of the block are in the sequence."""
        if wg_tidx == 0:
            self.s_valid[stage] = valid  # released by the arrive below
        cute.arch.mbarrier_arrive(self.qk_mbar + stage)

    @cute.jit
    def wait_k_read(self, stage, g):
        """Transposer: waits for ``k_read`` of block g (in ``stage``)."""
        cute.arch.mbarrier_wait(self.qk_mbar + stage, self.ring.state(g).phase)

    def valid_tokens(self, stage):
        """The count the owner left with ``k_read`` (read after ``wait_k_read``)."""
        return self.s_valid[stage]

    @cute.jit
    def vt_ready(self, stage):
        """Transposer thread: its stmatrix stores of ``stage`` are done; fence them for WGMMA."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(self.vt_mbar + stage)

    @cute.jit
    def wait_vt(self, g):
        """Consumer: waits until the transposer has written Vᵀ of block g."""
        cute.arch.mbarrier_wait(self.vt_mbar + self.ring.stage_of(g), self.ring.state(g).phase)


@dataclass(frozen=True)
class PairExchange:
    """The consumer WGs' exchange of softmax states through ``s_state`` (Float32
    ``(64 rows, 4 fields, 2 slots)``, a row's fields one 16-byte access) and of the P slots."""

    s_state: object

    @staticmethod
    def barrier(first: Barrier, slot):
        """The two consumer WGs' named barrier ``first + slot``."""
        return pipeline.NamedBarrier(barrier_id=int(first) + slot, num_threads=PAIR_THREADS)

    @cute.jit
    def wait_state(self, slot, c_s_mn, regs):
        """Waits for the other WG's block in ``slot`` and reads its state into ``regs``."""
        self.barrier(Barrier.STATE, slot).arrive_and_wait()
        self.read_state(slot, c_s_mn, regs)

    @cute.jit
    def read_state(self, slot, c_s_mn, regs):
        """The state published in ``slot`` into ``regs`` = (m, σ_p, ℓ, γ) register tensors,
        one entry per row of this thread (``c_s_mn``: the accumulator's coordinates). A WG's
        own slot is its WG index: blocks alternate owners and slots alike."""
        row_max, sigma_p, row_sum, gamma = regs
        for i in cutlass.range_constexpr(cute.size(c_s_mn, mode=[0])):
            lr = c_s_mn[i, 0][0]
            st = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(self.s_state[lr, None, slot], st)
            row_max[i] = st[0]
            sigma_p[i] = st[1]
            row_sum[i] = st[2]
            gamma[i] = st[3]

    @cute.jit
    def write_state(self, slot, c_s_mn, regs, wg_tidx):
        """The owner's state into ``slot`` (one thread of each quad: its rows' values are
        quad-uniform after the softmax's reductions)."""
        row_max, sigma_p, row_sum, gamma = regs
        if wg_tidx % 4 == 0:
            for i in cutlass.range_constexpr(cute.size(c_s_mn, mode=[0])):
                lr = c_s_mn[i, 0][0]
                st = cute.make_rmem_tensor((4,), Float32)
                st[0] = row_max[i]
                st[1] = sigma_p[i]
                st[2] = row_sum[i]
                st[3] = gamma[i]
                cute.autovec_copy(st, self.s_state[lr, None, slot])

    def signal_state(self, slot):
        """Owner: P and state of ``slot`` are written (after a proxy fence)."""
        self.barrier(Barrier.STATE, slot).arrive()

    def wait_p_free(self, slot):
        """Owner of a later block: waits until the other WG's PV has read ``sP[slot]``."""
        self.barrier(Barrier.PFREE, slot).arrive_and_wait()

    def free_p(self, slot):
        """The other WG: its PV with ``sP[slot]`` is done."""
        self.barrier(Barrier.PFREE, slot).arrive()


@dataclass(frozen=True)
class ClusterExchange:
    """The cluster merge's ``free`` / ``data`` mbarriers (Int32 shared addresses, the same in
    each CTA of a ``k``-CTA cluster); a wait past ``limit_ns`` traps."""

    free: object
    data: object
    k: int
    limit_ns: int

    @staticmethod
    def make(mbar_addr, k: int, limit_ns: int) -> "ClusterExchange":
        """From the address of the pair (``free`` first, ``data`` 8 bytes on)."""
        return ClusterExchange(mbar_addr, mbar_addr + 8, k, limit_ns)

    @staticmethod
    @cute.jit
    def init(mbar_ptr, k: cutlass.Constexpr, rows: cutlass.Constexpr, tidx):
        """Thread 0: ``free`` expects the k - 1 peers, ``data`` every (thread, row) of theirs
        holding a row this CTA owns (each row: 4 threads of each consumer WG)."""
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_ptr, k - 1)
            cute.arch.mbarrier_init(mbar_ptr + 1, (k - 1) * 4 * NUM_CONSUMER_WGS * rows // k)

    @cute.jit
    def stages_idle(self, ctid, rank):
        """Consumers, both WGs past their last PV: once every CTA's barriers are initialized,
        thread ``ctid`` < k tells peer ``ctid`` that this CTA's stages are free."""
        cute.arch.cluster_wait()
        if ctid < self.k:
            if ctid != rank:
                ptx.mbar_arrive_cluster(ptx.mapa(self.free, ctid))

    @cute.jit
    def rows_sent(self, owner):
        """This thread's stores of a row ``owner`` owns are done (released, cluster scope)."""
        ptx.mbar_arrive_cluster(ptx.mapa(self.data, owner))

    @cute.jit
    def wait_free(self):
        """Every peer's stages are free."""
        self.wait(self.free)

    @cute.jit
    def wait_rows(self):
        """Every peer's rows this CTA owns have arrived (visible: cluster-scope acquire)."""
        self.wait(self.data)

    @cute.jit
    def wait(self, bar):
        """Phase 0 of this CTA's mbarrier ``bar``, bounded: a count that never completes fails
        the launch instead of hanging the stream."""
        t0 = cute.arch.globaltimer()
        while ptx.mbar_try_wait_cluster(bar, cutlass.Int32(0)) == 0:
            if cute.arch.globaltimer() - t0 > self.limit_ns:
                ptx.trap()
