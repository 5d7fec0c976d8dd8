"""GPU: decode time of DecodeConfig tuning variants side by side, in one process, so the
comparison does not depend on which machine of a kind a run landed on. Each variant without
``skip`` is checked against the emulation first (two requests); ``skip`` variants are
timing-only (wrong results on purpose).

    python3 profiles/experiments/variants.py                # the default A/B set
    python3 profiles/experiments/variants.py --small --skeleton --json out.json
    python3 profiles/experiments/variants.py --small --h64 --bounds  # the pipeline's own times
"""

import argparse
import json

import torch

from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute import emulation
from snapmla_cute import reference as ref
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import SHAPES, Shape, make_case

SKELETON = ("qk", "pv", "transpose", "softmax")
# what the rest of the kernel takes without some of its stages (timing only): the data
# pipeline with the GEMMs, and without them (profiles/stage_times.md, "The targets against the pipeline's own times")
BOUNDS = {
    "no_softmax": {"skip": ("softmax",)},
    "gemms_only": {"skip": ("transpose", "softmax")},
    "skeleton": {"skip": SKELETON},
}
TIMING_ONLY = ("skip",)
DEFAULT_SHAPES = [SHAPES["s1"], SHAPES["s2"]]
H64_SHAPES = [Shape("b32 h64 s_q1 s_k8192", 32, 64, 1, 8192, False)]  # with --h64
VARLEN_SHAPES = [Shape("b128 h128 s_q1 s_k8192 varlen", 128, 128, 1, 8192, False, varlen=True)]  # with --varlen
SMALL_SHAPES = [  # with --small
    Shape("b128 h128 s_q1 s_k640", 128, 128, 1, 640, False),
    Shape("b1 h128 s_q1 s_k640", 1, 128, 1, 640, False),
]
DEFAULT_VARIANTS = {
    "default": {},
    "three KV stages": {"kv_stages": 3},
}


def check(c, shape) -> float:
    n = min(shape.batch, 2)
    c["step"]()
    emu = emulation.mla_decode_emulated(
        c["q_bf16"][:n], (c["cache"].kv, c["cache"].kv_scale), c["block_table"][:n], c["seqlens"][:n],
        causal=shape.causal,
    )
    return ref.rel_l2(c["out"][:n].float(), emu[0].bfloat16().float())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--small", action="store_true", help="also the s_k640 shapes")
    ap.add_argument("--skeleton", action="store_true", help="also every compute stage left out")
    ap.add_argument("--h64", action="store_true", help="also b32 h64 s_k8192")
    ap.add_argument("--varlen", action="store_true", help="also the bench's varlen row (b128, lengths around 8192)")
    ap.add_argument("--bounds", action="store_true",
                    help="also the softmax, softmax + transposition, and every compute stage left out")
    ap.add_argument("--no-s2", action="store_true", help="leave out the s_q2 causal shape")
    ap.add_argument("--no-s1", action="store_true", help="leave out the s_k4096 shape")
    ap.add_argument("--shapes", default="", help="more s_q1 shapes as batch:length[:heads],... (h128 unless given; e.g. 1:4096,64:2048:64)")
    ap.add_argument("--variants", help='JSON {name: DecodeConfig fields} instead of the default set')
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds, variants interleaved (drift shows)")
    args = ap.parse_args()
    rows = []
    shapes = [sh for sh in DEFAULT_SHAPES if not (args.no_s2 and sh.causal) and not (args.no_s1 and not sh.causal)]
    extra = []
    for x in filter(None, args.shapes.split(",")):
        b, n, h = (x.split(":") + ["128"])[:3]
        extra.append(Shape(f"b{b} h{h} s_q1 s_k{n}", int(b), int(h), 1, int(n), False))
    for sh in (shapes + (H64_SHAPES if args.h64 else []) + (SMALL_SHAPES if args.small else [])
               + (VARLEN_SHAPES if args.varlen else []) + extra):
        c = make_case(sh)
        variants = json.loads(args.variants) if args.variants else dict(DEFAULT_VARIANTS)
        # JSON lists (e.g. "skip") as tuples: the tuning is part of a hashed cache key
        variants = {n: {k: tuple(v) if isinstance(v, list) else v for k, v in t.items()} for n, t in variants.items()}
        if args.bounds:
            variants.update(BOUNDS)
        if args.skeleton:
            variants["skeleton"] = {"skip": SKELETON}
        errs = {}
        for name, tuning in variants.items():
            DECODE_TUNING.clear()
            DECODE_TUNING.update(tuning)
            errs[name] = None if any(k in tuning for k in TIMING_ONLY) else check(c, sh)
            if errs[name] is not None and errs[name] > 2e-3:
                raise RuntimeError(f"{sh.name} {name}: rel-L2 {errs[name]:.2e} vs emulation")
            time_us(c["step"], reps=10)  # compiled, loaded and the clocks up before timing
        for rnd in range(args.rounds):
            for name, tuning in variants.items():
                DECODE_TUNING.clear()
                DECODE_TUNING.update(tuning)
                us = time_us(c["step"])
                rows.append(dict(shape=sh.name, variant=name, round=rnd, us=round(us, 1), err=errs[name]))
                print(rows[-1], flush=True)
        del c
        torch.cuda.empty_cache()
    DECODE_TUNING.clear()
    print(f"{'shape':32s} {'variant':26s} {'us by round':>18s} {'rel-L2':>9s}")
    keys = dict.fromkeys((r["shape"], r["variant"]) for r in rows)
    for sh, v in keys:
        rs = [r for r in rows if (r["shape"], r["variant"]) == (sh, v)]
        e = "" if rs[0]["err"] is None else f"{rs[0]['err']:.2e}"
        print(f"{sh:32s} {v:26s} {' '.join(format(r['us'], '8.1f') for r in rs):>18s} {e:>9s}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
