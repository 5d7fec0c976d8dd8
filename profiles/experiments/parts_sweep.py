"""GPU: decode time (s_q1, graph replay) against the part count, to check
``ops.default_num_parts`` (one wave of parts for small batches; whole requests per part
when they fill 90% of the slots).

    python3 profiles/experiments/parts_sweep.py [--batches 1,2,4,8] [--lengths 640,4096,32768] [--parts 33,44,66]
    python3 profiles/experiments/parts_sweep.py --heads 64 --batches 128 --lengths 16384 --parts 128,132
    python3 profiles/experiments/parts_sweep.py --heads 64 --batches 96 --lengths 2048 --parts 96,132 --varlen
    python3 profiles/experiments/parts_sweep.py --heads 64 --batches 64,96 --lengths 2048 --parts b,132

A part count ``b`` is the batch (whole requests per part); ``d`` is ``default_num_parts``.
"""

import argparse

import torch

import snapmla_cute.planning as ops
from snapmla_cute import decode_metadata, mla_decode
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--lengths", default="640,4096,32768")
    ap.add_argument("--parts", default="33,44,66")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--varlen", action="store_true", help="lengths around each length, drawn as the bench's varlen row")
    a = ap.parse_args()
    tokens = a.parts.split(",")
    print(f"{'b':>3s} {'s_k':>6s} " + " ".join(f"{p:>7s}" for p in tokens) + "   (µs per parts)")
    for b in (int(x) for x in a.batches.split(",")):
        m_tiles = (a.heads + 63) // 64
        parts = [b if p == "b" else ops.default_num_parts(b, m_tiles, ops._num_sms(torch.device("cuda")))
                 if p == "d" else int(p) for p in tokens]
        for L in (int(x) for x in a.lengths.split(",")):
            c = make_case(Shape(f"b{b} s_k{L}", b, a.heads, 1, L, False, varlen=a.varlen))
            q, cache, bt, lens, out, lse = (c[k] for k in ("q", "cache", "block_table", "seqlens", "out", "lse"))
            row = []
            for p in parts:
                md = decode_metadata(lens, s_q=1, heads=a.heads, num_parts=p)
                row.append(time_us(lambda: mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False)))
            print(f"{b:3d} {L:6d} " + " ".join(f"{us:7.1f}" for us in row), flush=True)


if __name__ == "__main__":
    main()
