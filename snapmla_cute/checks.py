"""Argument checks of the torch API: structural ones (dtype, shape, contiguity, device),
which raise what was expected and what came, and value checks (finite inputs, slot ranges),
which read back to the host once per call and are skipped under CUDA-graph capture."""

from __future__ import annotations

import math

import torch


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_capture_ready(op: str, maker: str, metadata, out, lse):
    """Under CUDA-graph capture a call must get its metadata (made by ``maker`` before the
    capture), ``out`` and ``lse``: nothing may be allocated inside the captured region."""
    if capturing() and (metadata is None or out is None or lse is None):
        raise ValueError(
            f"{op} under CUDA-graph capture needs metadata (from {maker}, made before capture), out and lse: "
            "nothing may be allocated inside the captured region"
        )


def check_tensor(
    name: str, t, dtype: torch.dtype, *, dim: int | None = None, last: int | None = None, rows_strided: bool = False
):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dims, got shape {tuple(t.shape)}")
    if last is not None and (t.dim() == 0 or t.shape[-1] != last):
        raise ValueError(f"{name}: expected last dim {last}, got shape {tuple(t.shape)}")
    if rows_strided:  # any row stride (e.g. a slice of a wider table), unit inner stride
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected unit stride in the last dim, got strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_cuda(**tensors):
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")


def check_same_device(**tensors):
    devices = {name: (t if isinstance(t, torch.device) else t.device) for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


def check_softmax_scale(softmax_scale):
    """``None`` (the default 576^-0.5) or a finite float > 0."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {softmax_scale!r}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_disjoint(written: dict, read: dict):
    """Each tensor of ``written`` (name: tensor, or None) shares no byte with another tensor of
    ``written`` or ``read``: a kernel writing one while other CTAs read the other would race."""
    w = [(n, _byte_span(t)) for n, t in written.items() if t is not None]
    r = [(n, _byte_span(t)) for n, t in read.items() if t is not None]
    for i, (a, (a0, a1)) in enumerate(w):
        for b, (b0, b1) in w[i + 1:] + r:
            if a0 < b1 and b0 < a1:
                raise ValueError(
                    f"{a} and {b}: expected separate memory, got overlapping bytes "
                    f"[{a0:#x}, {a1:#x}) and [{b0:#x}, {b1:#x})"
                )


def check_plan_buffers(sched, split_offsets, o_partial, lse_partial, counters, *, lists: int, rows: int,
                       counters_shape: tuple, max_lists: int, max_parts: int):
    """The buffers of a split-KV plan handed in by the caller (the custom ops' metadata): the
    kernel indexes them by sizes its argument decoder does not tie, so a short one would be
    written past its end."""
    try:  # the custom ops' per-call path: one expression when all is well
        parts = sched.shape[0]
        if (1 <= lists <= max_lists and 1 <= parts <= max_parts and sched.shape == (parts, 8)
                and split_offsets.shape == (lists + 1,) and o_partial.shape[0] >= lists + parts
                and o_partial.shape[1:] == (rows, 512) and lse_partial.shape == o_partial.shape[:2]
                and counters.shape == counters_shape and sched.dtype == split_offsets.dtype == counters.dtype
                == torch.int32 and o_partial.dtype == lse_partial.dtype == torch.float32):
            return
    except (AttributeError, IndexError, TypeError):
        pass
    for name, t, dtype in (("sched", sched, torch.int32), ("split_offsets", split_offsets, torch.int32),
                           ("o_partial", o_partial, torch.float32), ("lse_partial", lse_partial, torch.float32),
                           ("counters", counters, torch.int32)):
        check_tensor(name, t, dtype)
    if not 1 <= lists <= max_lists:
        raise ValueError(f"split_offsets: expected 1..{max_lists} requests (+1 entries), got shape {tuple(split_offsets.shape)}")
    parts = sched.shape[0] if sched.dim() == 2 else -1
    if sched.dim() != 2 or sched.shape[1] != 8 or not 1 <= parts <= max_parts:
        raise ValueError(f"sched: expected shape (parts, 8) with 1 <= parts <= {max_parts}, got {tuple(sched.shape)}")
    if tuple(split_offsets.shape) != (lists + 1,):
        raise ValueError(f"split_offsets: expected shape ({lists + 1},), got {tuple(split_offsets.shape)}")
    n = lists + parts  # each part boundary adds at most one split
    if o_partial.dim() != 3 or o_partial.shape[0] < n or tuple(o_partial.shape[1:]) != (rows, 512):
        raise ValueError(f"o_partial: expected shape (>= {n}, {rows}, 512), got {tuple(o_partial.shape)}")
    if tuple(lse_partial.shape) != tuple(o_partial.shape[:2]):
        raise ValueError(f"lse_partial: expected shape {tuple(o_partial.shape[:2])}, got {tuple(lse_partial.shape)}")
    if tuple(counters.shape) != tuple(counters_shape):
        raise ValueError(f"counters: expected shape {tuple(counters_shape)}, got {tuple(counters.shape)}")


def check_values(*, finite=(), slots=(), ranges=(), extra=None):
    """The value checks of a call with one host sync: ``finite`` (name, tensor) must hold
    no NaN/Inf, ``slots`` (name, int64 tensor, num_slots) must lie in [0, num_slots) or be -1,
    ``ranges`` (name, integer tensor, lo, hi) in [lo, hi]; ``extra`` (int64 tensor, check)
    reads more values in the same sync and hands them to ``check`` (which raises). Skipped
    under CUDA-graph capture (the kernels skip a slot outside the cache themselves)."""
    if capturing():
        return
    finite = [(n, t) for n, t in finite if t.numel()]
    slots = [(n, t, k) for n, t, k in slots if t.numel()]
    ranges = [(n, t, lo, hi) for n, t, lo, hi in ranges if t.numel()]
    parts = [_all_finite(t).to(torch.int64).view(1) for _, t in finite]
    parts += [torch.stack([t.min(), t.max()]).to(torch.int64) for _, t, _ in slots]
    parts += [torch.stack([t.min(), t.max()]).to(torch.int64) for _, t, _, _ in ranges]
    if extra is not None:
        parts.append(extra[0].to(torch.int64).view(-1))
    if not parts:
        return
    vals = torch.cat(parts).tolist()  # the one sync
    for i, (name, _) in enumerate(finite):
        if not vals[i]:
            raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    for j, (name, _, num_slots) in enumerate(slots):
        lo, hi = vals[len(finite) + 2 * j : len(finite) + 2 * j + 2]
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"{name}: expected slot ids in [0, {num_slots}) or -1, got values in [{lo}, {hi}]")
    base = len(finite) + 2 * len(slots)
    for j, (name, _, lo_ok, hi_ok) in enumerate(ranges):
        lo, hi = vals[base + 2 * j : base + 2 * j + 2]
        if lo < lo_ok or hi > hi_ok:
            raise ValueError(f"{name}: expected values in [{lo_ok}, {hi_ok}], got values in [{lo}, {hi}]")
    if extra is not None:
        extra[1](vals[base + 2 * len(ranges):])


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:  # no Inf; NaN is S.1111.111
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    return torch.isfinite(t).all()
