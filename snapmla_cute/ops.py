"""Public torch API: validate inputs, fetch the compiled kernel, launch.

Every check runs before any launch, so a bad call raises and writes nothing. Checks that
need the tensors' values (finite inputs, slot ranges) read them back to the host; they are
skipped while a CUDA graph is being captured (no host sync is allowed there) and can be
switched off with ``check=False`` on hot paths. The kernels themselves never write outside
the cache, whatever the slot values.
"""

from __future__ import annotations

import torch

from snapmla_cute import jit_cache
from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, ROPE_DIM
from snapmla_cute.kv_cache import FP8KVCache


_launchers: dict = {}


def _launcher(name: str):
    """The compiled TVM-FFI callable of kernel ``name`` (default config), looked up once."""
    fn = _launchers.get(name)
    if fn is None:
        fn = _launchers[name] = jit_cache.compile_kernel(name).fn
    return fn


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_tensor(name: str, t, dtype: torch.dtype, *, dim: int | None = None, last: int | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dims, got shape {tuple(t.shape)}")
    if last is not None and (t.dim() == 0 or t.shape[-1] != last):
        raise ValueError(f"{name}: expected last dim {last}, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _check_cuda(**tensors):
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")


def _check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


def _check_finite(name: str, t: torch.Tensor, check: bool):
    if check and not _capturing() and t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")


def _check_slots(name: str, slots: torch.Tensor, num_slots: int, check: bool):
    if check and not _capturing() and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"{name}: expected slot ids in [0, {num_slots}) or -1, got values in [{lo}, {hi}]"
            )


def quantize_q(
    q: torch.Tensor, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused-Q-Quant: bf16 ``q [b, s_q, h, 576]`` → the FP8 decode query, in one launch.

    Returns ``q_nope`` float8_e4m3fn ``[b, s_q, h, 512]`` (content / σ_q), ``q_rope`` bf16
    ``[b, s_q, h, 64]`` (RoPE / σ_q, Eq. 6) and ``q_scale`` fp32 ``[b, s_q, h]`` with
    σ_q = max(amax|q_content|, 1e-6) / 448 per (token, head). Bit-exact with
    ``reference.quantize_rows``.
    """
    _check_tensor("q", q, torch.bfloat16, dim=4, last=HEAD_DIM)
    _check_cuda(q=q)
    _check_finite("q", q, check)
    lead = q.shape[:-1]
    q_nope = torch.empty(*lead, CONTENT_DIM, dtype=torch.float8_e4m3fn, device=q.device)
    q_rope = torch.empty(*lead, ROPE_DIM, dtype=torch.bfloat16, device=q.device)
    q_scale = torch.empty(*lead, dtype=torch.float32, device=q.device)
    if q.numel():
        rows = q.view(-1, HEAD_DIM)
        _launcher("quant_q")(
            rows[:, :CONTENT_DIM],
            rows[:, CONTENT_DIM:],
            q_nope.view(torch.uint8).view(-1, CONTENT_DIM),
            q_rope.view(-1, ROPE_DIM),
            q_scale.view(-1),
        )
    return q_nope, q_rope, q_scale


def append_kv(
    cache: FP8KVCache, kv: torch.Tensor, slot_mapping: torch.Tensor, *, check: bool = True
) -> None:
    """Fused-K-Append: quantize bf16 ``kv [n, 576]`` and write it to ``cache`` at ``slot_mapping``.

    ``slot_mapping`` int64 ``[n]``: slot = page * page_size + offset, ``-1`` skips the row.
    One launch writes e4m3 content, pre-divided bf16 RoPE and the fp32 scale of each token,
    bit-exact with ``reference.quantize_rows``. Two rows with the same slot race (as in
    every paged-append kernel); callers give distinct slots.
    """
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
    _check_finite("kv", kv, check)
    _check_slots("slot_mapping", slot_mapping, cache.num_slots, check)
    if kv.shape[0]:
        _launcher("append_kv")(
            kv[:, :CONTENT_DIM], kv[:, CONTENT_DIM:], slot_mapping, *cache.flat()
        )


def dequantize_kv(
    cache: FP8KVCache, slots: torch.Tensor, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Fused-Fetch-Dequant: gather ``slots`` (int64 ``[n]``) and return bf16 ``[n, 576]``.

    Content: bf16(e4m3 · σ); RoPE: bf16(rope · σ) — the tokens' values back in their own
    domain, for chunked prefill or prefix caching. A slot of ``-1`` gives a zero row.
    """
    if not isinstance(cache, FP8KVCache):
        raise TypeError(f"cache: expected FP8KVCache, got {type(cache).__name__}")
    _check_tensor("slots", slots, torch.int64, dim=1)
    _check_cuda(slots=slots, cache=cache.kv)
    _check_same_device(slots=slots, cache=cache.kv)
    n = slots.shape[0]
    if out is None:
        out = torch.empty(n, HEAD_DIM, dtype=torch.bfloat16, device=slots.device)
    else:
        _check_tensor("out", out, torch.bfloat16, dim=2, last=HEAD_DIM)
        _check_cuda(out=out)
        if out.shape[0] != n:
            raise ValueError(f"out: expected shape ({n}, {HEAD_DIM}), got {tuple(out.shape)}")
        _check_same_device(out=out, slots=slots)
    _check_slots("slots", slots, cache.num_slots, check)
    if n:
        _launcher("dequant_kv")(
            *cache.flat(), slots, out[:, :CONTENT_DIM], out[:, CONTENT_DIM:]
        )
    return out
