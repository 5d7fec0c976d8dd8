"""CPU: where the warps wait, from the source-counter CSV that ``snapmla-cute profile`` writes
(``decode_<shape>_sass.csv[.gz]``): warp-stall samples per SASS opcode and the instructions
with the most samples, with the address range of a loop to look at one role (e.g. the sparse
producer's gather loop: its LDGSTS and the shuffles and address math before them).

    python3 profiles/experiments/sass_stalls.py decode_sp128_sass.csv [--top 30] [--range 0x1a00:0x1f00]
"""

import argparse
import collections

from snapmla_cute.profiling import csv_number as num
from snapmla_cute.profiling import read_source_csv, sass_opcode


def column(ix: dict, *needles: str) -> int | None:
    """The first column whose name contains every needle (ncu versions name them apart)."""
    return next((i for h, i in ix.items() if all(n.lower() in h.lower() for n in needles)), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30, help="instructions with the most stall samples")
    ap.add_argument("--range", help="only addresses lo:hi (hex), e.g. one loop's body")
    a = ap.parse_args()
    ix, rows = read_source_csv(a.csv)
    c_all = column(ix, "stall sampling", "all")
    c_not = column(ix, "stall sampling", "not")
    c_exe = column(ix, "instructions executed")
    if c_all is None:
        raise SystemExit(f"no warp-stall column; the CSV has: {list(ix)}")
    lo, hi = (int(x, 16) for x in a.range.split(":")) if a.range else (0, 1 << 62)
    by_op, by_op_not, execd = collections.Counter(), collections.Counter(), collections.Counter()
    insts = []
    for r in rows:
        addr = int(r[ix["Address"]], 16) if r[ix["Address"]].startswith("0x") else -1
        if not lo <= addr < hi:
            continue
        src = r[ix["Source"]].strip()
        op = sass_opcode(src) if src else "?"
        samples = num(r[c_all])
        by_op[op] += samples
        by_op_not[op] += num(r[c_not]) if c_not is not None else 0
        execd[op] += num(r[c_exe]) if c_exe is not None else 0
        insts.append((samples, r[ix["Address"]], src))
    total = sum(by_op.values()) or 1
    print(f"stall samples {total:.0f}" + (f" in {a.range}" if a.range else ""))
    print(f"{'opcode':36s} {'share':>6s} {'samples':>9s} {'not issued':>11s} {'executed':>12s}")
    for op, s in by_op.most_common(25):
        print(f"{op:36s} {100 * s / total:5.1f}% {s:9.0f} {by_op_not[op]:11.0f} {execd[op]:12.0f}")
    print(f"\ntop {a.top} instructions")
    for s, addr, src in sorted(insts, reverse=True)[: a.top]:
        print(f"{addr:>8s} {100 * s / total:5.1f}% {src}")


if __name__ == "__main__":
    main()
