"""The FP8 paged KV cache of one MLA layer (SnapMLA §3.1: RoPE-aware per-token quantization).

Byte layout of one token (644 bytes in all)::

    kv[page, slot, 0:512]    e4m3   content c_KV / σ             (512 B)
    kv[page, slot, 512:640]  bf16   RoPE k_R / σ, 64 values       (128 B, little-endian)
    kv_scale[page, slot]     fp32   σ = max(amax|c_KV|, 1e-6)/448  (4 B, separate tensor)

The RoPE part is kept in bf16 but already divided by the token's content scale (Eq. 6), so
one per-token factor σ rescales the whole 576-dim QK product and, fused into P, the PV
product. A slot is addressed as ``page * page_size + offset``; ``kv`` is contiguous, so
slot ``i`` is row ``i`` of ``kv.view(-1, 640)``.
"""

from __future__ import annotations

import torch

from snapmla_cute.format import CONTENT_DIM, DEFAULT_PAGE_SIZE, KV_ROW_BYTES, PAGE_SIZES, ROPE_DIM


class FP8KVCache:
    """One layer's FP8 MLA cache: ``kv`` uint8 ``[num_pages, page_size, 640]`` + ``kv_scale`` fp32.

    Build with :meth:`allocate` or wrap existing tensors (validated) with the constructor.
    """

    def __init__(self, kv: torch.Tensor, kv_scale: torch.Tensor):
        if not isinstance(kv, torch.Tensor) or not isinstance(kv_scale, torch.Tensor):
            raise TypeError(
                f"FP8KVCache: kv and kv_scale must be torch.Tensors, got {type(kv).__name__}, "
                f"{type(kv_scale).__name__}"
            )
        if kv.dtype != torch.uint8:
            raise TypeError(f"FP8KVCache: kv must be torch.uint8, got {kv.dtype}")
        if kv.dim() != 3 or kv.shape[2] != KV_ROW_BYTES:
            raise ValueError(
                f"FP8KVCache: kv must be [num_pages, page_size, {KV_ROW_BYTES}], got {tuple(kv.shape)}"
            )
        if kv.shape[1] not in PAGE_SIZES:
            raise ValueError(f"FP8KVCache: page_size must be one of {PAGE_SIZES}, got {kv.shape[1]}")
        if kv_scale.dtype != torch.float32:
            raise TypeError(f"FP8KVCache: kv_scale must be torch.float32, got {kv_scale.dtype}")
        if tuple(kv_scale.shape) != tuple(kv.shape[:2]):
            raise ValueError(
                f"FP8KVCache: kv_scale must be [num_pages, page_size] = {tuple(kv.shape[:2])}, "
                f"got {tuple(kv_scale.shape)}"
            )
        if kv.device != kv_scale.device:
            raise ValueError(f"FP8KVCache: kv on {kv.device} but kv_scale on {kv_scale.device}")
        if not kv.is_contiguous() or not kv_scale.is_contiguous():
            raise ValueError(
                f"FP8KVCache: kv and kv_scale must be contiguous, got strides {kv.stride()} and {kv_scale.stride()}"
            )
        if kv.data_ptr() % 16:
            raise ValueError(f"FP8KVCache: kv must be 16-byte aligned, got an address {kv.data_ptr() % 16} past it")
        self.kv = kv
        self.kv_scale = kv_scale
        self.page_size = kv.shape[1]  # a plain attribute: the decode hot path reads it per call
        self.step_args = (kv, kv_scale)  # what the decode step takes, prebuilt for the hot path
        # the sparse decode's: the cache as slots (it gathers by slot id, any page size)
        self.slot_args = (kv.view(-1, KV_ROW_BYTES), kv_scale.view(-1))

    @classmethod
    def allocate(
        cls,
        num_pages: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        device: torch.device | str = "cuda",
        fill_nan: bool = False,
    ) -> "FP8KVCache":
        """A new cache of ``num_pages * page_size`` slots, zeroed (or NaN-filled for tests)."""
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"FP8KVCache.allocate: num_pages must be a positive int, got {num_pages!r}")
        if page_size not in PAGE_SIZES:
            raise ValueError(f"FP8KVCache.allocate: page_size must be one of {PAGE_SIZES}, got {page_size!r}")
        kv = torch.zeros(num_pages, page_size, KV_ROW_BYTES, dtype=torch.uint8, device=device)
        kv_scale = torch.zeros(num_pages, page_size, dtype=torch.float32, device=device)
        cache = cls(kv, kv_scale)
        if fill_nan:
            cache.fill_nan()
        return cache

    def fill_nan(self) -> None:
        """Poisons every slot: NaN content bytes (0x7F), NaN RoPE and NaN scales."""
        self.kv[..., :CONTENT_DIM] = 0x7F  # e4m3fn NaN
        self.rope.fill_(float("nan"))
        self.kv_scale.fill_(float("nan"))

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def content(self) -> torch.Tensor:
        """e4m3 view ``[num_pages, page_size, 512]`` (shares memory)."""
        return self.kv[..., :CONTENT_DIM].view(torch.float8_e4m3fn)

    @property
    def rope(self) -> torch.Tensor:
        """bf16 view ``[num_pages, page_size, 64]`` of the pre-divided RoPE (shares memory)."""
        return self.kv.view(torch.bfloat16)[..., CONTENT_DIM // 2 :]

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot-major views for the kernels: content uint8 ``[S, 512]`` (row stride 640),
        RoPE bf16 ``[S, 64]`` (row stride 320), scale fp32 ``[S]``."""
        rows = self.kv.view(self.num_slots, KV_ROW_BYTES)
        return (
            rows[:, :CONTENT_DIM],
            rows.view(torch.bfloat16)[:, CONTENT_DIM // 2 : CONTENT_DIM // 2 + ROPE_DIM],
            self.kv_scale.view(self.num_slots),
        )

    def __repr__(self) -> str:
        return (
            f"FP8KVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"device={self.device}, bytes={self.kv.numel() + 4 * self.kv_scale.numel()})"
        )
