"""The paired sparse gather (``DecodeConfig.gather_pair``: h128, each of the two query tiles'
CTAs gathers half of every block with two warps and a third warp's thread copies it to the
other through distributed shared memory) against the unpaired kernel: ``--check`` runs h128 cases against the emulation and
float64 exact attention with the pairing on; then each bench row is timed both ways, with
the gather-only bound of each, same run. Prints a table.

    python3 profiles/experiments/sparse_pair.py --check
"""
import argparse
import os
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from snapmla_cute import mla_decode_sparse, ops  # noqa: E402
from snapmla_cute.bench import time_us  # noqa: E402
from snapmla_cute.bench_sparse import sparse_case  # noqa: E402

SHAPES = [(128, 128, 1, 2048, 8192), (128, 128, 2, 2048, 8192), (32, 128, 1, 16384, 32768), (1, 128, 1, 2048, 8192)]
GATHER_ONLY = {"skip": ("qk", "pv", "transpose", "softmax", "store")}


def check():
    from test_sparse_gpu import build_sparse_case, check_sparse, run_sparse

    # the ring wraps (parts of more than 4 blocks) and parts hold several lists in the last three
    cases = [dict(b=2, s_q=1, ctx=700, topk=300, minus_one=0.1), dict(b=3, s_q=2, ctx=1000, topk=777, lengths=[0, 5, 777]),
             dict(b=4, s_q=1, ctx=16400, topk=16384), dict(b=67, s_q=1, ctx=2100, topk=2048),
             dict(b=5, s_q=2, ctx=9000, topk=8192, minus_one=0.01)]
    for i, kw in enumerate(cases):
        b, s_q, ctx, topk = kw.pop("b"), kw.pop("s_q"), kw.pop("ctx"), kw.pop("topk")
        c = build_sparse_case(b, s_q, 128, 64, ctx, topk, seed=i, **kw)
        t0 = time.time()
        out, lse = run_sparse(c)
        torch.cuda.synchronize()
        t1 = time.time()
        check_sparse(c, out, lse)
        print(f"check ok b{b} s_q{s_q} ctx{ctx} topk{topk} {kw}: kernel {t1 - t0:.1f} s, references {time.time() - t1:.1f} s",
              flush=True)


def us(shape):
    b, h, s_q, topk, s_k = shape
    cache, _, qq, idx, md = sparse_case(b, h, s_q, topk, s_k)
    out, lse = mla_decode_sparse(qq, cache, idx, metadata=md)
    return time_us(lambda: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False))


ap = argparse.ArgumentParser()
ap.add_argument("--check", action="store_true")
ap.add_argument("--no-time", action="store_true")
ap.add_argument("--shapes", type=int, default=len(SHAPES), help="time the first N rows")
args = ap.parse_args()
if args.check:
    ops.DECODE_TUNING.clear()
    ops.DECODE_TUNING.update(gather_pair=True)
    check()
rows = []
if not args.no_time:
    for i, shape in enumerate(SHAPES[: args.shapes]):
        row = dict(shape="b{} h{} s_q{} topk{}".format(*shape[:4]))
        variants = [("shipped", {}), ("paired", {"gather_pair": True})]
        if i == 0:
            variants += [("gather only", GATHER_ONLY), ("paired gather only", {"gather_pair": True, **GATHER_ONLY})]
        for name, tune in variants:
            ops.DECODE_TUNING.clear()
            ops.DECODE_TUNING.update(tune)
            row[name] = round(us(shape), 1)
        rows.append(row)
        print(row, flush=True)
ops.DECODE_TUNING.clear()
print(tabulate(rows, headers="keys"))
