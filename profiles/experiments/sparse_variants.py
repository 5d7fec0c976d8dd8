"""Timing-only variants of the sparse decode. Default: the shipped kernel against the dense
decode over the same token count (the sweep of the old gather's loop unroll is in this
script's history). ``--few-heads``: the 8- and 16-head rows with the pipeline's own times
(every compute stage left out: the gather alone; the softmax kept; the transposition kept)
beside the shipped kernel, the floor and the target. ``--bounds``: the same stage-less
variants at the 64- and 128-head rows, beside the dense decode over the same token count.
With either, ``--stages 4 3`` adds the gather alone on that many KV stages (a gather bound
by its blocks in flight slows with fewer; figures before 2026-11-28 ran it with QK issued
late, the ``qk_early`` switch at cc70d70). Prints a table.

Every variant timed is compiled first in ``--jobs`` processes (``warm_bench.warm``);
``--rows`` keeps only those rows of the shape list (indices).

    python3 profiles/experiments/sparse_variants.py [--with-few]
    python3 profiles/experiments/sparse_variants.py --few-heads [--rows 3 0] [--only "gather only"]
    python3 profiles/experiments/sparse_variants.py --bounds [--stages 4 3]
"""
import argparse
import os
import sys

from tabulate import tabulate

from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute.bench import measure_copy_tbps, time_us
from snapmla_cute.bench_sparse import BATCH1_TARGET_US, FEW_HEAD_FLOOR_SHARE, FEW_HEAD_SHAPES, _dense_us, \
    sparse_floor_us
from snapmla_cute.profiling import Shape, make_sparse_case

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warm_bench  # noqa: E402

SHAPES = [(128, 128, 1, 2048, 8192), (64, 64, 1, 2048, 8192), (32, 64, 1, 8192, 16384), (1, 128, 1, 2048, 8192)]
# the rest of the kernel without some of its stages (wrong results: timing only)
BOUNDS = {
    "gather only": {"skip": ("qk", "pv", "transpose", "softmax", "store")},
    "+ qk": {"skip": ("pv", "transpose", "softmax", "store")},
    "+ qk, softmax": {"skip": ("pv", "transpose", "store")},
    "no transpose": {"skip": ("transpose",)},
    "no softmax": {"skip": ("softmax",)},
    "no softmax, transpose": {"skip": ("softmax", "transpose")},
    # the epilogue's global writes (out, split partials) left out; the merge still runs
    "no store": {"skip": ("store",)},
}


def sparse_us(b, h, s_q, topk, s_k, page_size=64):
    """The sparse call's time with the tuning set now (its first call compiles it)."""
    shape = Shape(f"b{b} h{h} s_q{s_q} topk{topk}", b, h, s_q, s_k, False, page_size, topk=topk)
    return time_us(make_sparse_case(shape)["step"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--with-few", action="store_true", help="also the b64 h8, b128 h16 and b1 h8 rows")
    ap.add_argument("--few-heads", action="store_true")
    ap.add_argument("--bounds", action="store_true")
    ap.add_argument("--stages", type=int, nargs="*", default=[],
                    help="with --bounds or --few-heads: also the gather alone on these KV stage counts (DecodeConfig.kv_stages)")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME",
                    help="with --bounds or --few-heads: only these of the stage-less variants (e.g. 'gather only')")
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="only these rows of the shape list (indices)")
    ap.add_argument("--jobs", type=int, default=12, help="compile every timed variant first in this many processes (0: no)")
    args = ap.parse_args()
    pick = (lambda shapes: shapes) if args.rows is None else (lambda shapes: [shapes[i] for i in args.rows])
    rows = []
    if args.bounds or args.few_heads:
        tbps = measure_copy_tbps()
        staged = [(f"gather only, {k} stages", {**BOUNDS["gather only"], "kv_stages": k})
                  for k in args.stages]
        bounds = [(n, t) for n, t in BOUNDS.items() if args.only is None or n in args.only]
        variants = [("shipped", {})] + bounds + staged
        shapes = pick(FEW_HEAD_SHAPES if args.few_heads else SHAPES)
        if args.jobs:
            dense = [] if args.few_heads else warm_bench.dense_beside(shapes)
            warm_bench.warm([("sparse", sh, tune) for sh in shapes for _, tune in variants] + dense, args.jobs)
        for shape in shapes:
            b, h, s_q, topk, s_k = shape
            floor = sparse_floor_us(b, h, s_q, topk, tbps)
            row = dict(shape=f"b{b} h{h} s_q{s_q} topk{topk}", floor_us=round(floor, 1))
            if args.few_heads:
                row["target_us"] = round(BATCH1_TARGET_US if b == 1 else floor / FEW_HEAD_FLOOR_SHARE, 1)
            else:
                DECODE_TUNING.clear()  # the shipped dense decode, not the last variant's stages
                row["dense_us"] = round(_dense_us(b * s_q, h, topk, 64), 1)
            for name, tune in variants:
                DECODE_TUNING.clear()
                DECODE_TUNING.update(tune)
                row[name] = round(sparse_us(*shape), 1)
            rows.append(row)
            print(row, flush=True)
    else:
        DECODE_TUNING.clear()
        shapes = pick(SHAPES + ([FEW_HEAD_SHAPES[i] for i in (0, 3, 5)] if args.with_few else []))
        if args.jobs:
            warm_bench.warm([("sparse", sh, {}) for sh in shapes] + warm_bench.dense_beside(shapes), args.jobs)
        for shape in shapes:
            b, h, s_q, topk, s_k = shape
            row = dict(shape=f"b{b} h{h} s_q{s_q} topk{topk}", sparse_us=round(sparse_us(*shape), 1),
                       dense_us=round(_dense_us(b * s_q, h, topk, 64), 1))
            rows.append(row)
            print(row, flush=True)
    DECODE_TUNING.clear()
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
