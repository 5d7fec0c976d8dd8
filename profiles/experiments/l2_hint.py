"""GPU: the KV loads with and without L2's evict-first hint (``DecodeConfig.kv_evict_first``),
same build, alternating in each round (graph-replay µs; the outputs compared bit for bit).
The rows are timed with the switch off and at its default (on where at most two query tiles
read a block; the sparse step at one query token per request).

    python3 profiles/experiments/l2_hint.py [--rounds 3] [--dense B,H,S_Q,S_K ...] [--sparse B,H,S_Q,TOPK,S_K ...]
"""

import argparse
import os
import sys

import torch

DENSE = [(32, 64, 1, 8192), (64, 64, 1, 2048), (8, 64, 1, 16384), (128, 64, 1, 16384), (128, 128, 1, 640),
         (128, 128, 1, 4096)]
SPARSE = [(32, 64, 1, 8192, 16384), (64, 64, 1, 2048, 8192), (64, 8, 8, 2048, 8192)]
OFF = {"kv_evict_first": False}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", nargs="*", help="B,H,S_Q,S_K rows instead of the defaults")
    ap.add_argument("--sparse", nargs="*", help="B,H,S_Q,TOPK,S_K rows instead of the defaults")
    a = ap.parse_args()
    dense = [tuple(int(v) for v in r.split(",")) for r in a.dense] if a.dense is not None else DENSE
    sparse = [tuple(int(v) for v in r.split(",")) for r in a.sparse] if a.sparse is not None else SPARSE

    from snapmla_cute.tuning import DECODE_TUNING
    from snapmla_cute.bench import time_us
    from snapmla_cute.profiling import Shape, make_case, make_sparse_case

    sys.path.insert(0, os.path.dirname(__file__))
    from warm_bench import warm

    items = [("dense", (b, h, s_q, s, s_q > 1, False), t) for b, h, s_q, s in dense for t in ({}, OFF)]
    items += [("sparse", r, t) for r in sparse for t in ({}, OFF)]
    warm(items, verbose=False)
    cases = [(f"dense b{b} h{h} s_q{s_q} s_k{s}", lambda b=b, h=h, s_q=s_q, s=s:
              make_case(Shape("x", b, h, s_q, s, s_q > 1))) for b, h, s_q, s in dense]
    cases += [(f"sparse b{b} h{h} s_q{s_q} topk{k} of {s}", lambda b=b, h=h, s_q=s_q, k=k, s=s:
               make_sparse_case(Shape("x", b, h, s_q, s, False, topk=k))) for b, h, s_q, k, s in sparse]
    rows = []
    for name, make in cases:
        c = make()
        times = {False: [], True: []}
        ref = None
        for _ in range(a.rounds):
            for off in (True, False):
                DECODE_TUNING.clear()
                if off:
                    DECODE_TUNING.update(OFF)
                c["step"]()
                torch.cuda.synchronize()
                if ref is None:
                    ref = (c["out"].clone(), c["lse"].clone())
                assert torch.equal(ref[0], c["out"]) and torch.equal(ref[1], c["lse"]), f"{name}: outputs differ"
                times[not off].append(time_us(c["step"]))
        DECODE_TUNING.clear()
        rows.append((name, times[False], times[True]))
        print(rows[-1][0], [round(x, 1) for x in times[False]], [round(x, 1) for x in times[True]], flush=True)
        del c
        torch.cuda.empty_cache()
    print(f"\n{'row':40s} {'off (min)':>10s} {'default (min)':>14s} {'ratio':>6s}")
    for name, off, on in rows:
        print(f"{name:40s} {min(off):10.1f} {min(on):14.1f} {min(on) / min(off):6.3f}")


if __name__ == "__main__":
    main()
