"""GPU debug: where (which rows) does the kernel differ from the emulation?"""

import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case  # noqa: E402

import snapmla_cute.ops as ops  # noqa: E402
from snapmla_cute import decode_metadata, mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402

for tuning in ({}, {"qk_promote": 1}):
    ops.DECODE_TUNING.clear()
    ops.DECODE_TUNING.update(tuning)
    for b, s_q, h, lens, parts in [(1, 1, 128, [640], 1000), (2, 1, 128, [8192, 100], 1), (2, 1, 32, [8192, 100], 1)]:
        c = build_case(b, s_q, h, 64, lens, seed=11)
        md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h, num_parts=parts)
        out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
        oe, le = ref.mla_decode_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"], c["cache_seqlens"])
        oe = oe.bfloat16().float()
        d = (out.float() - oe).pow(2).sum(-1)[0, 0]  # request 0: per head
        n = oe.pow(2).sum(-1)[0, 0]
        per16 = [f"{(d[i:i + 16].sum() / n[i:i + 16].sum()).sqrt().item():.1e}" for i in range(0, h, 16)]
        worst = (d / n).sqrt().topk(3)
        print(f"{tuning} b{b} h{h} {lens}: total {ref.rel_l2(out.float(), oe):.2e} per16 {per16} worst heads {worst.indices.tolist()} {[f'{v:.1e}' for v in worst.values.tolist()]}", flush=True)
