"""GPU: where a small-batch decode's time goes (profiles/small_batches.md, "Small batches: the
ceilings"). For each latency row (dense b 1-8 at h128 s_k640 / s_k8192, h64 s_k8192, h16
s_k32768; sparse b 1-8 at h8 / h128, topk 2048 of 8192), graph-replay µs of:

* ``default``: the shipped call (default metadata);
* ``no compute``: the same launch with QK, softmax, transposition and PV left out (the plan,
  the KV stream, the handshakes, the epilogue's writes and the merge remain);
* ``no compute, no store``: and no output or partial rows written;
* ``launch only``: the same grid returning at entry (the launch's own cost);
* ``P parts, k``: dense only, the split plan on P parts in clusters of k (k > 1: a request's
  portions merged on-chip, ``DecodeConfig.cluster``);
* ``empty graph``: one graph replay of a one-element kernel (the replay's own floor).

    python3 profiles/experiments/latency_ceilings.py [--dense-only] [--json out.json]
"""

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch

SKEL = ("qk", "pv", "transpose", "softmax")
DENSE = [(b, h, s_k) for h, s_k in ((128, 640), (128, 8192), (64, 8192), (16, 32768)) for b in (1, 2, 4, 8)]
SPARSE = [(b, h) for h in (8, 128) for b in (1, 2, 4, 8)]
TUNINGS = {"no compute": {"skip": SKEL}, "no compute, no store": {"skip": SKEL + ("store",)},
           "launch only": {"skip": ("launch",)}}
PARTS = [(8, 8), (16, 8), (4, 4), (16, 4), (2, 2), (16, 2)]  # (parts, cluster)


def _compile(job):
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.config import DecodeConfig
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig

    kind, h, tuning = job
    if kind == "sparse":
        dc.compile_sparse(DecodeSparseStepConfig(DecodeConfig(h, 1, 1, False, sparse=True, **dict(tuning)), 1))
    else:
        dc.compile_step(DecodeStepConfig(DecodeConfig(h, 1, 64, False, **dict(tuning))))
    return job


def empty_graph_us() -> float:
    from snapmla_cute.timing import time_us

    x = torch.zeros(1, device="cuda")
    return time_us(lambda: x.add_(1))


def main():
    from snapmla_cute import decode_metadata, mla_decode, mla_decode_sparse
    from snapmla_cute.timing import time_us
    from snapmla_cute.bench_sparse import sparse_case
    from snapmla_cute.profiling import Shape, make_case
    from snapmla_cute.tuning import DECODE_TUNING

    ap = argparse.ArgumentParser()
    ap.add_argument("--dense-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    args = ap.parse_args()
    sparse_rows = [] if args.dense_only else SPARSE
    jobs = set()
    for _, h, _ in DENSE:
        jobs |= {("dense", h, tuple(sorted({"cluster": 1, **t}.items()))) for t in TUNINGS.values()}
        jobs |= {("dense", h, (("cluster", k),)) for _, k in PARTS} | {("dense", h, ())}
    for _, h in sparse_rows:
        jobs.add(("sparse", h, ()))
        jobs |= {("sparse", h, tuple(sorted({"cluster": 1, **t}.items()))) for t in TUNINGS.values()}
    with ProcessPoolExecutor(args.jobs) as pool:
        list(pool.map(_compile, sorted(jobs)))
    rows = [dict(row="empty graph", variant="-", us=round(empty_graph_us(), 1))]
    print(rows[-1], flush=True)

    def timed(row, variant, step, tuning=None):
        DECODE_TUNING.clear()
        if tuning:
            DECODE_TUNING.update(tuning)
        try:
            step()
            us = round(time_us(step), 1)
        except Exception as e:  # noqa: BLE001 (a refused launch is a row too)
            us = f"{type(e).__name__}: {str(e)[:50]}"
        rows.append(dict(row=row, variant=variant, us=us))
        print(rows[-1], flush=True)

    for b, h, s_k in DENSE:
        name = f"dense b{b} h{h} s_k{s_k}"
        c = make_case(Shape(name, b, h, 1, s_k, False))
        timed(name, f"default ({c['metadata'].num_parts} parts, k {c['metadata'].cluster})", c["step"])
        for v, t in TUNINGS.items():
            timed(name, v, c["step"], {"cluster": 1, **t})
        for parts, k in PARTS:
            try:
                md = decode_metadata(c["seqlens"], s_q=1, heads=h, num_parts=parts, cluster=1)
            except ValueError:
                continue
            md.cluster = k  # as b1_clusters.py (at cc70d70): clusters of 4 and 8 are the tuning's only
            timed(name, f"{parts} parts, k {k}",
                  lambda: mla_decode(c["q"], c["cache"], c["block_table"], c["seqlens"], metadata=md, out=c["out"],
                                     lse=c["lse"], check=False))
        del c
    for b, h in sparse_rows:
        name = f"sparse b{b} h{h} topk2048"
        cache, _, qq, idx, md = sparse_case(b, h, 1, 2048, 8192, 64)
        out, lse = mla_decode_sparse(qq, cache, idx, metadata=md)

        def step():
            mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False)

        timed(name, f"default ({md.num_parts} parts)", step)
        for v, t in TUNINGS.items():
            timed(name, v, step, {"cluster": 1, **t})
        del cache
    DECODE_TUNING.clear()
    print(f"device: {torch.cuda.get_device_name()}")
    for r in rows:
        print(f"| {r['row']} | {r['variant']} | {r['us']} |")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
