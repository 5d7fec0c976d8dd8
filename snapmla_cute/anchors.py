"""Reference figures measured on the lent GPUs (2026-11-21, torch 2.11, triton do_bench medians).

FlashMLA BF16 dense decode (page 64, randn/10 KV, shuffled pages, causal for s_q > 1) and
device ceilings, per device kind. Timings compare only within one kind.
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
