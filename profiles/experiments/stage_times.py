"""GPU: decode time with one stage left out at a time (results are wrong on purpose), to
place the time inside the kernel without counters (METHOD.md), plus the separate
scheduler kernel (`DecodeMetadata.update`; not part of a step, which plans in-kernel).

    python3 profiles/experiments/stage_times.py
"""

import snapmla_cute.tuning as ops
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import SHAPES, Shape, make_case


def main():
    shapes = [SHAPES["s1"], Shape("b1 h128 s_q1 s_k640", 1, 128, 1, 640, False)]
    rows = []
    for sh in shapes:
        c = make_case(sh)
        step, md, lens = c["step"], c["metadata"], c["seqlens"]
        for skip in [(), ("transpose",), ("softmax",), ("pv",), ("qk",), ("qk", "pv"), ("qk", "pv", "transpose", "softmax")]:
            ops.DECODE_TUNING.clear()
            ops.DECODE_TUNING.update(skip=skip)
            rows.append((sh.name, "+".join(skip) or "full", time_us(step)))
            print(rows[-1], flush=True)
        ops.DECODE_TUNING.clear()
        rows.append((sh.name, "scheduler kernel (not in the step)", time_us(lambda: md.update(lens))))
        print(rows[-1], flush=True)
    print(f"{'shape':28s} {'left out':36s} {'us':>8s}")
    for r in rows:
        print(f"{r[0]:28s} {r[1]:36s} {r[2]:8.1f}")


if __name__ == "__main__":
    main()
