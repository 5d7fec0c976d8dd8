"""GPU: decode time of DecodeConfig tuning variants side by side, in one process, so the
comparison does not depend on which machine of a kind a run landed on. Each variant without
``skip`` is checked against the emulation first (two requests); ``skip`` variants are
timing-only (wrong results on purpose).

    python3 profiles/experiments/variants.py                # the default A/B set
    python3 profiles/experiments/variants.py --small --skeleton --json out.json
"""

import argparse
import json

import torch

import snapmla_cute.ops as ops
from snapmla_cute import reference as ref
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import SHAPES, Shape, make_case

SKELETON = ("qk", "pv", "transpose", "softmax")
DEFAULT_SHAPES = [SHAPES["s1"], SHAPES["s2"]]
H64_SHAPES = [Shape("b32 h64 s_q1 s_k8192", 32, 64, 1, 8192, False)]  # with --h64
SMALL_SHAPES = [  # with --small
    Shape("b128 h128 s_q1 s_k640", 128, 128, 1, 640, False),
    Shape("b1 h128 s_q1 s_k640", 1, 128, 1, 640, False),
]
DEFAULT_VARIANTS = {
    "default": {},
    "idle parts exit (no merge helpers)": {"merge_helpers": False},
}


def check(c, shape) -> float:
    n = min(shape.batch, 2)
    c["step"]()
    emu = ref.mla_decode_emulated(
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
    ap.add_argument("--no-s2", action="store_true", help="leave out the s_q2 causal shape")
    args = ap.parse_args()
    rows = []
    shapes = [sh for sh in DEFAULT_SHAPES if not (args.no_s2 and sh.causal)]
    for sh in shapes + (H64_SHAPES if args.h64 else []) + (SMALL_SHAPES if args.small else []):
        c = make_case(sh)
        variants = dict(DEFAULT_VARIANTS, **({"skeleton": {"skip": SKELETON}} if args.skeleton else {}))
        for name, tuning in variants.items():
            ops.DECODE_TUNING.clear()
            ops.DECODE_TUNING.update(tuning)
            err = None if "skip" in tuning else check(c, sh)
            if err is not None and err > 2e-3:
                raise RuntimeError(f"{sh.name} {name}: rel-L2 {err:.2e} vs emulation")
            us = time_us(c["step"])
            rows.append(dict(shape=sh.name, variant=name, us=round(us, 1), err=err))
            print(rows[-1], flush=True)
        del c
        torch.cuda.empty_cache()
    ops.DECODE_TUNING.clear()
    print(f"{'shape':32s} {'variant':22s} {'us':>8s} {'rel-L2':>9s}")
    for r in rows:
        e = "" if r["err"] is None else f"{r['err']:.2e}"
        print(f"{r['shape']:32s} {r['variant']:22s} {r['us']:8.1f} {e:>9s}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
