"""GPU debug: accuracy vs the emulation and time, per decode tuning variant."""

import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case  # noqa: E402

from snapmla_cute.tuning import DECODE_TUNING  # noqa: E402
from snapmla_cute import decode_metadata, emulation, mla_decode, quantize_q  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402
from snapmla_cute.bench import time_us  # noqa: E402

import ast  # noqa: E402

VARIANTS = [ast.literal_eval(a) for a in sys.argv[1:]] or [dict()]
acc_cases = [(1, 1, 128, 64, [640], False, 66), (2, 1, 128, 64, [8192, 100], False, 1), (3, 2, 32, 16, [0, 77, 3000], True, None)]
refs = []
for b, s_q, h, ps, lens, causal, parts in acc_cases:
    c = build_case(b, s_q, h, ps, lens, seed=11)
    oe, le = emulation.mla_decode_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"], c["cache_seqlens"], causal=causal)
    refs.append((c, oe.bfloat16().float(), le))
big = [(128, 128, 1, 4096), (128, 128, 2, 8192)]
big_cases = [build_case(b, s_q, h, 64, [L] * b, seed=1) for b, h, s_q, L in big]
for v in VARIANTS:
    DECODE_TUNING.clear()
    DECODE_TUNING.update(v)
    errs = []
    for (b, s_q, h, ps, lens, causal, parts), (c, oe, le) in zip(acc_cases, refs):
        md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h, num_parts=parts)
        out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, metadata=md)
        if torch.isnan(out.float()).any():
            print(f"NaN in case b{b} s_q{s_q} h{h} ps{ps} lens{lens} parts{parts}: "
                  f"{int(torch.isnan(out.float()).any(-1).sum())} rows", flush=True)
        errs.append(f"{ref.rel_l2(out.float(), oe):.2e}/{ref.lse_max_abs(lse, le):.0e}")
    times = []
    for (b, h, s_q, L), c in zip(big, big_cases):
        qq = quantize_q(c["q"])
        md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h)
        o = torch.empty(b, s_q, h, 512, device="cuda", dtype=torch.bfloat16)
        lz = torch.empty(b, h, s_q, device="cuda")
        times.append(f"{time_us(lambda: mla_decode(qq, c['cache'], c['block_table'], c['cache_seqlens'], metadata=md, causal=s_q > 1, out=o, lse=lz, check=False)):.0f}us")
    print(v, "emu relL2/lse:", errs, "times:", times, flush=True)
