"""The fused memory-bound ops of SnapMLA §3.3.1 as torch calls: ``quantize_q`` (Fused-Q-Quant),
``append_kv`` (Fused-K-Append) and ``dequantize_kv`` (Fused-Fetch-Dequant).

Every check runs before any launch, so a bad call raises and writes nothing. With
``check=False`` a call is one compiled call: its argument decoder (in C) checks every
tensor, and a rejected call is explained by the same Python checks (``_run``). The kernels
never write outside the cache, whatever the slot values.
"""

from __future__ import annotations

import torch

from snapmla_cute.checks import check_cuda as _check_cuda
from snapmla_cute.checks import check_same_device as _check_same_device
from snapmla_cute.checks import check_tensor as _check_tensor
from snapmla_cute.checks import check_values as _check_values
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kernels import append_kv as _append_kv
from snapmla_cute.kernels import dequant_kv as _dequant_kv
from snapmla_cute.kernels import quant_q as _quant_q
from snapmla_cute.kv_cache import FP8KVCache
from snapmla_cute.tuning import launcher
from snapmla_cute.validation import check_precision

_hot_quant: dict = {}  # (q.shape, precision) -> quantize_q's compiled call (shapes already run once)


def _explained(validate, get):
    """``get()``, whose attribute reads fail on a non-tensor argument (``check=False`` skips
    the checks): then ``validate`` says what was expected and what came."""
    try:
        return get()
    except AttributeError:
        validate()
        raise


def _run(compile_fn, key, make_config, args, validate):
    """One compiled call with the tensors as they are; the argument decoder (in C) checks
    dtypes, shapes, strides and devices, and a rejected call is explained by ``validate``
    (the Python checks, which raise what was expected and what came; nothing is written)."""
    try:
        fn = launcher(compile_fn, key, make_config)
        fn(*args)
    except Exception:
        validate()
        raise  # the Python checks found nothing: the compiled call's own error stands


