"""CPU: the split rows the in-kernel plan gives for lengths outside [0, 2^31 - 64), in the
plan's int32 arithmetic (``kernels/decode_scheduler.py``: truncating division, wrapping sums,
``splits_of`` and ``part_plan`` as the device runs them). Prints, per length list, the split
offsets and the range of rows the parts' first segments write against the fp32 partials'
rows (batch + parts): a row outside it is a write past the scratch buffer. The checks
(``check=True``) refuse such lengths; ``check=False`` and graph replays pass them through.
The last column replays the plan with each length clamped to [0, MAX_SEQLEN] first
(``decode_scheduler.clamp_len``).

    python3 profiles/experiments/plan_lengths.py
"""
from tabulate import tabulate

from snapmla_cute.planning import clamp_len_host

OV = 5  # SchedulerConfig.fixed_overhead_blocks


def i32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def tdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def plan_rows(lens, parts):
    b = len(lens)
    pre = [0]
    for L in lens:
        pre.append(i32(pre[-1] + tdiv(i32(L + 63), 64) + OV))
    total = pre[-1]
    width = max(tdiv(i32(total + parts - 1), parts), 1)

    def splits(start, end):
        first = start + OV
        return tdiv(end - 1, width) - tdiv(first, width) + 1 if end > first else 1

    off = [0]
    for r in range(b):
        off.append(off[-1] + splits(pre[r], pre[r + 1]))
    rows = []
    for p in range(parts):
        u0 = p * width
        if u0 >= total:
            continue
        a, z = 0, b
        while a < z - 1:
            m = (a + z) // 2
            a, z = (m, z) if pre[m] <= u0 else (a, m)
        first = pre[a] + OV
        split = p - tdiv(first, width) if (pre[a + 1] > first and u0 > first) else 0
        rows.append(off[a] + split)
    return off, rows


def main():
    parts = 132
    out = []
    for lens in ([6400, 6400, 6400], [-10000, 6400, 6400], [0, -1, 6400], [2**31 - 64, 640, 640], [2**31 - 1, 640]):
        off, rows = plan_rows(lens, parts)
        lo, hi = (min(rows), max(rows)) if rows else ("-", "-")
        bad = bool(rows) and (min(rows) < 0 or max(rows) >= len(lens) + parts)
        _, rows_c = plan_rows([clamp_len_host(L) for L in lens], parts)
        bad_c = bool(rows_c) and (min(rows_c) < 0 or max(rows_c) >= len(lens) + parts)
        out.append(dict(lengths=str(lens), split_offsets=str(off), rows_written=f"{lo}..{hi}",
                        buffer_rows=len(lens) + parts, outside=bad, outside_clamped=bad_c))
    print(tabulate(out, headers="keys"))


if __name__ == "__main__":
    main()
