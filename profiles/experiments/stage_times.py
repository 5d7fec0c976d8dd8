"""GPU: decode time with one stage left out at a time (results are wrong on purpose), to
place the time inside the kernel without counters (METHOD.md), plus the step's parts.

    python3 profiles/experiments/stage_times.py
"""

import torch

import snapmla_cute.ops as ops
from snapmla_cute import decode_metadata, mla_decode
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import SHAPES, Shape


def case(shape: Shape):
    from snapmla_cute import FP8KVCache, quantize_q

    b, h, s_q, L, ps = shape.batch, shape.heads, shape.s_q, shape.seqlen, shape.page_size
    n = (L + ps - 1) // ps
    cache = FP8KVCache.allocate(b * n, ps, device="cuda")
    cache.kv.random_(0, 100)
    cache.kv_scale.fill_(1e-2)
    bt = torch.randperm(b * n, device="cuda", dtype=torch.int32).view(b, n)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    q = quantize_q(torch.randn(b, s_q, h, 576, device="cuda", dtype=torch.bfloat16))
    md = decode_metadata(lens, s_q=s_q, heads=h)
    out = torch.empty(b, s_q, h, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(b, h, s_q, device="cuda")
    return lambda: mla_decode(q, cache, bt, lens, causal=shape.causal, metadata=md, out=out, lse=lse, check=False), md, lens


def main():
    shapes = [SHAPES["s1"], Shape("b1 h128 s_q1 s_k640", 1, 128, 1, 640, False)]
    rows = []
    for sh in shapes:
        step, md, lens = case(sh)
        for skip in [(), ("transpose",), ("softmax",), ("pv",), ("qk",), ("qk", "pv"), ("qk", "pv", "transpose", "softmax")]:
            ops.DECODE_TUNING.clear()
            ops.DECODE_TUNING.update(skip=skip)
            rows.append((sh.name, "+".join(skip) or "full", time_us(step)))
            print(rows[-1], flush=True)
        ops.DECODE_TUNING.clear()
        rows.append((sh.name, "scheduler only", time_us(lambda: md.update(lens))))
        print(rows[-1], flush=True)
    print(f"{'shape':28s} {'left out':36s} {'us':>8s}")
    for r in rows:
        print(f"{r[0]:28s} {r[1]:36s} {r[2]:8.1f}")


if __name__ == "__main__":
    main()
