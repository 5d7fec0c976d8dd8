"""The FP8 cache format: allocation, views, byte layout, validation (CPU)."""

import pytest
import torch

from snapmla_cute import FP8KVCache
from snapmla_cute import reference as ref


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_allocate_shapes_and_views(page_size):
    cache = FP8KVCache.allocate(5, page_size, device="cpu")
    assert cache.kv.shape == (5, page_size, 640) and cache.kv.dtype == torch.uint8
    assert cache.kv_scale.shape == (5, page_size) and cache.kv_scale.dtype == torch.float32
    assert cache.content.shape == (5, page_size, 512) and cache.content.dtype == torch.float8_e4m3fn
    assert cache.rope.shape == (5, page_size, 64) and cache.rope.dtype == torch.bfloat16
    assert cache.num_slots == 5 * page_size
    assert (cache.kv.numel() + 4 * cache.kv_scale.numel()) / cache.num_slots == 644


def test_default_page_size_is_64():
    assert FP8KVCache.allocate(1, device="cpu").page_size == 64


def test_byte_layout_matches_the_docstring(seed):
    cache = FP8KVCache.allocate(3, 16, device="cpu")
    x = (torch.randn(48, 576) * 3).bfloat16()
    c, r, s = ref.quantize_rows(x)
    cache.kv.view(-1, 640)[:] = ref.pack_kv_rows(c, r)
    cache.kv_scale.view(-1)[:] = s
    # bytes 0..511: e4m3 content; 512..639: little-endian bf16 RoPE
    assert torch.equal(cache.content.reshape(-1, 512).view(torch.uint8), c.view(torch.uint8))
    assert torch.equal(cache.rope.reshape(-1, 64), r)
    lo, hi = cache.kv.view(-1, 640)[:, 512].int(), cache.kv.view(-1, 640)[:, 513].int()
    assert torch.equal(lo | (hi << 8), r[:, 0].view(torch.int16).int() & 0xFFFF)
    content, rope, scale = cache.flat()
    assert content.shape == (48, 512) and content.stride() == (640, 1)
    assert rope.shape == (48, 64) and rope.stride() == (320, 1) and torch.equal(rope, r)
    assert torch.equal(scale, s)


def test_fill_nan_poisons_everything():
    cache = FP8KVCache.allocate(2, 16, device="cpu", fill_nan=True)
    assert torch.isnan(cache.content.float()).all()
    assert torch.isnan(cache.rope.float()).all()
    assert torch.isnan(cache.kv_scale).all()


@pytest.mark.parametrize(
    "kv, scale, exc, words",
    [
        (torch.zeros(2, 64, 640), torch.zeros(2, 64), TypeError, "uint8"),
        (torch.zeros(2, 64, 576, dtype=torch.uint8), torch.zeros(2, 64), ValueError, "640"),
        (torch.zeros(2, 48, 640, dtype=torch.uint8), torch.zeros(2, 48), ValueError, "page_size"),
        (torch.zeros(2, 64, 640, dtype=torch.uint8), torch.zeros(2, 64, dtype=torch.float64), TypeError, "float32"),
        (torch.zeros(2, 64, 640, dtype=torch.uint8), torch.zeros(3, 64), ValueError, "num_pages, page_size"),
        (torch.zeros(64, 2, 640, dtype=torch.uint8).transpose(0, 1), torch.zeros(2, 64), ValueError, "contiguous"),
    ],
)
def test_wrapping_validates(kv, scale, exc, words):
    with pytest.raises(exc, match=words):
        FP8KVCache(kv, scale)


@pytest.mark.parametrize("page_size", [0, 8, 48, 256])
def test_allocate_rejects_page_sizes(page_size):
    with pytest.raises(ValueError, match="page_size"):
        FP8KVCache.allocate(2, page_size, device="cpu")
