"""GPU: where a small-batch decode's time goes, from in-kernel %globaltimer stamps
(DecodeConfig.trace), and its time against the number of parts.

For each shape: graph-replay µs for several part counts, then one traced call (after
warm-up calls in the same stream) printed as the median/max offset of each milestone
over the CTAs that had work, from the earliest CTA start (ns).

    python3 profiles/experiments/trace_small.py [--parts 4,8,16,66]
"""

import argparse

import torch

import snapmla_cute.decode as ops  # its DECODE_TUNING is tuning.DECODE_TUNING
from snapmla_cute import decode_metadata
from snapmla_cute.bench import time_us
from snapmla_cute.kernels.decode.trace import TRACE_EVENTS, trace_words
from snapmla_cute.profiling import Shape, make_case

SHAPES = [Shape("b1 h128 s_k640", 1, 128, 1, 640, False), Shape("b1 h128 s_k4096", 1, 128, 1, 4096, False)]


def traced(c, md, skip=()):
    q, cache, bt, lens, out, lse = (c[k] for k in ("q", "cache", "block_table", "seqlens", "out", "lse"))
    ops.DECODE_TUNING.update(trace=True, skip=skip)
    call = lambda: ops.mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False)  # noqa: E731
    for _ in range(4):
        call()
    grid = md.num_parts * ((md.s_q * md.heads + 63) // 64)
    words = trace_words(md.o_partial, grid)
    words.fill_(-1)
    call()
    torch.cuda.synchronize()
    ops.DECODE_TUNING.clear()
    t = words.cpu().to(torch.int64)
    return t


CONSUMER_EVENTS = ("q_arrived", "qk_done", "softmax_done", "pv_done", "epilogue_done", "exit")


def summarize(t):
    """One line per milestone: median and max over the CTAs with KV work (both consumer
    WGs where each stamps its own), ns from the earliest CTA start."""
    t0 = int(t[:, TRACE_EVENTS["start"]].min())
    rel = (t - t0) % (1 << 32)  # low 32 bits of the ns timer
    rel[t == -1] = -1
    work = t[:, TRACE_EVENTS["kv_issued"]] != -1
    out = [f"CTAs {t.shape[0]}, with KV work {int(work.sum())}"]
    plan = ("start", "lengths_read", "splits_counted", "part_planned")
    order = list(plan) + [k for k in TRACE_EVENTS if k not in plan]
    for k, v in ((k, TRACE_EVENTS[k]) for k in order):
        if k == "smid":
            continue
        cols = [v] + ([v + 16] if k in CONSUMER_EVENTS else [])
        cells = []
        for col in cols:
            x = rel[work, col]
            x = x[x >= 0]
            cells.append(f"{int(x.median()):6d}/{int(x.max()):6d}" if len(x) else "     -/     -")
        out.append(f"  {k:14s} " + "  ".join(cells))
    idle = rel[~work, TRACE_EVENTS["exit"]]
    idle = idle[idle >= 0]
    if len(idle):
        out.append(f"  idle CTAs exit {int(idle.median())}/{int(idle.max())}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="4,6,8,11,16,33,66")
    ap.add_argument("--trace-parts", default="66")
    ap.add_argument("--shapes", default="0,1", help="indices into SHAPES")
    ap.add_argument("--shape", action="append", default=[], metavar="B,H,S_K", help="s_q1 shapes instead of --shapes")
    args = ap.parse_args()
    rows = []
    shapes = [Shape(f"b{b} h{h} s_k{n}", b, h, 1, n, False)
              for b, h, n in (tuple(int(v) for v in x.split(",")) for x in args.shape)]
    for sh in shapes or [SHAPES[int(i)] for i in args.shapes.split(",")]:
        c = make_case(sh)
        q, cache, bt, lens, out, lse = (c[k] for k in ("q", "cache", "block_table", "seqlens", "out", "lse"))
        for parts in [int(p) for p in args.parts.split(",")]:
            md = decode_metadata(lens, s_q=1, heads=sh.heads, num_parts=parts)
            us = time_us(lambda: ops.mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False))
            rows.append((sh.name, parts, us))
            print(rows[-1], flush=True)
        for parts in [int(p) for p in args.trace_parts.split(",")]:
            md = decode_metadata(lens, s_q=1, heads=sh.heads, num_parts=parts)
            for skip in ((), ("store",)):
                print(f"== {sh.name}, {parts} parts, traced (ns from the first CTA start), skip {skip}")
                print(summarize(traced(c, md, skip)), flush=True)
    print(f"{'shape':18s} {'parts':>6s} {'us':>8s}")
    for r in rows:
        print(f"{r[0]:18s} {r[1]:6d} {r[2]:8.1f}")


if __name__ == "__main__":
    main()
