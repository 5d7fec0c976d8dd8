"""GPU debug: run a few decode cases and print errors against both references."""

import sys
import time

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case, references  # noqa: E402

from snapmla_cute import mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402

cases = [
    (1, 1, 128, 64, [640], False),
    (2, 1, 16, 64, [100, 1000], False),
    (3, 2, 32, 16, [0, 77, 3000], True),
    (4, 4, 16, 32, [5, 64, 65, 4000], True),
    (2, 1, 64, 128, [9000, 130], False),
]
for b, s_q, h, ps, lens, causal in cases:
    t0 = time.time()
    c = build_case(b, s_q, h, ps, lens, seed=b * 7 + h)
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, s_q), float("nan"), device="cuda")
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, out=out, lse=lse)
    torch.cuda.synchronize()
    (ox, lx), (oe, le) = references(c, causal)
    print(
        f"b{b} s_q{s_q} h{h} ps{ps} lens{lens} causal={causal}: nan={int(torch.isnan(out.float()).sum())} "
        f"emu relL2={ref.rel_l2(out.float(), oe):.2e} vs-bf16={ref.rel_l2(out.float(), oe.bfloat16().float()):.2e} lse={ref.lse_max_abs(lse, le):.2e} | "
        f"exact relL2={ref.rel_l2(out.float(), ox):.2e} cos={ref.cos_diff(out.float(), ox):.2e} "
        f"emu-vs-exact={ref.rel_l2(oe, ox):.2e} ({time.time() - t0:.1f}s)",
        flush=True,
    )

from snapmla_cute.bench import time_us  # noqa: E402
from snapmla_cute import decode_metadata, quantize_q  # noqa: E402

for b, h, s_q, L in [(128, 128, 1, 4096), (32, 64, 1, 8192), (1, 128, 1, 640), (128, 128, 2, 8192)]:
    c = build_case(b, s_q, h, 64, [L] * b, seed=1)
    qq = quantize_q(c["q"])
    md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h)
    fn = lambda: mla_decode(qq, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, causal=s_q > 1, check=False)
    us = time_us(fn)
    nbytes = b * L * 644 + b * s_q * h * (576 * 2 + 512 * 2)
    flops = 2 * (576 + 512) * b * s_q * h * L
    print(f"b{b} h{h} s_q{s_q} s_k{L}: {us:.1f} us  {nbytes / us / 1e3:.0f} GB/s  {flops / us / 1e6:.0f} TFLOPS", flush=True)
