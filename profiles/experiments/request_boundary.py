"""GPU: the cost of a request boundary inside a part (Q reload, pipeline drain and refill,
epilogue): b128 h128 s_q1 at two lengths over 16/32/64 parts (8/4/2 requests per part),
and the sensitivity to the KV ring depth (3 vs 4 stages).

    python3 profiles/experiments/request_boundary.py
"""

import snapmla_cute.decode as ops  # its DECODE_TUNING is tuning.DECODE_TUNING
from snapmla_cute import decode_metadata
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case


def main():
    rows = []
    for L in (640, 4096):
        c = make_case(Shape(f"b128 s_k{L}", 128, 128, 1, L, False))
        q, cache, bt, lens, out, lse = (c[k] for k in ("q", "cache", "block_table", "seqlens", "out", "lse"))
        for stages in (4, 3):
            ops.DECODE_TUNING.clear()
            if stages != 4:
                ops.DECODE_TUNING.update(kv_stages=stages)
            for parts in (16, 32, 64):
                md = decode_metadata(lens, s_q=1, heads=128, num_parts=parts)
                us = time_us(lambda: ops.mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False))
                rows.append((f"b128 s_k{L}", stages, parts, 128 // parts, us))
                print(rows[-1], flush=True)
        ops.DECODE_TUNING.clear()
        del c
    print(f"{'shape':14s} {'stages':>6s} {'parts':>6s} {'req/part':>8s} {'us':>8s}")
    for r in rows:
        print(f"{r[0]:14s} {r[1]:6d} {r[2]:6d} {r[3]:8d} {r[4]:8.1f}")


if __name__ == "__main__":
    main()
