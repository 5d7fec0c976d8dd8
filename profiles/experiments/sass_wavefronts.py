"""CPU: shared-memory wavefronts of the L1's LSU data pipe per SASS opcode, from the
source-counter CSV that ``snapmla-cute profile`` writes (``decode_<shape>_sass.csv[.gz]``,
column "L1 Wavefronts Shared"; WGMMA operand reads count there too). Per block and CTA
when given the kernel's blocks (s1: 128 CTAs x 128 blocks).

    python3 profiles/experiments/sass_wavefronts.py decode_s1_sass.csv.gz [--blocks 16384]
"""

import argparse
import collections
import csv
import gzip
import re


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--blocks", type=float, default=128 * 128, help="CTAs x blocks per CTA (s1: 128 x 128)")
    a = ap.parse_args()
    opener = gzip.open if a.csv.endswith(".gz") else open
    with opener(a.csv, "rt") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[head]
    ix = {h: i for i, h in enumerate(hdr)}
    wf, inst, ideal = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows[head + 1:]:
        if len(r) != len(hdr) or not num(r[ix["L1 Wavefronts Shared"]]):
            continue
        op = re.sub(r"^@!?U?P\w+\s+", "", r[ix["Source"]].strip()).split()[0]
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
