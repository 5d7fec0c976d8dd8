"""GPU: f16 split partials at every split count (``DecodeConfig.partials_f16``) against the
shipped fp32 past ``merge_few`` splits, at the latency rows (``bench latency``'s shapes) and
a few partial-heavy bench rows, plus the part counts of the dense latency rows. Every
variant's output is checked against the emulation (rel-L2 <= 2e-3) before it is timed.
Graph-replay µs; the variants of a row run interleaved (the default twice).

    python3 profiles/experiments/partials_f16.py [--json out.json] [--parts]
"""

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch

VARIANTS = {"fp32 past 8": {}, "f16": {"partials_f16": True}, "f16, few to 16": {"partials_f16": True, "merge_few": 16}}
DENSE = [(b, h, s_k) for h, s_k in ((128, 640), (128, 8192), (64, 8192), (16, 32768)) for b in (1, 2, 4, 8)]
DENSE += [(32, 64, 8192), (16, 128, 8192), (64, 64, 2048)]  # more splits' bytes than latency
SPARSE = [(b, h) for h in (8, 128) for b in (1, 2, 4, 8)]
PARTS = {128: (66, 44, 33), 64: (132, 96, 66, 44), 16: (132, 96, 66)}


def _compile(job):
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.config import DecodeConfig
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig

    kind, h, tuning = job
    if kind == "sparse":
        dc.compile_sparse(DecodeSparseStepConfig(DecodeConfig(h, 1, 1, False, sparse=True, **dict(tuning)), 1))
    else:
        for k in (1, 2):
            dc.compile_step(DecodeStepConfig(DecodeConfig(h, 1, 64, False, **{"cluster": k, **dict(tuning)})))
    return job


def main():
    from snapmla_cute import decode_metadata, mla_decode, mla_decode_sparse
    from snapmla_cute import reference as ref
    from snapmla_cute.bench import decode_case, verify_decode
    from snapmla_cute.bench_sparse import sparse_case_tokens, verify_sparse
    from snapmla_cute.timing import time_us
    from snapmla_cute.tuning import DECODE_TUNING

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--parts", action="store_true", help="also the dense rows' part counts")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    args = ap.parse_args()
    jobs = {("dense", h, tuple(sorted(t.items()))) for _, h, _ in DENSE for t in VARIANTS.values()}
    jobs |= {("sparse", h, tuple(sorted(t.items()))) for _, h in SPARSE for t in VARIANTS.values()}
    with ProcessPoolExecutor(args.jobs) as pool:
        list(pool.map(_compile, sorted(jobs)))
    rows = []

    def timed(row, variant, tuning, make_step, check):
        DECODE_TUNING.clear()
        DECODE_TUNING.update(tuning)
        try:
            step = make_step()
            step()
            torch.cuda.synchronize()
            err = check()
            us = round(time_us(step), 1)
        except Exception as e:  # noqa: BLE001 (a refused launch is a row too)
            us, err = f"{type(e).__name__}: {str(e)[:60]}", None
        rows.append(dict(row=row, variant=variant, us=us, err=err))
        print(rows[-1], flush=True)

    order = list(VARIANTS.items()) + [("fp32 past 8 (again)", {})]
    for b, h, s_k in DENSE:
        name = f"dense b{b} h{h} s_k{s_k}"
        c = decode_case(b, h, 1, [s_k] * b)
        base = None

        def check():
            nonlocal base
            verify_decode(c, name)
            o = c.out.float().clone()
            if base is None:
                base = o
            return float(ref.rel_l2(o, base))

        splits = c.metadata.split_offsets.diff()[:b].max().item()
        for v, t in order:
            timed(name, f"{v} ({c.metadata.num_parts} parts, k {c.metadata.cluster}, <= {splits} splits)", t,
                  c.serving_call, check)
        if args.parts and b <= 8:
            for parts in PARTS[h]:
                md = decode_metadata(c.seqlens, s_q=1, heads=h, num_parts=parts, cluster=1)
                for v, t in (order[0], order[1]):
                    timed(name, f"{v}, {parts} parts k 1", t,
                          lambda md=md: (lambda: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md,
                                                            out=c.out, lse=c.lse, check=False)), check)
        del c
    for b, h in SPARSE:
        name = f"sparse b{b} h{h} topk2048"
        kv_pages, cache, q, qq, idx, md = sparse_case_tokens(b, h, 1, 2048, 8192, 64)
        out, lse = mla_decode_sparse(qq, cache, idx, metadata=md)
        base = None

        def check():
            nonlocal base
            verify_sparse(cache, q, out, idx, name)
            o = out.float().clone()
            if base is None:
                base = o
            return float(ref.rel_l2(o, base))

        for v, t in order:
            timed(name, f"{v} ({md.num_parts} parts)", t,
                  lambda: (lambda: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False)),
                  check)
        del cache
    DECODE_TUNING.clear()
    print(f"device: {torch.cuda.get_device_name()}")
    for r in rows:
        err = "-" if r["err"] is None else f"{r['err']:.1e}"
        print(f"| {r['row']} | {r['variant']} | {r['us']} | {err} |")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
