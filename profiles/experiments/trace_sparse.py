"""GPU: where a few-head sparse decode's time goes: graph-replay µs per part count, then one
traced call (``DecodeConfig.trace``, %globaltimer stamps per CTA; see trace_small.py) with
the median/max offset of each milestone from the earliest CTA start (ns).

    python3 profiles/experiments/trace_sparse.py [--parts 132,66,33] [--shapes 0,3]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from trace_small import summarize  # noqa: E402

from snapmla_cute import mla_decode_sparse, sparse_decode_metadata  # noqa: E402
from snapmla_cute import tuning as ops  # noqa: E402
from snapmla_cute.bench import time_us  # noqa: E402
from snapmla_cute.bench_sparse import FEW_HEAD_SHAPES, sparse_case  # noqa: E402
from snapmla_cute.kernels.decode.trace import TRACE_EVENTS, trace_words  # noqa: E402


def traced(qq, cache, idx, md):
    ops.DECODE_TUNING.update(trace=True)
    b, s_q, h = md.batch, md.s_q, md.heads
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, h, s_q, device="cuda")
    call = lambda: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False)  # noqa: E731
    for _ in range(4):
        call()
    grid = md.num_parts * ((h + 63) // 64)
    words = trace_words(md.o_partial, grid)
    words.fill_(-1)
    call()
    torch.cuda.synchronize()
    ops.DECODE_TUNING.clear()
    t = words.cpu().to(torch.int64)
    # the gathering producer stamps no kv_issued: a CTA with work is one whose Q arrived
    t[:, TRACE_EVENTS["kv_issued"]] = t[:, TRACE_EVENTS["q_arrived"]]
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="132,66")
    ap.add_argument("--shapes", default="0,3,5", help="indices into bench_sparse.FEW_HEAD_SHAPES")
    ap.add_argument("--shape", action="append", default=[], metavar="B,H,S_Q,TOPK,S_K", help="instead of --shapes")
    ap.add_argument("--no-trace", action="store_true")
    args = ap.parse_args()
    rows = []
    shapes = [tuple(int(v) for v in x.split(",")) for x in args.shape] or [
        FEW_HEAD_SHAPES[int(i)] for i in args.shapes.split(",")]
    for b, h, s_q, topk, s_k in shapes:
        cache, _, qq, idx, _ = sparse_case(b, h, s_q, topk, s_k)
        name = f"b{b} h{h} s_q{s_q} topk{topk}"
        for parts in [int(p) for p in args.parts.split(",")]:
            md = sparse_decode_metadata(b, s_q, h, topk, num_parts=parts)
            out, lse = mla_decode_sparse(qq, cache, idx, metadata=md)
            us = time_us(lambda: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False))
            rows.append((name, parts, us))
            print(rows[-1], flush=True)
        if args.no_trace:
            continue
        md = sparse_decode_metadata(b, s_q, h, topk)
        print(f"== {name}, {md.num_parts} parts, traced (ns from the first CTA start)")
        print(summarize(traced(qq, cache, idx, md)), flush=True)
    print(f"{'shape':26s} {'parts':>6s} {'us':>8s}")
    for r in rows:
        print(f"{r[0]:26s} {r[1]:6d} {r[2]:8.1f}")


if __name__ == "__main__":
    main()
