"""One decode step as one host function and one launch (two from a bf16 query).

The decode kernel plans its own part of the split-KV work from the lengths and merges the
splits of a cut request itself (the last split to finish does it), so a step is one
kernel launch and one TVM-FFI call. It takes every
tensor in its natural (contiguous, PyTorch) layout and builds the kernels' views here, at
trace time: a call from Python makes no view objects, and TVM-FFI's argument decoding (in
C) checks every tensor's dtype, shape, strides, alignment and device, batch sizes tied
across arguments through one symbolic size.

One step class serves every call the API makes, with one signature, ``launch.StepArgs``'s
fields: dense or sparse by its config; the optional trailing tensors select a causal
shard's visible-key counts (``visible``, dense), a bf16 query to quantize first (``q``) and
the accurate mode's residual codes (``q_lo``). Argument order groups what changes per call
(queries, tables, outputs), then the cache, then the metadata buffers, so the Python side
can pass the last two as prebuilt tuples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16

from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, KV_ROW_BYTES, ROPE_DIM
from snapmla_cute.kernels.decode.config import DecodeConfig
from snapmla_cute.kernels.decode.kernel import DecodeKernel
from snapmla_cute.kernels.decode.launch import KernelArgs, StepArgs, entry_signature, from_entry
from snapmla_cute.kernels.quant_q import QuantizeQKernel, QuantQConfig
from snapmla_cute.kernels.views import view as _view


@dataclass(frozen=True)
class DecodeStepConfig:
    """The dense step: ``decode`` is the kernel's config (``visible``: the step takes a causal
    shard's visible-key counts). ``head_groups`` g > 1 (s_q 1): a call's request of
    g·``decode.heads`` heads runs as g kernel requests of ``decode.heads`` heads each,
    sharing its block-table row and length (the head-group plan of small batches: a
    request's heads over CTAs, ``heads.default_head_groups``)."""

    decode: DecodeConfig
    head_groups: int = 1

    def __post_init__(self):
        d = self.decode
        if self.head_groups < 1 or (self.head_groups > 1 and (d.s_q != 1 or d.visible or d.sparse)):
            raise ValueError(f"DecodeStepConfig: head_groups > 1 needs a dense step at s_q 1 without visible "
                             f"counts; got head_groups={self.head_groups} with {d}")


@dataclass(frozen=True)
class DecodeSparseStepConfig:
    """The sparse step: ``decode`` is the kernel's config (``sparse``, one query token per
    kernel request), ``s_q`` the query tokens per request of the call."""

    decode: DecodeConfig
    s_q: int


class DecodeStepKernel:
    """One decode step: the Fused-Q-Quant launch when given a bf16 query, then the decode.
    Dense (``DecodeStepConfig``): paged by ``block_table`` [b, max_pages] with lengths [b].
    Sparse (``DecodeSparseStepConfig``): each (request, query token) of the call is one
    kernel request whose "block table" is its index list (slot ids, ``page_size`` 1)."""

    def __init__(self, cfg: DecodeStepConfig | DecodeSparseStepConfig):
        self.cfg = cfg
        self.sparse = isinstance(cfg, DecodeSparseStepConfig)
        decode = cfg.decode
        if self.sparse:
            # a request's query tokens pick overlapping slots (an indexer's top-k of one
            # context): past one token the gathered rows are kept in L2 for each other (H100,
            # b64 h8 s_q8: 1.3% slower with the evict-first hint)
            decode = replace(decode, kv_evict_first=decode.kv_evict_first and cfg.s_q == 1)
        self.decode = DecodeKernel(decode)
        self.quant = QuantizeQKernel(QuantQConfig(split=decode.q_split))
        # kernel requests per call request (the head-group plan's g; the sparse step's own
        # query tokens are handled by ``sparse_views``)
        self.groups = 1 if self.sparse else cfg.head_groups
        # (token, head) rows of a call's request
        self.q_rows = (cfg.s_q if self.sparse else cfg.decode.s_q) * cfg.decode.heads * self.groups

    def _call(self, *entry):
        """The compiled entry: ``launch.StepArgs``'s fields and the stream
        (``launch.entry_signature``)."""
        args, stream = from_entry(StepArgs, entry)
        self.launch(args, stream)

    _call.__signature__ = entry_signature(StepArgs)
    __call__ = cute.jit(_call)

    @cute.jit
    def launch(self, args: StepArgs, stream):
        if cutlass.const_expr((args.visible is not None) != self.cfg.decode.visible):
            raise ValueError(f"decode step: visible counts given: {args.visible is not None}, but the config "
                             f"says visible={self.cfg.decode.visible}")
        if cutlass.const_expr(args.q is not None):
            self.quantize_query(args, args.q.shape[0] * self.q_rows, stream)
        if cutlass.const_expr(self.sparse):
            self.decode.launch(self.sparse_views(args), stream)
        else:
            self.decode.launch(self.dense_views(args), stream)

    def quantize_query(self, args: StepArgs, n, stream):
        """Fused-Q-Quant of the ``n`` (token, head) rows of the bf16 ``args.q`` [.., 576] into
        the metadata's query buffers (and the residual's codes into ``args.q_lo``)."""
        self.quant(
            _view(args.q, (n, CONTENT_DIM), (HEAD_DIM, 1)),
            _view(args.q, (n, ROPE_DIM), (HEAD_DIM, 1), BFloat16, 2 * CONTENT_DIM),
            _view(args.q_nope, (n, CONTENT_DIM), (CONTENT_DIM, 1), cutlass.Uint8),
            _view(args.q_rope, (n, ROPE_DIM), (ROPE_DIM, 1)),
            _view(args.q_scale, (n,), (1,)),
            stream,
            None if args.q_lo is None else _view(args.q_lo, (n, CONTENT_DIM), (CONTENT_DIM, 1), cutlass.Uint8),
        )

    def dense_views(self, a: StepArgs) -> KernelArgs:
        """The decode kernel's arguments as views of the dense step's tensors: rows (R =
        s_q·h) first, the batch / page / split index last (traced inline). With head groups
        (g), kernel request k = i·g + j is heads [16j, 16j + 16) of request i: a plain reshape
        of q, out and lse (s_q 1), and a stride-0 mode over j in the table's and the lengths'
        views; the metadata's per-request buffers come as [b, g, ..]."""
        R = self.cfg.decode.rows
        s_q = self.cfg.decode.s_q
        ps = self.cfg.decode.page_size
        g = self.groups
        b = a.q_nope.shape[0] * g  # kernel requests
        pages = a.kv.shape[0]
        splits = a.o_partial.shape[0]
        row = KV_ROW_BYTES
        q_nope = _view(a.q_nope, (R, CONTENT_DIM, b), (CONTENT_DIM, 1, R * CONTENT_DIM))
        q_rope = _view(a.q_rope, (R, ROPE_DIM, b), (ROPE_DIM, 1, R * ROPE_DIM))
        q_scale = _view(a.q_scale, (R, b), (1, R))
        kv_content = _view(a.kv, (ps, CONTENT_DIM, pages), (row, 1, ps * row))
        kv_rope = _view(a.kv, (ps, ROPE_DIM, pages), (row // 2, 1, ps * row // 2), BFloat16, CONTENT_DIM)
        kv_scale = _view(a.kv_scale, (ps, pages), (1, ps))
        out_d = _view(a.out, (R, CONTENT_DIM, b), (CONTENT_DIM, 1, R * CONTENT_DIM))
        o_part_d = _view(a.o_partial, (R, CONTENT_DIM, splits), (CONTENT_DIM, 1, R * CONTENT_DIM))
        lse_part_d = _view(a.lse_partial, (R, splits), (1, R))
        # passed as b entries so TVM-FFI ties the plan to the batch (a plan made for a smaller
        # batch would be overrun); the buffer behind it holds b + 1
        split_offsets = _view(a.split_offsets, (b + 1,), (1,))
        table, lengths, lse, counters = a.table, a.lengths, a.lse, a.counters
        if cutlass.const_expr(g > 1):
            h = self.cfg.decode.heads
            n = a.q_nope.shape[0]
            table = _view(a.table, ((g, n), a.table.shape[1]), ((0, a.table.layout.stride[0]), 1))
            lengths = _view(a.lengths, ((g, n),), ((0, 1),))
            lse = _view(a.lse, (b, h, 1), (h, 1, 1))
            counters = _view(a.counters, (b, 2 * self.cfg.decode.m_tiles), (2 * self.cfg.decode.m_tiles, 1))
        visible = None
        if cutlass.const_expr(a.visible is not None):
            visible = _view(a.visible, (s_q, a.q_nope.shape[0]), (1, s_q))
        return KernelArgs(
            q_nope, q_rope, q_scale, kv_content, kv_rope, kv_scale, table, lengths, a.sched, split_offsets, out_d,
            lse, o_part_d, lse_part_d, counters, a.scale_log2, visible, self.q_lo_view(a, R, b),
        )

    def sparse_views(self, a: StepArgs) -> KernelArgs:
        """The same for the sparse step: kernel request k = i·s_q + t is query token t of
        request i, its index list the table row."""
        h = self.cfg.decode.heads
        s_q = self.cfg.s_q
        b = a.q_nope.shape[0]
        n = b * s_q  # kernel requests: request-major, then query token
        topk = a.table.shape[2]
        slots = a.kv.shape[0]
        splits = a.o_partial.shape[0]
        row = KV_ROW_BYTES
        m_tiles = self.cfg.decode.m_tiles
        q_nope = _view(a.q_nope, (h, CONTENT_DIM, n), (CONTENT_DIM, 1, h * CONTENT_DIM))
        q_rope = _view(a.q_rope, (h, ROPE_DIM, n), (ROPE_DIM, 1, h * ROPE_DIM))
        q_scale = _view(a.q_scale, (h, n), (1, h))
        kv_content = _view(a.kv, (1, CONTENT_DIM, slots), (row, 1, row))
        kv_rope = _view(a.kv, (1, ROPE_DIM, slots), (row // 2, 1, row // 2), BFloat16, CONTENT_DIM)
        kv_scale = _view(a.kv_scale, (1, slots), (1, 1))
        table = _view(a.table, (n, topk), (topk, 1))
        # kernel request k = i·s_q + t reads request i's length: a stride-0 mode over t
        lengths = _view(a.lengths, ((s_q, b),), ((0, 1),))
        out_d = _view(a.out, (h, CONTENT_DIM, n), (CONTENT_DIM, 1, h * CONTENT_DIM))
        lse_d = _view(a.lse, ((s_q, b), h, 1), ((1, h * s_q), s_q, 1))
        o_part_d = _view(a.o_partial, (h, CONTENT_DIM, splits), (CONTENT_DIM, 1, h * CONTENT_DIM))
        lse_part_d = _view(a.lse_partial, (h, splits), (1, h))
        split_offsets = _view(a.split_offsets, (n + 1,), (1,))
        counters = _view(a.counters, (n, 2 * m_tiles), (2 * m_tiles, 1))
        return KernelArgs(
            q_nope, q_rope, q_scale, kv_content, kv_rope, kv_scale, table, lengths, a.sched, split_offsets, out_d,
            lse_d, o_part_d, lse_part_d, counters, a.scale_log2, None, self.q_lo_view(a, h, n),
        )

    def q_lo_view(self, a: StepArgs, R, n):
        """The accurate mode's residual codes laid out as q_nope's view (R rows, n kernel
        requests), or None."""
        if cutlass.const_expr(a.q_lo is None):
            return None
        return _view(a.q_lo, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), cutlass.Uint8)
