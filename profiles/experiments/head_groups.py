"""GPU, timing: the head-group plan (``decode_metadata(head_groups=h/16, cluster=k)``: a
request's heads as groups of 16, each group on a cluster of k CTAs merged on-chip) against
the plain plans (``head_groups=1``, the metadata's own cluster choice), graph-replay µs of
the serving call, at small batches and several lengths. Each head-group output is checked
against the plain call's (rel-L2). ``--replay``: the metadata made at 640 tokens (the
default choice for ``max_seqlen=640``) and the call timed at longer lengths, as a graph
captured with it would replay them. ``--no-evict-first``: every call without L2's
evict-first hint on the KV loads (``DecodeConfig.kv_evict_first``; the head-group steps
keep it although each block has g readers).

    python3 profiles/experiments/head_groups.py [--heads 128 64] [--batches 1 2 3 4] [--lengths 640 1024] [--replay]
        [--no-evict-first]
"""

from __future__ import annotations

import argparse
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

BATCHES = (1, 2, 4)
LENGTHS = (640, 1024, 2048, 4096, 8192)


def ks(b: int, g: int) -> list[int]:
    """The clusters a head-group launch of b·g requests may take (at most 64 CTAs in
    clusters of 4 or 8: the cooperative launch refused 128)."""
    return [k for k in (2, 4, 8) if b * g * k <= 64 or (k == 2 and b * g * k <= 132)]


def _warm_one(item):
    """Compile one (h, head groups, k) step under ``tuning`` into the disk cache (a spawned
    process)."""
    import torch

    from snapmla_cute import decode_metadata, mla_decode
    from snapmla_cute.bench import decode_case
    from snapmla_cute.tuning import DECODE_TUNING

    h, g, k, tuning = item
    DECODE_TUNING.update(tuning)
    c = decode_case(1, h, 1, [640], 64, False)
    md = decode_metadata(c.seqlens, s_q=1, heads=h, head_groups=g, cluster=k,
                         num_parts=None if g > 1 else 2 * k)
    mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md)
    torch.cuda.synchronize()
    return item


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--no-evict-first", action="store_true")
    args = ap.parse_args()
    tuning = {"kv_evict_first": False} if args.no_evict_first else {}

    import torch
    from tabulate import tabulate

    from snapmla_cute import decode_metadata, mla_decode
    from snapmla_cute import reference as ref
    from snapmla_cute.bench import decode_case
    from snapmla_cute.timing import time_us

    from snapmla_cute.tuning import DECODE_TUNING

    items = sorted({(h, h // 16, k) for h in args.heads for b in args.batches for k in ks(b, h // 16)}
                   | {(h, 1, k) for h in args.heads for k in (1, 2)})
    with ProcessPoolExecutor(max_workers=12, mp_context=multiprocessing.get_context("spawn")) as pool:
        for it in pool.map(_warm_one, [(*it, tuning) for it in items]):
            print("warm", it, flush=True)
    DECODE_TUNING.update(tuning)

    def timed(c, md):
        out = torch.empty_like(c.out)
        lse = torch.empty_like(c.lse)
        call = lambda: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md, out=out,  # noqa: E731
                                  lse=lse, check=False)
        call()
        torch.cuda.synchronize()
        return time_us(call), out

    rows = []
    for h in args.heads:
        g = h // 16
        for b in args.batches:
            for L in args.lengths:
                c = decode_case(b, h, 1, [L] * b, 64, False)
                plain = decode_metadata(c.seqlens, s_q=1, heads=h, head_groups=1)
                us0, out0 = timed(c, plain)
                row = [f"b{b} h{h} s_k{L}", plain.num_parts, plain.cluster, round(us0, 1)]
                best = None
                for k in ks(b, g):
                    md = decode_metadata(c.seqlens, s_q=1, heads=h, head_groups=g, cluster=k)
                    us, out = timed(c, md)
                    d = ref.rel_l2(out.float(), out0.float())
                    row.append(f"k{k}: {us:.1f} ({d:.0e})")
                    best = us if best is None else min(best, us)
                row.append(round(us0 / best, 2))
                rows.append(row)
                print(row, flush=True)
    print(tabulate(rows, headers=["shape", "parts", "k", "plain us", "head groups (rel vs plain)", "", "",
                                  "plain / best"]))

    if args.replay:  # the default choice at 640 tokens, replayed at longer lengths
        rep = []
        for h in args.heads:
            for b in args.batches:
                for L in (640, 2048, 4096, 8192, 32768):
                    c = decode_case(b, h, 1, [L] * b, 64, False)
                    md = decode_metadata(c.seqlens, s_q=1, heads=h, max_seqlen=640)
                    plain = decode_metadata(c.seqlens, s_q=1, heads=h, head_groups=1)
                    us0, out0 = timed(c, plain)
                    us, out = timed(c, md)
                    rep.append([f"b{b} h{h} s_k{L}", f"g{md.head_groups} k{md.cluster}", round(us, 1), round(us0, 1),
                                f"{ref.rel_l2(out.float(), out0.float()):.0e}"])
                    print(rep[-1], flush=True)
        print(tabulate(rep, headers=["shape", "metadata made at 640", "us", "plain metadata us", "rel"]))


if __name__ == "__main__":
    main()
