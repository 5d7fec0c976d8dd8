"""CPU: shared-memory wavefronts of the L1's LSU data pipe per SASS opcode, from the
source-counter CSV that ``snapmla-cute profile`` writes (``decode_<shape>_sass.csv[.gz]``,
column "L1 Wavefronts Shared"; WGMMA operand reads count there too). Per block and CTA
when given the kernel's blocks (s1: 128 CTAs x 128 blocks).

    python3 profiles/experiments/sass_wavefronts.py decode_s1_sass.csv.gz [--blocks 16384]
"""

import argparse
import collections

from snapmla_cute.profiling import csv_number as num
from snapmla_cute.profiling import read_source_csv, sass_opcode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--blocks", type=float, default=128 * 128, help="CTAs x blocks per CTA (s1: 128 x 128)")
    a = ap.parse_args()
    ix, rows = read_source_csv(a.csv)
    wf, inst, ideal = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        if not num(r[ix["L1 Wavefronts Shared"]]):
            continue
        op = sass_opcode(r[ix["Source"]])
        wf[op] += num(r[ix["L1 Wavefronts Shared"]])
        inst[op] += num(r[ix["Instructions Executed"]])
        ideal[op] += num(r[ix["L1 Wavefronts Shared Ideal"]])
    total = sum(wf.values())
    b = a.blocks
    print(f"shared wavefronts {total:.0f}, per block {total / b:.0f}")
    print(f"{'opcode':36s} {'share':>6s} {'per block':>10s} {'warp inst/block':>16s} {'per inst':>9s} {'ideal/block':>12s}")
    for op, w in wf.most_common():
        print(f"{op:36s} {100 * w / total:5.1f}% {w / b:10.1f} {inst[op] / b:16.2f} {w / max(inst[op], 1):9.2f} {ideal[op] / b:12.1f}")


if __name__ == "__main__":
    main()
