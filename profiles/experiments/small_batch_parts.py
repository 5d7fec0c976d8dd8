"""GPU, timing: the plain plan's part count at small batches (``decode_metadata(num_parts=P,
cluster=1)``; the in-kernel plan's width is ceil(blocks + 5 per request / P) blocks, the parts
past the work help merge), graph-replay µs of the serving call, each count timed ``--reps``
times interleaved with the others; every output checked against the default's (rel-L2).

    python3 profiles/experiments/small_batch_parts.py [--reps 3]
"""

import argparse

# (b, h, s_k, part counts): the default count first
ROWS = [(1, 64, 8192, (132, 96, 66, 44)), (1, 64, 4096, (132, 66, 44)), (2, 64, 8192, (132, 96, 66)),
        (1, 128, 8192, (66, 44, 33)), (1, 16, 8192, (132, 66, 44)), (1, 16, 32768, (132, 96, 66))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import torch
    from tabulate import tabulate

    from snapmla_cute import decode_metadata, mla_decode
    from snapmla_cute import reference as ref
    from snapmla_cute.bench import decode_case
    from snapmla_cute.timing import time_us

    table = []
    for b, h, s_k, counts in ROWS:
        c = decode_case(b, h, 1, [s_k] * b)
        runs = {}
        for p in counts:
            md = decode_metadata(c.seqlens, s_q=1, heads=h, num_parts=p, cluster=1)
            out, lse = torch.empty_like(c.out), torch.empty_like(c.lse)
            call = (lambda md=md, out=out, lse=lse: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md,
                                                               out=out, lse=lse, check=False))
            call()
            torch.cuda.synchronize()
            splits = md.split_offsets.diff()[:b].max().item()
            runs[p] = (call, [], splits, ref.rel_l2(out.float(), c.out.float()))
        for _ in range(args.reps):
            for p in counts:
                runs[p][1].append(time_us(runs[p][0]))
        for p in counts:
            _, us, splits, d = runs[p]
            table.append([f"b{b} h{h} s_k{s_k}", p, splits, " / ".join(f"{u:.1f}" for u in us),
                          round(min(us), 1), f"{d:.0e}"])
            print(table[-1], flush=True)
        del c
    print(f"device: {torch.cuda.get_device_name()}")
    print(tabulate(table, headers=["row", "parts", "splits a request", "µs each rep", "min", "rel vs default"]))


if __name__ == "__main__":
    main()
