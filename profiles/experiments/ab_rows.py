"""GPU: the same dense and sparse rows timed by two builds of the package, for an A/B of a
change that no ``DecodeConfig`` switch holds (graph-replay µs, the bench's cases).

Run it once per build, then join (``PYTHONPATH`` puts a non-editable install of the other
build first, e.g. ``pip install --no-deps --target /tmp/base_site <tree of the base commit>``):

    PYTHONPATH=/tmp/base_site:$PYTHONPATH python3 profiles/experiments/ab_rows.py --json base.json
    python3 profiles/experiments/ab_rows.py --json new.json
    python3 profiles/experiments/ab_rows.py --table base.json new.json [base2.json ...]
"""

import argparse
import json

# dense: (b, h, s_k); sparse: (b, h, s_q, topk, s_k)
DENSE = [(128, 128, 640), (64, 64, 2048), (128, 128, 2048), (1, 128, 640), (32, 64, 8192)]
SPARSE = [(64, 8, 1, 2048, 8192), (128, 8, 2, 2048, 8192), (128, 16, 1, 2048, 8192), (64, 64, 1, 2048, 8192),
          (128, 128, 1, 2048, 8192), (1, 8, 1, 2048, 8192), (32, 64, 1, 8192, 16384), (1, 128, 1, 2048, 8192)]


def time_rows(reps: int):
    import snapmla_cute
    from snapmla_cute.bench import time_us
    from snapmla_cute.profiling import Shape, make_case, make_sparse_case

    print("package:", snapmla_cute.__file__, flush=True)
    shapes = [Shape(f"dense b{b} h{h} s_k{s_k}", b, h, 1, s_k, False) for b, h, s_k in DENSE] + [
        Shape(f"sparse b{b} h{h} s_q{s_q} topk{topk}", b, h, s_q, s_k, False, topk=topk)
        for b, h, s_q, topk, s_k in SPARSE
    ]
    rows = {}
    for sh in shapes:
        step = (make_sparse_case(sh) if sh.topk else make_case(sh))["step"]
        rows[sh.name] = [time_us(step) for _ in range(reps)]
        print(sh.name, [round(us, 1) for us in rows[sh.name]], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="time the rows with the importable package, write them here")
    ap.add_argument("--reps", type=int, default=3, help="timings per row (each a graph-replay median)")
    ap.add_argument("--table", nargs="+", help="join these JSON files into one table (min over reps)")
    a = ap.parse_args()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(time_rows(a.reps), f)
    if a.table:
        from tabulate import tabulate

        runs = [json.load(open(p)) for p in a.table]
        table = [[row] + [round(min(r[row]), 1) if row in r else None for r in runs] for row in runs[0]]
        print(tabulate(table, headers=["row"] + a.table))


if __name__ == "__main__":
    main()
