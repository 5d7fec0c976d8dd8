"""Profiling stamps of the decode kernel (``DecodeConfig.trace``; never set by the library):
%globaltimer (low 32 bits) at each CTA's milestones, one row of ``TRACE_WORDS`` per CTA at
the end of the fp32 partials (consumer milestones at ``16·wg + event``). The stamps
overwrite the partials' end, so a traced call's split requests come out wrong;
``trace_words`` reads them back (``profiles/experiments/trace_small.py`` tabulates them). In
the cluster merge, ``count_seen`` and ``merged`` mark the peers' stages free and their rows
arrived. (The SM-clock loop stamps, ``trace_loop``, and their reader are at cc70d70.)
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


def trace_words(o_partial, ctas: int):
    """The int32 stamp rows ``(ctas, words)`` a traced call left in ``o_partial``."""
    import torch

    flat = o_partial.view(torch.int32).view(-1)
    return flat[flat.numel() - ctas * TRACE_WORDS:].view(ctas, TRACE_WORDS)


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
    """One CTA's stamp rows (``rows``: None where ``trace`` is off; ``cta``: this CTA's row);
    ``stamp`` is a no-op (no code) unless ``trace`` is on. Frozen: the roles call it inside
    run-time branches."""

    cfg: DecodeConfig
    rows: cute.Tensor  # int32 (CTAs, TRACE_WORDS), or None
    cta: Int32  # this CTA's row, or None

    @classmethod
    def make(cls, cfg, m_o_partial, m_sched, m_tile, part) -> "Tracer":
        """The stamp rows at the end of the fp32 partials ``m_o_partial``."""
        rows = _rows(cfg, m_o_partial, m_sched, TRACE_WORDS, TRACE_WORDS) if cfg.trace else None
        cta = part * cfg.m_tiles + m_tile if cfg.trace else None
        return cls(cfg, rows, cta)

    @cute.jit
    def stamp(self, event: cutlass.Constexpr, wg=0):
        """``trace``: this CTA's %globaltimer (low 32 bits) at ``event``."""
        if cutlass.const_expr(self.cfg.trace):
            t = Int32(cute.arch.globaltimer())
            if cutlass.const_expr(event == "start"):
                self.rows[self.cta, TRACE_EVENTS["smid"]] = Int32(cute.arch.smid())
            self.rows[self.cta, TRACE_EVENTS[event] + 16 * wg] = t
