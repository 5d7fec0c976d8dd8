"""Reference figures measured on the lent GPUs, per device kind (timings compare only
within one kind): FlashMLA BF16 dense decode (2026-11-21, torch 2.11, triton do_bench medians;
page 64, randn/10 KV, shuffled pages, causal for s_q > 1), FlashMLA's Hopper kernels side by
side (2026-11-23, below), device ceilings, and the latency targets of ``bench latency``.
"""

FLASHMLA_BF16_US = {
    # (b, h, s_q, s_k, varlen): (H100 µs, H200 µs)
    (128, 128, 1, 1024, False): (85.0, 74.9),
    (128, 128, 1, 4096, False): (263.9, 250.1),
    (128, 128, 1, 8192, False): (531.2, 513.9),
    (128, 128, 1, 16384, False): (1034.1, 1027.3),
    (128, 128, 1, 32768, False): (2124.7, 2098.3),
    (128, 128, 2, 4096, False): (477.4, 474.8),
    (128, 128, 2, 8192, False): (922.5, 922.8),
    (128, 128, 1, 8192, True): (579.5, 531.7),
    (32, 64, 1, 8192, False): (131.7, None),
    (128, 128, 1, 640, False): (63.8, None),
    (1, 128, 1, 640, False): (17.0, None),
}

CEILINGS = {
    "H100": dict(copy_tbps=3.02, mixed_fp8_tflops=1560.0),
    "H200": dict(copy_tbps=4.27, mixed_fp8_tflops=1560.0),
}


def device_kind(name: str) -> str | None:
    for kind in CEILINGS:
        if kind in name:
            return kind
    return None


def flashmla_us(kind: str | None, b: int, h: int, s_q: int, s_k: int, varlen: bool) -> float | None:
    row = FLASHMLA_BF16_US.get((b, h, s_q, s_k, varlen))
    if row is None or kind is None:
        return None
    return row[0] if kind == "H100" else row[1]


# FlashMLA's Hopper decode kernels (sgl-flash-mla 1.0.0, 2026-11-23, CUDA-graph replay, page 64,
# KV randn/10 clamped to ±1, causal for s_q > 1): (BF16 dense µs, native dense FP8 µs) per
# device kind. The dense FP8 kernel (all 576 dims e4m3, per-tensor scales, 576 B/token) is the
# one vLLM's FlashMLA backend and TensorRT-LLM run on Hopper.
FLASHMLA_HOPPER_US = {
    # (b, h, s_q, s_k, varlen): {kind: (bf16 µs, dense fp8 µs)}
    (128, 128, 1, 4096, False): {"H100": (245.3, 221.8), "H200": (238.7, 225.1)},
    (128, 128, 1, 8192, False): {"H100": (529.6, 449.5), "H200": (518.8, 446.9)},
    (128, 128, 1, 32768, False): {"H100": (2027.8, 1680.1), "H200": (2080.9, 1704.2)},
    (128, 128, 2, 8192, False): {"H100": (975.3, 866.4), "H200": (1013.5, 852.2)},
    (32, 64, 1, 8192, False): {"H100": (120.9, 77.3), "H200": (89.5, 75.4)},
    (128, 128, 1, 640, False): {"H100": (53.8, 58.1), "H200": (48.2, 56.1)},
    (1, 128, 1, 640, False): {"H100": (12.2, 12.1), "H200": (12.1, 11.9)},
    (128, 128, 1, 8192, True): {"H100": (535.2, 460.4), "H200": (524.2, 457.8)},
    (128, 128, 1, 2048, False): {"H100": (131.1, 135.1), "H200": (118.9, 134.1)},
    (64, 64, 1, 2048, False): {"H100": (70.9, 57.2), "H200": (54.8, 48.6)},
    (128, 64, 1, 16384, False): {"H100": (873.6, 498.9), "H200": (646.4, 482.0)},
    (16, 16, 1, 65536, False): {"H100": (412.4, 243.8), "H200": (292.3, 239.7)},
}


