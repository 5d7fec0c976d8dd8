"""Argument checks of the torch API: structural ones (dtype, shape, contiguity, device),
which raise what was expected and what came, and value checks (finite inputs, slot ranges),
which read back to the host once per call and are skipped under CUDA-graph capture."""

from __future__ import annotations

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


def check_values(*, finite=(), slots=(), ranges=()):
    """The value checks of a fused op with one host sync: ``finite`` (name, tensor) must hold
    no NaN/Inf, ``slots`` (name, int64 tensor, num_slots) must lie in [0, num_slots) or be -1,
    ``ranges`` (name, integer tensor, lo, hi) in [lo, hi]. Skipped under CUDA-graph capture
    (the kernels skip a slot outside the cache themselves)."""
    if capturing():
        return
    finite = [(n, t) for n, t in finite if t.numel()]
    slots = [(n, t, k) for n, t, k in slots if t.numel()]
    ranges = [(n, t, lo, hi) for n, t, lo, hi in ranges if t.numel()]
    parts = [torch.isfinite(t).all().to(torch.int64).view(1) for _, t in finite]
    parts += [torch.stack([t.min(), t.max()]).to(torch.int64) for _, t, _ in slots]
    parts += [torch.stack([t.min(), t.max()]).to(torch.int64) for _, t, _, _ in ranges]
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
