"""GPU debug: which tensor-core accumulation model does the kernel follow?"""

import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case  # noqa: E402

import snapmla_cute.ops as ops  # noqa: E402
from snapmla_cute import decode_metadata, mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402

for b, s_q, h, ps, lens, causal, parts in [
    (1, 1, 128, 64, [640], False, 1000),
    (2, 1, 128, 64, [8192, 100], False, 1),
    (3, 2, 32, 16, [0, 77, 3000], True, None),
    (4, 4, 16, 32, [5, 64, 65, 4000], True, None),
]:
    c = build_case(b, s_q, h, ps, lens, seed=11)
    md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h, num_parts=parts)
    out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, metadata=md)
    torch.cuda.synchronize()
    cache = (c["cache"].kv, c["cache"].kv_scale)
    res = []
    for mma in ("fp32", "sm90"):
        oe, le = ref.mla_decode_emulated(c["q"], cache, c["block_table"], c["cache_seqlens"], causal=causal, mma=mma)
        res.append(f"{mma}: {ref.rel_l2(out.float(), oe.bfloat16().float()):.2e} lse {ref.lse_max_abs(lse, le):.1e}")
    if parts and parts > 1:  # fp32 partials of single blocks: no bf16 rounding in the way
        oe, _ = ref.mla_decode_emulated(c["q"], cache, c["block_table"], c["cache_seqlens"], causal=causal, mma="sm90")
    print(f"b{b} s_q{s_q} h{h} ps{ps} {lens} causal={causal}: " + " | ".join(res), flush=True)
