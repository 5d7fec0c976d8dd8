"""GPU: the whole-request plan against the split-everywhere plan, same build and run
(``DECODE_TUNING whole_plans`` True / False, default part counts, graph-replay µs): which
plan the rule picked (splits written = lists: whole requests) and what it gained. The
``whole_plans=False`` kernel is the one before the rule (same SASS), so this is the A/B.

    python3 profiles/experiments/whole_plans.py [--reps 2] [--only h64]
"""

import argparse

from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case, make_sparse_case

# (b, h, s_q, s_k, varlen, topk): dense where topk is 0
ROWS = [
    (64, 64, 1, 1024, False, 0), (64, 64, 1, 2048, False, 0), (64, 64, 1, 4096, False, 0),
    (96, 64, 1, 2048, False, 0), (96, 64, 1, 4096, False, 0), (96, 64, 1, 16384, False, 0),
    (110, 64, 1, 2048, False, 0), (32, 64, 1, 8192, False, 0),
    (80, 64, 1, 1024, True, 0), (96, 64, 1, 1024, True, 0), (96, 64, 1, 4096, True, 0), (112, 64, 1, 2048, True, 0),
    (40, 128, 1, 1024, False, 0), (48, 128, 1, 2048, False, 0), (56, 128, 1, 4096, False, 0),
    (56, 128, 1, 2048, True, 0), (8, 128, 1, 4096, False, 0), (1, 128, 1, 640, False, 0),
    (96, 16, 1, 2048, False, 0), (64, 16, 1, 2048, False, 0), (48, 64, 2, 2048, False, 0),
    (96, 64, 1, 8192, False, 2048), (64, 64, 1, 8192, False, 2048), (100, 16, 1, 8192, False, 2048),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--only", help="rows whose name contains this")
    a = ap.parse_args()
    table = []
    for b, h, s_q, s_k, varlen, topk in ROWS:
        kind = f"sparse topk{topk} of" if topk else ("varlen ~" if varlen else "s_k")
        name = f"b{b} h{h} s_q{s_q} {kind}{s_k}"
        if a.only and a.only not in name:
            continue
        sh = Shape(name, b, h, s_q, s_k, False, varlen=varlen, topk=topk)
        c = make_sparse_case(sh) if topk else make_case(sh)
        md = c["metadata"]
        lists = md.split_offsets.shape[0] - 1
        res = []
        for whole in (False, True):
            DECODE_TUNING.update(whole_plans=whole)
            try:
                c["step"]()
                splits = int(md.split_offsets[lists].item())
                us = min(time_us(c["step"]) for _ in range(a.reps))
            finally:
                DECODE_TUNING.clear()
            res.append((splits, us))
        (s0, t0), (s1, t1) = res
        table.append([name, md.num_parts, s0, s1, "whole" if s1 == lists else "split", round(t0, 1), round(t1, 1),
                      f"{100 * (t1 / t0 - 1):+.1f}%"])
        print(table[-1], flush=True)
    from tabulate import tabulate

    print(tabulate(table, headers=["shape", "parts", "splits (split plan)", "splits (rule)", "rule picked",
                                   "split plan µs", "rule µs", "Δ"]))


if __name__ == "__main__":
    main()