def _validate_quantize_q(q, out, precision="e4m3"):
    _check_tensor("q", q, torch.bfloat16, dim=4, last=HEAD_DIM)
    _check_cuda(q=q)
    split = check_precision(precision)
    if out is not None:
        names = "(q_nope, q_rope, q_scale, q_lo)" if split else "(q_nope, q_rope, q_scale)"
        if not isinstance(out, (tuple, list)) or len(out) != 3 + split:
            raise TypeError(f"out: expected {names} for q_precision {precision!r}, got {type(out).__name__}"
                            + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
        lead = q.shape[:-1]
        if split:
            _check_tensor("out[3]", out[3], torch.float8_e4m3fn, last=CONTENT_DIM)
            if out[3].shape[:-1] != lead:
                raise ValueError(f"out[3]: expected shape {(*lead, CONTENT_DIM)}, got {tuple(out[3].shape)}")
            _check_cuda(q_lo=out[3])
            _check_same_device(q=q, q_lo=out[3])
        q_nope, q_rope, q_scale = out[:3]
        _check_tensor("out[0]", q_nope, torch.float8_e4m3fn, last=CONTENT_DIM)
        _check_tensor("out[1]", q_rope, torch.bfloat16, last=ROPE_DIM)
        _check_tensor("out[2]", q_scale, torch.float32)
        if q_nope.shape[:-1] != lead or q_rope.shape[:-1] != lead or q_scale.shape != lead:
            raise ValueError(
                f"out: expected shapes {(*lead, CONTENT_DIM)}, {(*lead, ROPE_DIM)}, {tuple(lead)}, "
                f"got {tuple(q_nope.shape)}, {tuple(q_rope.shape)}, {tuple(q_scale.shape)}"
            )
        _check_cuda(q_nope=q_nope, q_rope=q_rope, q_scale=q_scale)
        _check_same_device(q=q, q_nope=q_nope, q_rope=q_rope, q_scale=q_scale)


def quantize_q(
    q: torch.Tensor, *, check: bool = True, out: tuple | None = None, precision: str = "e4m3"
) -> tuple[torch.Tensor, ...]:
    """Fused-Q-Quant: bf16 ``q [b, s_q, h, 576]`` → the FP8 decode query, in one launch.

    Returns ``q_nope`` float8_e4m3fn ``[b, s_q, h, 512]`` (content / σ_q), ``q_rope`` bf16
    ``[b, s_q, h, 64]`` (RoPE / σ_q, Eq. 6) and ``q_scale`` fp32 ``[b, s_q, h]`` with
    σ_q = max(amax|q_content|, 1e-6) / 448 per (token, head). Bit-exact with
    ``reference.quantize_rows``. ``out`` may give the three output tensors (no allocation).
    ``precision="e4m3x2"`` (the accurate mode) also returns ``q_lo`` float8_e4m3fn
    ``[b, s_q, h, 512]``, e4m3(content / σ_q - q_nope): the query as hi + lo on one scale, which
    ``mla_decode`` runs as a second QK content chain.
    With ``check=False`` and ``out`` given a call is one compiled call (its argument decoder
    checks every tensor; a rejection is explained by the Python checks); ``check`` also
    looks for NaN/Inf in ``q`` (one host sync).
    """
    # a compiled call takes its optional tensor too: None where the query is not split
    lo_absent = () if precision == "e4m3x2" else (None,)
    if not check and out is not None:
        fn = _hot_quant.get((getattr(q, "shape", None), precision))
        if fn is not None:  # a shape seen before: one compiled call, nothing else
            try:
                fn(q, *out, *lo_absent)
            except Exception:
                _validate_quantize_q(q, out, precision)
                raise
            return tuple(out)
    if check or out is None:
        _validate_quantize_q(q, out, precision)
        if check:
            _check_values(finite=(("q", q),))
        if out is None:
            lead = q.shape[:-1]
            out = (
                torch.empty(*lead, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=q.device),
                torch.empty(*lead, ROPE_DIM, dtype=torch.bfloat16, device=q.device),
                torch.empty(*lead, dtype=torch.float32, device=q.device),
            ) + ((torch.empty(*lead, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=q.device),)
                 if precision == "e4m3x2" else ())
    split = check_precision(precision)
    validate = lambda: _validate_quantize_q(q, out, precision)  # noqa: E731
    if _explained(validate, lambda: q.numel()):
        key = (*q.shape[1:3], split) if split else q.shape[1:3]
        _run(
            _quant_q.compile_call, key,
            lambda: _quant_q.QuantQCallConfig(q.shape[1], q.shape[2], _quant_q.QuantQConfig(split=split)),
            (q, *out, *lo_absent), validate,
        )
        _hot_quant[(q.shape, precision)] = launcher(_quant_q.compile_call, key)  # cached by _run
    return tuple(out)


def _validate_append_kv(cache, kv, slot_mapping):
    if not isinstance(cache, FP8KVCache):
        raise TypeError(f"cache: expected FP8KVCache, got {type(cache).__name__}")
    _check_tensor("kv", kv, torch.bfloat16, dim=2, last=HEAD_DIM)
    _check_tensor("slot_mapping", slot_mapping, torch.int64, dim=1)
    if slot_mapping.shape[0] != kv.shape[0]:
        raise ValueError(
            f"slot_mapping: expected {kv.shape[0]} entries (one per kv row), got {slot_mapping.shape[0]}"
        )
    _check_cuda(kv=kv, slot_mapping=slot_mapping, cache=cache.kv)
    _check_same_device(kv=kv, slot_mapping=slot_mapping, cache=cache.kv)


def append_kv(
    cache: FP8KVCache, kv: torch.Tensor, slot_mapping: torch.Tensor, *, check: bool = True
) -> None:
    """Fused-K-Append: quantize bf16 ``kv [n, 576]`` and write it to ``cache`` at ``slot_mapping``.

    ``slot_mapping`` int64 ``[n]``: slot = page * page_size + offset, ``-1`` skips the row.
    One launch writes e4m3 content, pre-divided bf16 RoPE and the fp32 scale of each token,
    bit-exact with ``reference.quantize_rows``. Two rows with the same slot race (as in
    every paged-append kernel); callers give distinct slots. ``check`` also checks the
    values (finite ``kv``, slots in range) with one host sync; with ``check=False`` a call is
    one compiled call, and a slot outside the cache is skipped by the kernel.
    """
    if check:
        _validate_append_kv(cache, kv, slot_mapping)
        _check_values(finite=(("kv", kv),), slots=(("slot_mapping", slot_mapping, cache.num_slots),))
    validate = lambda: _validate_append_kv(cache, kv, slot_mapping)  # noqa: E731
    n, ps = _explained(validate, lambda: (kv.shape[0], cache.page_size))
    if n:
        _run(
            _append_kv.compile_call, ps, lambda: _append_kv.AppendKVCallConfig(ps),
            (kv, slot_mapping, *cache.step_args), validate,
        )


def _validate_dequantize_kv(cache, slots, out):
    if not isinstance(cache, FP8KVCache):
        raise TypeError(f"cache: expected FP8KVCache, got {type(cache).__name__}")
    _check_tensor("slots", slots, torch.int64, dim=1)
    _check_cuda(slots=slots, cache=cache.kv)
    _check_same_device(slots=slots, cache=cache.kv)
    if out is not None:
        n = slots.shape[0]
        _check_tensor("out", out, torch.bfloat16, dim=2, last=HEAD_DIM)
        _check_cuda(out=out)
        if out.shape[0] != n:
            raise ValueError(f"out: expected shape ({n}, {HEAD_DIM}), got {tuple(out.shape)}")
        _check_same_device(out=out, slots=slots)


def dequantize_kv(
    cache: FP8KVCache, slots: torch.Tensor, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Fused-Fetch-Dequant: gather ``slots`` (int64 ``[n]``) and return bf16 ``[n, 576]``.

    Content: bf16(e4m3 · σ); RoPE: bf16(rope · σ) — the tokens' values back in their own
    domain, for chunked prefill or prefix caching. A slot of ``-1`` gives a zero row (so does
    any slot outside the cache with ``check=False``; ``check`` rejects it, one host sync).
    With ``check=False`` and ``out`` given a call is one compiled call.
    """
    if check or out is None:
        _validate_dequantize_kv(cache, slots, out)
        if check:
            _check_values(slots=(("slots", slots, cache.num_slots),))
        if out is None:
            out = torch.empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=slots.device)
    validate = lambda: _validate_dequantize_kv(cache, slots, out)  # noqa: E731
    n, ps = _explained(validate, lambda: (slots.shape[0], cache.page_size))
    if n:
        _run(
            _dequant_kv.compile_call, ps, lambda: _dequant_kv.DequantKVCallConfig(ps),
            (*cache.step_args, slots, out), validate,
        )
    return out
