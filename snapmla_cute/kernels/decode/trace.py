"""Profiling stamps of the decode kernel (``DecodeConfig.trace`` / ``trace_loop``; never set
by the library). The stamps overwrite the end of the fp32 partials, so a traced call's
split requests come out wrong; ``trace_words`` reads them back (``profiles/experiments/trace_small.py``
tabulates them; ``trace_loop.py``, for the loop stamps, is at ac2dc72). In the cluster merge,
``count_seen`` and ``merged`` mark the peers' stages free and their rows arrived.

* ``trace``: %globaltimer (low 32 bits) at each CTA's milestones, one row of
  ``TRACE_WORDS`` per CTA at the end of the partials (``trace_words``; consumer milestones
  at ``16·wg + event``).
* ``trace_loop``: SM clock of each consumer WG's first ``LOOP_ITERS`` owned blocks
  (``LOOP_EVENTS``), then per block g < ``LOOP_BLOCKS`` the producer's acquire (KV stage
  free), the transposer's start (K read) and end (Vᵀ written), just before the ``trace`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from snapmla_cute.format import CONTENT_DIM

if TYPE_CHECKING:
    from snapmla_cute.kernels.decode.config import DecodeConfig

TRACE_EVENTS = dict(
    start=0, planned=1, q_issued=2, kv_issued=3, q_arrived=4, qk_done=5, softmax_done=6, pv_done=7,
    epilogue_done=8, count_seen=9, merged=10, exit=11, lengths_read=12, splits_counted=13,
    part_planned=14, smid=15,
)
TRACE_WORDS = 32
LOOP_EVENTS = dict(
    top=0, qk_waited=1, state_waited=2, sm_max=3, sm_exp=4, softmax_done=5, p_published=6, vt_waited=7, pv_done=8,
    kv_waited=9, qk_issued=10,
)
LOOP_ITERS = 16
LOOP_BLOCKS = 32
LOOP_PROD = 2 * LOOP_ITERS * len(LOOP_EVENTS)
LOOP_WORDS = LOOP_PROD + 3 * LOOP_BLOCKS


def trace_words(o_partial, ctas: int, loop: bool = False):
    """The int32 stamp rows ``(ctas, words)`` a traced call left in ``o_partial``."""
    import torch

    flat = o_partial.view(torch.int32).view(-1)
    n = flat.numel() - ctas * TRACE_WORDS
    if loop:
        n -= ctas * LOOP_WORDS
        return flat[n : n + ctas * LOOP_WORDS].view(ctas, LOOP_WORDS)
    return flat[n:].view(ctas, TRACE_WORDS)


def _rows(cfg, m_o_partial, m_sched, words_from_end: int, words: int):
    """Int32 (CTAs, words) starting ``CTAs·words_from_end`` words before the end of the fp32
    partials (a slab of a few heads is smaller than the rows)."""
    ctas = cfg.m_tiles * m_sched.shape[0]
    start = m_o_partial.shape[2] * cfg.rows * CONTENT_DIM - ctas * words_from_end
    return cute.make_tensor(
        cute.recast_ptr(m_o_partial.iterator + start, dtype=Int32),
        cute.make_layout((ctas, words), stride=(words, 1)),
    )


@dataclass(frozen=True)
class Tracer:
    """One CTA's stamp rows (``rows``, ``loop_rows``: None where the switch is off; ``cta``:
    this CTA's row); every method is a no-op (no code) unless its switch is on. Frozen: the
    roles call it inside run-time branches."""

    cfg: DecodeConfig
    rows: cute.Tensor  # int32 (CTAs, TRACE_WORDS), or None
    loop_rows: cute.Tensor  # int32 (CTAs, LOOP_WORDS), or None
    cta: Int32  # this CTA's row, or None

    @classmethod
    def make(cls, cfg, m_o_partial, m_sched, m_tile, part) -> "Tracer":
        """The stamp rows at the end of the fp32 partials ``m_o_partial``."""
        rows = _rows(cfg, m_o_partial, m_sched, TRACE_WORDS, TRACE_WORDS) if cfg.trace else None
        loop_rows = _rows(cfg, m_o_partial, m_sched, TRACE_WORDS + LOOP_WORDS, LOOP_WORDS) if cfg.trace_loop else None
        cta = part * cfg.m_tiles + m_tile if cfg.trace or cfg.trace_loop else None
        return cls(cfg, rows, loop_rows, cta)

    @cute.jit
    def stamp(self, event: cutlass.Constexpr, wg=0):
        """``trace``: this CTA's %globaltimer (low 32 bits) at ``event``."""
        if cutlass.const_expr(self.cfg.trace):
            t = Int32(cute.arch.globaltimer())
            if cutlass.const_expr(event == "start"):
                self.rows[self.cta, TRACE_EVENTS["smid"]] = Int32(cute.arch.smid())
            self.rows[self.cta, TRACE_EVENTS[event] + 16 * wg] = t

    @cute.jit
    def loop_stamp(self, word):
        """``trace_loop``: this SM's clock at ``word`` of the CTA's loop row (the caller
        guards: one thread, within the traced window)."""
        if cutlass.const_expr(self.cfg.trace_loop):
            self.loop_rows[self.cta, word] = Int32(cute.arch.clock())

    @cute.jit
    def block_event(self, event: cutlass.Constexpr, wg, r, j, wg_tidx):
        """A consumer WG's loop event for its owned block j of the part's first request."""
        if cutlass.const_expr(self.cfg.trace_loop):
            it = j // 2
            if r == 0 and it < LOOP_ITERS and wg_tidx == 0:
                self.loop_stamp((wg * LOOP_ITERS + it) * len(LOOP_EVENTS) + LOOP_EVENTS[event])

    @cute.jit
    def producer_acquired(self, r, i, lane):
        """``trace_loop``: the producer acquired the stage of the request's i-th block."""
        if cutlass.const_expr(self.cfg.trace_loop):
            if r == 0 and i < LOOP_BLOCKS and lane == 0:
                self.loop_stamp(LOOP_PROD + i)

    @cute.jit
    def transposer_event(self, g, end: cutlass.Constexpr, wg_tidx):
        """``trace_loop``: the transposer's start (K read) or end (Vᵀ written) of block g."""
        if cutlass.const_expr(self.cfg.trace_loop):
            if g < LOOP_BLOCKS and wg_tidx == 0:
                self.loop_stamp(LOOP_PROD + (2 if end else 1) * LOOP_BLOCKS + g)
