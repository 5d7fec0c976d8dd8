"""The host→kernel seam of the decode: each launch's arguments as one typed bundle, defined once.

``StepArgs`` is what a decode call passes, every tensor in its natural (contiguous, PyTorch)
layout: the API builds one per call (``snapmla_cute.steps.step_args``) and calls the
compiled step with it as it is (``fn(*args)``: a NamedTuple costs a tuple's unpacking);
``compile.step_fakes`` fakes it once for every step variant; the step
(``step.DecodeStepKernel``) takes it and builds the decode kernel's views, ``KernelArgs``,
which the kernel (``kernel.DecodeKernel``) takes.

A compiled entry's parameters are the bundle's fields (``entry_signature``): the required
ones, then the stream (TVM-FFI's environment stream: no argument at call time), then the
optional ones, None where absent. So the compiled call's argument order is the bundle's, its
argument decoder names each field, and nothing else lists them.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple


class StepArgs(NamedTuple):
    """A decode step's arguments. Dense: request i's pages by ``table`` row i with
    ``lengths[i]`` tokens. Sparse: query token t of request i attends to the cache slots
    ``table[i, t, :lengths[i]]`` (page size 1). R = s_q·h rows a request."""

    q_nope: Any  # e4m3 [b, s_q, h, 512] (written first from ``q`` when given)
    q_rope: Any  # bf16 [b, s_q, h, 64]
    q_scale: Any  # fp32 [b, s_q, h]
    table: Any  # int32: dense [b, max_pages] (any row stride); sparse [b, s_q, topk]
    lengths: Any  # int32 [b]: tokens (dense), list entries that count (sparse)
    out: Any  # bf16 [b, s_q, h, 512]
    lse: Any  # fp32 [b, h, s_q]
    kv: Any  # uint8: dense [pages, page_size, 640]; sparse [slots, 640]
    kv_scale: Any  # fp32: dense [pages, page_size]; sparse [slots]
    sched: Any  # int32 [parts, 8]: the plan the kernel writes
    split_offsets: Any  # int32: the first b (sparse: b·s_q; head groups: [b, g]) of the metadata's b + 1
    o_partial: Any  # fp32 [splits, R, 512] (a few-split request: f16 and scales, ``DecodeOutputs.partial_views``)
    lse_partial: Any  # fp32 [splits, R]
    counters: Any  # int32 dense [b, 2·m_tiles] ([b, g, ..] with head groups), sparse [b, s_q, 2·m_tiles]; zero between calls
    scale_log2: Any  # fp32: the softmax scale times log2(e)
    visible: Any = None  # int32 [b, s_q]: a causal shard's visible keys (dense, ``DecodeConfig.visible``)
    q: Any = None  # bf16 [b, s_q, h, 576]: quantized into q_nope / q_rope / q_scale first
    q_lo: Any = None  # e4m3 [b, s_q, h, 512]: the residual's codes (``DecodeConfig.q_split``)


class KernelArgs(NamedTuple):
    """The decode kernel's views of a step's tensors: rows (R = s_q·h) first, the request /
    page / split index last (``step.DecodeStepKernel.dense_views`` / ``sparse_views``)."""

    q_nope: Any  # uint8 (R, 512, b)
    q_rope: Any  # bf16 (R, 64, b)
    q_scale: Any  # fp32 (R, b)
    kv_content: Any  # uint8 (page_size, 512, pages)
    kv_rope: Any  # bf16 (page_size, 64, pages)
    kv_scale: Any  # fp32 (page_size, pages)
    block_table: Any  # int32 (b, max_pages); sparse: the index lists (b, topk)
    seqlens: Any  # int32 (b,)
    sched: Any  # int32 (parts, 8)
    split_offsets: Any  # int32 (b + 1,)
    out: Any  # bf16 (R, 512, b)
    lse: Any  # fp32 (b, h, s_q)
    o_partial: Any  # fp32 (R, 512, splits)
    lse_partial: Any  # fp32 (R, splits)
    counters: Any  # int32 (b, 2·m_tiles), zero between calls
    scale_log2: Any  # fp32
    visible: Any = None  # int32 (s_q, b): ``DecodeConfig.visible``'s counts
    q_lo: Any = None  # uint8 (R, 512, b): ``DecodeConfig.q_split``'s residual codes


def entry_signature(bundle: type) -> inspect.Signature:
    """A compiled entry's signature from a bundle: ``self``, the bundle's required fields,
    ``stream``, then its optional fields with their defaults."""
    P = inspect.Parameter
    required = [f for f in bundle._fields if f not in bundle._field_defaults]
    optional = [f for f in bundle._fields if f in bundle._field_defaults]
    return inspect.Signature(
        [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(f, P.POSITIONAL_OR_KEYWORD) for f in required]
        + [P("stream", P.POSITIONAL_OR_KEYWORD)]
        + [P(f, P.POSITIONAL_OR_KEYWORD, default=bundle._field_defaults[f]) for f in optional]
    )


def from_entry(bundle: type, args: tuple):
    """``(bundle, stream)`` from an entry's positional arguments (``entry_signature``'s order)."""
    n = len(bundle._fields) - len(bundle._field_defaults)
    return bundle(*args[:n], *args[n + 1:]), args[n]


def fake_call(args: NamedTuple, stream) -> tuple:
    """A bundle and a stream as an entry's positional arguments (``entry_signature``'s
    order): what ``cute.compile`` takes after the kernel."""
    n = len(args._fields) - len(args._field_defaults)
    return (*args[:n], stream, *args[n:])
