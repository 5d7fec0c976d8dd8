"""GPU: the decode-v3 candidates' ceilings at every h128 bench row, as timing-only variants of
v1 in one process (profiles/NOTES.md, "Decode v3's candidates, measured"). Only ``default``
computes the right result (checked against the emulation); every other variant is timing
only:

* ``A opt``: no transposition and no transposer warpgroup (consumers at 240 registers), the
  PV reading the untransposed tile: V as the register operand with its own loads free.
* ``A 1t`` / ``A 2t``: the same plus each PV GEMM's A operand loaded from the token-major tile
  by ldmatrix.trans + prmt (two V fragments), with one / two PV temporaries: V as the
  register A operand of Oᵀ = Vᵀ·Pᵀ with its data movement and its register budget.
* ``C pair``: both blocks' PV of a split into one temporary and one fp32 add (a lazy
  rescale that keeps γ = 1 for the own block); ``A 1t + C``: both.
* ``no softmax`` variants: the same with the softmax left out; ``skeleton``: no compute.

    python3 profiles/experiments/v3_ceilings.py [--rows s_k4096,s_k640] [--rounds 2] [--json out.json]
"""

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case
from snapmla_cute.tuning import DECODE_TUNING

ROWS = {  # name: (shape, the H100 target in µs)
    "s_k4096": (Shape("b128 h128 s_q1 s_k4096", 128, 128, 1, 4096, False), 160),
    "s_k8192": (Shape("b128 h128 s_q1 s_k8192", 128, 128, 1, 8192, False), 305),
    "s_k32768": (Shape("b128 h128 s_q1 s_k32768", 128, 128, 1, 32768, False), 1160),
    "s_q2 causal": (Shape("b128 h128 s_q2 s_k8192 causal", 128, 128, 2, 8192, True), 600),
    "varlen": (Shape("b128 h128 s_q1 s_k8192 varlen", 128, 128, 1, 8192, False, varlen=True), 310),
    "s_k2048": (Shape("b128 h128 s_q1 s_k2048", 128, 128, 1, 2048, False), 82),
    "s_k640": (Shape("b128 h128 s_q1 s_k640", 128, 128, 1, 640, False), 34),
    "s_q8 causal": (Shape("b64 h128 s_q8 s_k8192 causal", 64, 128, 8, 8192, True), 1150),
}
NO_WG = {"transposer": False}
VARIANTS = {
    "default": {},
    "A opt": {**NO_WG, "skip": ("transpose",)},
    "A 1t": {**NO_WG, "pv_temps": 1, "skip": ("transpose", "v_ldsm")},
    "A 2t": {**NO_WG, "skip": ("transpose", "v_ldsm")},
    "C pair": {"skip": ("pv_pair",)},
    "A 1t + C": {**NO_WG, "pv_temps": 1, "skip": ("transpose", "v_ldsm", "pv_pair")},
    "no softmax": {"skip": ("softmax",)},
    "A opt, no softmax": {**NO_WG, "skip": ("transpose", "softmax")},
    "A 1t, no softmax": {**NO_WG, "pv_temps": 1, "skip": ("transpose", "v_ldsm", "softmax")},
    "skeleton": {"skip": ("qk", "pv", "transpose", "softmax")},
}


def _tuning(t: dict) -> dict:
    return {"cluster": 1, **t}  # one compile key per variant (these rows' metadata picks 1)


def _compile(job):
    s_q, causal, tuning = job
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.step import DecodeStepConfig

    dc.compile_step(DecodeStepConfig(DecodeConfig(heads=128, s_q=s_q, page_size=64, causal=causal, **tuning)))
    return job


def check(c, shape) -> float:
    from snapmla_cute import emulation
    from snapmla_cute import reference as ref

    n = min(shape.batch, 2)
    c["step"]()
    emu = emulation.mla_decode_emulated(c["q_bf16"][:n], (c["cache"].kv, c["cache"].kv_scale), c["block_table"][:n],
                                        c["seqlens"][:n], causal=shape.causal)
    return ref.rel_l2(c["out"][:n].float(), emu[0].bfloat16().float())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names separated by ;")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="parallel compile processes")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [ROWS[r] for r in args.rows.split(",")]
    variants = {v: _tuning(VARIANTS[v]) for v in args.variants.split(";")}
    # compile every (s_q, causal, variant) in parallel first: the step calls then load them
    jobs = list(dict.fromkeys((sh.s_q, sh.causal, tuple(sorted(t.items()))) for sh, _ in rows for t in variants.values()))
    with ProcessPoolExecutor(args.jobs) as pool:
        list(pool.map(_compile, [(s, c, dict(t)) for s, c, t in jobs]))
    out = []
    for sh, target in rows:
        c = make_case(sh)
        errs = {}
        for name, tuning in variants.items():
            DECODE_TUNING.clear()
            DECODE_TUNING.update(tuning)
            errs[name] = check(c, sh) if name == "default" else None
            if errs[name] is not None and errs[name] > 2e-3:
                raise RuntimeError(f"{sh.name} {name}: rel-L2 {errs[name]:.2e} vs emulation")
            time_us(c["step"], reps=10)
        for rnd in range(args.rounds):
            for name, tuning in variants.items():
                DECODE_TUNING.clear()
                DECODE_TUNING.update(tuning)
                out.append(dict(shape=sh.name, target=target, variant=name, round=rnd, us=round(time_us(c["step"]), 1),
                                err=errs[name]))
                print(out[-1], flush=True)
        del c
        torch.cuda.empty_cache()
    DECODE_TUNING.clear()
    print(f"device: {torch.cuda.get_device_name()}")
    names = list(variants)
    print("| row | target | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for sh, target in rows:
        cells = [" / ".join(str(r["us"]) for r in out if r["shape"] == sh.name and r["variant"] == v) for v in names]
        print(f"| {sh.name} | {target} | " + " | ".join(cells) + " |")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