def peer_us(kind: str | None, b: int, h: int, s_q: int, s_k: int, varlen: bool) -> dict:
    """FlashMLA's figures for a shape on this device kind: ``bf16`` (the 2026-11-23 run, else
    the 2026-11-21 one) and ``dense_fp8``; None where not measured."""
    row = FLASHMLA_HOPPER_US.get((b, h, s_q, s_k, varlen), {}).get(kind)
    bf16 = row[0] if row else flashmla_us(kind, b, h, s_q, s_k, varlen)
    return dict(bf16=bf16, dense_fp8=row[1] if row else None)


def target_us(peers: dict, floor_us: float) -> float | None:
    """The decode's target for a shape: the slower of (best peer ÷ 1.3) and (floor ÷ 0.85)."""
    best = min((v for v in peers.values() if v), default=None)
    return round(max(best / 1.3, floor_us / 0.85), 1) if best else None


# FlashMLA's sparse FP8 decode (DeepSeek-V3.2 DSA, sgl-flash-mla 1.0.0; 656 B/token, dequantized
# to BF16 before BF16 MMAs) at V3.2-like shapes: each query token gets topk distinct random
# tokens of an s_k-token request, page 64, CUDA-graph replay (2026-11-23, H100 only)
FLASHMLA_SPARSE_US = {
    "H100": {
        # (b, h, s_q, topk, s_k): µs
        (128, 128, 1, 2048, 8192): 178.3,
        (128, 128, 2, 2048, 8192): 347.4,
        (64, 64, 1, 2048, 8192): 80.2,
        (64, 64, 2, 2048, 8192): 115.7,
        (32, 128, 1, 16384, 32768): 346.9,
        (1, 128, 1, 2048, 8192): 18.8,
        (32, 64, 1, 8192, 16384): 132.3,
    },
}


# FlashMLA's sparse FP8 decode at h64: what an engine pays today when it pads 8 or 16 heads
# per GPU to 64, the fewest that kernel runs on Hopper (sgl-flash-mla 1.0.0, V3.2 656-byte
# format, topk distinct random tokens of an s_k-token request, page 64, CUDA-graph replay of
# 10 calls, median of 30; H100 80GB HBM3, 2026-11-24). Its b64 s_q1 and s_q2 rows (81.0,
# 116.1) repeat FLASHMLA_SPARSE_US's h64 rows (80.2, 115.7) from another run: the gap is
# run-to-run spread
FLASHMLA_SPARSE_H64_PADDED_US = {
    "H100": {
        # (b, s_q, topk, s_k): µs
        (64, 1, 2048, 8192): 81.0,
        (128, 2, 2048, 8192): 228.4,
        (32, 1, 16384, 32768): 228.5,
        (128, 1, 2048, 8192): 117.1,
        (64, 8, 2048, 8192): 425.8,
        (1, 1, 2048, 8192): 17.1,
        (64, 2, 2048, 8192): 116.1,
        (64, 4, 2048, 8192): 221.9,
    },
}


# ``snapmla-cute bench latency``'s targets, set for the H100 (none on other kinds): batches of
# 1-8, where launch latency, the in-kernel plan and the split merge set the time, not bandwidth
LATENCY_TARGETS_US = {
    "H100": {
        # ("dense", b, h, s_k) or ("sparse", b, h, topk, s_k), s_q 1: µs
        ("dense", 1, 128, 640): 9.0,
        ("dense", 1, 64, 8192): 11.0,
        ("dense", 8, 128, 8192): 19.0,
        ("sparse", 1, 128, 2048, 8192): 10.0,
        ("sparse", 1, 8, 2048, 8192): 8.0,
        ("sparse", 8, 8, 2048, 8192): 9.0,
    },
}


def latency_target_us(kind: str | None, spec: tuple) -> float | None:
    """The latency target of a ``bench latency`` row on this device kind, if one is set."""
    return LATENCY_TARGETS_US.get(kind, {}).get(spec) if kind else None
