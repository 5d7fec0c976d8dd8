"""GPU, timing: the plain plan's part count at small batches (``decode_metadata(num_parts=P,
cluster=1)``; the in-kernel plan's width is ceil(blocks + 5 per request / P) blocks, the parts
past the work help merge), graph-replay µs of the serving call, each count timed ``--reps``
times interleaved with the others; every output checked against the default's (rel-L2).

    python3 profiles/experiments/small_batch_parts.py [--reps 3] [--helpers-max 0 32]
"""

import argparse

# (b, h, s_k, part counts): the default count first
ROWS = [(1, 64, 8192, (132, 96, 66, 44)), (1, 64, 4096, (132, 66, 44)), (2, 64, 8192, (132, 96, 66)),
        (1, 128, 8192, (66, 44, 33)), (1, 16, 8192, (132, 66, 44)), (1, 16, 32768, (132, 96, 66))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--helpers-max", type=int, nargs="+", default=[0],
                    help="DecodeConfig.merge_helpers_max values, each a row (0: every idle part helps)")
    args = ap.parse_args()
    import torch
    from tabulate import tabulate

    from snapmla_cute import decode_metadata, mla_decode
    from snapmla_cute import reference as ref
    from snapmla_cute.bench import decode_case
    from snapmla_cute.timing import time_us
    from snapmla_cute.tuning import DECODE_TUNING

    table = []
    for b, h, s_k, counts in ROWS:
        c = decode_case(b, h, 1, [s_k] * b)
        runs = {}
        variants = [(p, hm) for p in counts for hm in args.helpers_max]
        for p, hm in variants:
            DECODE_TUNING.clear()
            if hm:
                DECODE_TUNING.update(merge_helpers_max=hm)
            md = decode_metadata(c.seqlens, s_q=1, heads=h, num_parts=p, cluster=1)
            out, lse = torch.empty_like(c.out), torch.empty_like(c.lse)
            call = (lambda md=md, out=out, lse=lse: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md,
                                                               out=out, lse=lse, check=False))
            call()
            torch.cuda.synchronize()
            splits = md.split_offsets.diff()[:b].max().item()
            runs[p, hm] = (call, [], splits, ref.rel_l2(out.float(), c.out.float()), dict(DECODE_TUNING))
        for _ in range(args.reps):
            for v in variants:
                DECODE_TUNING.clear()
                DECODE_TUNING.update(runs[v][4])
                runs[v][1].append(time_us(runs[v][0]))
        for v in variants:
            _, us, splits, d, _ = runs[v]
            table.append([f"b{b} h{h} s_k{s_k}", v[0], v[1] or "-", splits, " / ".join(f"{u:.1f}" for u in us),
                          round(min(us), 1), f"{d:.0e}"])
            print(table[-1], flush=True)
        del c
    print(f"device: {torch.cuda.get_device_name()}")
    print(tabulate(table, headers=["row", "parts", "helpers max", "splits a request", "µs each rep", "min", "rel vs default"]))


if __name__ == "__main__":
    main()
