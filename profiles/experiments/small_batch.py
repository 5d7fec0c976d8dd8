"""GPU: small-batch decode time against the number of parts (CTAs per query tile), and with
every compute stage left out (the fixed cost of a CTA: launch, plan, loads, merge).

    python3 profiles/experiments/small_batch.py
"""

import snapmla_cute.decode as ops  # its DECODE_TUNING is tuning.DECODE_TUNING
from snapmla_cute import decode_metadata
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case


def main():
    rows = []
    for b, L in ((1, 640), (1, 4096), (1, 32768), (8, 4096)):
        c = make_case(Shape(f"b{b} s_k{L}", b, 128, 1, L, False))
        q, cache, bt, lens, out, lse = (c[k] for k in ("q", "cache", "block_table", "seqlens", "out", "lse"))
        default = c["metadata"].num_parts
        for parts in sorted({1, 2, 4, 8, 16, 33, 66, default}):
            md = decode_metadata(lens, s_q=1, heads=128, num_parts=parts)
            us = time_us(lambda: ops.mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False))
            rows.append((f"b{b} s_k{L}", f"{parts}{' (default)' if parts == default else ''}", "full", us))
            print(rows[-1], flush=True)
        for skip in (("qk", "pv", "transpose", "softmax"),):
            ops.DECODE_TUNING.update(skip=skip)
            md = c["metadata"]
            us = time_us(lambda: ops.mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False))
            ops.DECODE_TUNING.clear()
            rows.append((f"b{b} s_k{L}", f"{default}", "no compute", us))
    print(f"{'shape':14s} {'parts':14s} {'variant':12s} {'us':>8s}")
    for r in rows:
        print(f"{r[0]:14s} {r[1]:14s} {r[2]:12s} {r[3]:8.1f}")


if __name__ == "__main__":
    main()
