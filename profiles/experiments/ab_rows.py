"""GPU: the same dense and sparse rows timed by two builds of the package, for an A/B of a
change that no ``DecodeConfig`` switch holds (graph-replay µs, the bench's cases); with
``--host``, the host µs of each row's ``check=False`` call instead (quantized query and, for
the dense rows, a bf16 one: ``timing.host_us_per_call``), the cost of the hot path's Python.

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


def time_rows(reps: int, host: bool = False, only=None):
    import snapmla_cute
    from snapmla_cute import mla_decode
    from snapmla_cute.bench import time_us
    from snapmla_cute.profiling import Shape, make_case, make_sparse_case
    from snapmla_cute.timing import host_us_per_call

    print("package:", snapmla_cute.__file__, flush=True)
    shapes = [Shape(f"dense b{b} h{h} s_k{s_k}", b, h, 1, s_k, False) for b, h, s_k in DENSE] + [
        Shape(f"sparse b{b} h{h} s_q{s_q} topk{topk}", b, h, s_q, s_k, False, topk=topk)
        for b, h, s_q, topk, s_k in SPARSE
    ]
    rows = {}
    for sh in shapes:
        if only and not any(o in sh.name for o in only):
            continue
        c = make_sparse_case(sh) if sh.topk else make_case(sh)
        calls = {sh.name: c["step"]}
        if host and not sh.topk:  # the same call from a bf16 query (quantized inside the step)
            calls[sh.name + " bf16 q"] = lambda c=c, sh=sh: mla_decode(
                c["q_bf16"], c["cache"], c["block_table"], c["seqlens"], causal=sh.causal, metadata=c["metadata"],
                out=c["out"], lse=c["lse"], check=False)
        for name, call in calls.items():
            rows[name] = [(host_us_per_call(call) if host else time_us(call)) for _ in range(reps)]
            print(name, [round(us, 2) for us in rows[name]], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="time the rows with the importable package, write them here")
    ap.add_argument("--reps", type=int, default=3, help="timings per row (each a graph-replay median)")
    ap.add_argument("--host", action="store_true", help="host µs per check=False call instead of GPU µs")
    ap.add_argument("--only", nargs="*", help="only the rows whose names contain one of these")
    ap.add_argument("--table", nargs="+", help="join these JSON files into one table (min over reps)")
    a = ap.parse_args()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(time_rows(a.reps, a.host, a.only), f)
    if a.table:
        from tabulate import tabulate

        runs = [json.load(open(p)) for p in a.table]
        table = [[row] + [round(min(r[row]), 2) if row in r else None for r in runs] for row in runs[0]]
        print(tabulate(table, headers=["row"] + a.table))


if __name__ == "__main__":
    main()
