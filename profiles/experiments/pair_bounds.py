"""GPU: the ceiling of merging a request's two halves on-chip (a CTA pair of a cluster)
instead of through fp32 partials in global memory. Timing-only variants, same run, graph
replay µs at the default part count:

* shipped: the decode as it ships (the plan's rule: whole requests or split everywhere);
* pairs: parts 2r and 2r+1 take the two halves of request r and both write its output as if
  unsplit (wrong results: no merge at all, so the bound of any on-chip merge), where 2·b fits
  the parts;
* pairs, cluster 2: the same launched in clusters of two parts (what a DSMEM merge needs:
  does the cooperative launch take them, and at what cost);
* cluster 2: the shipped plan launched in clusters of two.

Every variant is compiled first in parallel processes (disk cache), then timed.

    python3 profiles/experiments/pair_bounds.py [--jobs 8] [--reps 2]
"""

import argparse

from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case, make_sparse_case

# (b, h, s_k, topk): dense where topk is 0
ROWS = [(64, 64, 2048, 0), (64, 64, 4096, 0), (48, 64, 4096, 0), (64, 64, 8192, 0), (32, 64, 8192, 0),
        (32, 128, 4096, 0), (24, 128, 8192, 0), (64, 64, 8192, 2048), (48, 8, 8192, 2048), (64, 8, 8192, 2048)]
VARIANTS = {"shipped": {}, "pairs": {"pairs": True}, "pairs, cluster 2": {"pairs": True, "cluster": 2},
            "cluster 2": {"cluster": 2}}


def _compile(item):
    fn, cfg = item
    fn(cfg)  # into the disk cache, under the key the call's lookup uses
    return True


def precompile(jobs: int):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.config import DecodeConfig
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig

    work = []
    for kw in VARIANTS.values():
        for h in sorted({h for _, h, _, t in ROWS if not t}):
            work.append((dc.compile_step, DecodeStepConfig(DecodeConfig(h, 1, 64, False, **kw))))
        for h in sorted({h for _, h, _, t in ROWS if t}):
            work.append((dc.compile_sparse, DecodeSparseStepConfig(DecodeConfig(h, 1, 1, False, sparse=True, **kw), 1)))
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, work))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=8)
    a = ap.parse_args()
    if a.jobs:
        precompile(a.jobs)
    table = []
    for b, h, s_k, topk in ROWS:
        name = f"b{b} h{h} " + (f"sparse topk{topk} of {s_k}" if topk else f"s_k{s_k}")
        sh = Shape(name, b, h, 1, s_k, False, topk=topk)
        c = make_sparse_case(sh) if topk else make_case(sh)
        row = [name, c["metadata"].num_parts]
        for kw in VARIANTS.values():
            DECODE_TUNING.update(**kw)
            try:
                c["step"]()
                row.append(round(min(time_us(c["step"]) for _ in range(a.reps)), 1))
            except Exception as e:  # a launch the driver refuses (clusters) is a result too
                row.append(f"error: {type(e).__name__}: {str(e)[:60]}")
            finally:
                DECODE_TUNING.clear()
        table.append(row)
        print(row, flush=True)
    from tabulate import tabulate

    print(tabulate(table, headers=["shape", "parts", *VARIANTS]))


if __name__ == "__main__":
    main()
