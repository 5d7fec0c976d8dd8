"""GPU: the cluster plan (a request's k portions on the k CTAs of a cluster, merged through
distributed shared memory: ``DecodeConfig.cluster``) against the shipped decode: first each
k on cases with empty, one-token and varied requests against the emulation and float64 (and
the plan the kernel ran against ``schedule_reference``), then graph-replay µs, same run.

    python3 profiles/experiments/cluster_merge.py [--no-check] [--reps 2]
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from decode_cases import build_case, references  # noqa: E402

from snapmla_cute import decode_metadata, mla_decode  # noqa: E402
from snapmla_cute import planning as ops  # noqa: E402  its DECODE_TUNING is tuning.DECODE_TUNING
from snapmla_cute import reference as ref  # noqa: E402
from snapmla_cute.bench import time_us  # noqa: E402
from snapmla_cute.planning import schedule_reference  # noqa: E402
from snapmla_cute.profiling import Shape, make_case, make_sparse_case  # noqa: E402

# (b, h, s_k, topk, k, parts): dense where topk is 0
TIMED = [(64, 64, 2048, 0, 2, 132), (64, 64, 4096, 0, 2, 132), (48, 64, 4096, 0, 2, 132), (32, 64, 8192, 0, 4, 128),
         (32, 64, 8192, 0, 4, 112), (16, 64, 8192, 0, 8, 112), (16, 64, 8192, 0, 8, 96), (32, 128, 4096, 0, 2, 66),
         (16, 128, 8192, 0, 4, 64), (8, 128, 4096, 0, 8, 56), (1, 128, 640, 0, 8, 56), (1, 128, 640, 0, 4, 64),
         (64, 64, 8192, 2048, 2, 132), (64, 8, 8192, 2048, 2, 132), (32, 64, 16384, 8192, 4, 112)]


def check(seed: int):
    rng = random.Random(seed)
    rows = []
    for b, h, k, parts in [(60, 64, 2, 132), (20, 128, 2, 66), (28, 64, 4, 112), (12, 128, 4, 56), (12, 64, 8, 96),
                           (6, 16, 8, 64)]:
        lens = [0, 1] + [rng.randint(1, 3000) for _ in range(b - 3)] + [rng.randint(2000, 3000)]
        lens = [rng.randint(1500, 2500) if i >= 2 and i % 3 else L for i, L in enumerate(lens)]
        c = build_case(b, 1, h, 64, lens, seed=seed + b)
        (ox, lx), (oe, le) = references(c, False)
        ops.DECODE_TUNING.update(cluster=k)
        try:
            md = decode_metadata(c["cache_seqlens"], s_q=1, heads=h, num_parts=parts)
            sched, offsets = schedule_reference(lens, parts, ops.plan_config(1, h))
            out = torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((b, h, 1), float("nan"), device="cuda")
            for _ in range(3):
                mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out, lse=lse)
            torch.cuda.synchronize()
        except Exception as e:
            rows.append([f"b{b} h{h} k{k} parts{parts}", "-", "-", "-", "-", "-", f"{type(e).__name__}: {str(e)[:40]}"])
            print(rows[-1], flush=True)
            continue
        finally:
            ops.DECODE_TUNING.clear()
        clustered = md.sched[:, 0].tolist().count(0) == min(k, parts)  # request 0 on the first k parts
        same_plan = md.sched.cpu().tolist() == sched
        e_emu = ref.rel_l2(out.float(), oe.bfloat16().float())
        e_lse = ref.lse_max_abs(lse, le)
        e_x = ref.rel_l2(out.float(), ox)
        ok = same_plan and e_emu <= 2e-3 and e_lse <= 1e-3 and e_x <= 5e-2 and bool(torch.all(out[0] == 0))
        rows.append([f"b{b} h{h} k{k} parts{parts}", clustered, same_plan, f"{e_emu:.1e}", f"{e_lse:.1e}",
                     f"{e_x:.1e}", "ok" if ok else "FAIL"])
        print(rows[-1], flush=True)
    return rows


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

    dense = {(h, k) for _, h, _, t, k, _ in TIMED if not t} | {(64, 8), (64, 4), (64, 2), (128, 2), (128, 4), (16, 8)}
    dense |= {(h, 1) for h, _ in dense}
    sparse = {(h, k) for _, h, _, t, k, _ in TIMED if t}
    sparse |= {(h, 1) for h, _ in sparse}
    work = [(dc.compile_step, DecodeStepConfig(DecodeConfig(h, 1, 64, False, **({"cluster": k} if k > 1 else {}))))
            for h, k in sorted(dense)]
    work += [(dc.compile_sparse, DecodeSparseStepConfig(
        DecodeConfig(h, 1, 1, False, sparse=True, **({"cluster": k} if k > 1 else {})), 1)) for h, k in sorted(sparse)]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, work))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--jobs", type=int, default=12, help="compile every variant first in this many processes")
    a = ap.parse_args()
    if a.jobs:
        precompile(a.jobs)
    from tabulate import tabulate

    if not a.no_check:
        print(tabulate(check(1234), headers=["case", "cluster plan", "plan = reference", "rel-L2 emu", "lse",
                                              "rel-L2 fp64", ""]), flush=True)
    table = []
    for b, h, s_k, topk, k, parts in TIMED:
        name = f"b{b} h{h} " + (f"sparse topk{topk} of {s_k}" if topk else f"s_k{s_k}")
        sh = Shape(name, b, h, 1, s_k, False, topk=topk)
        c = make_sparse_case(sh) if topk else make_case(sh)
        shipped = min(time_us(c["step"]) for _ in range(a.reps))
        # the same case on ``parts`` parts in clusters of k
        if topk:
            from snapmla_cute import mla_decode_sparse, sparse_decode_metadata

            md = sparse_decode_metadata(b, 1, h, topk, num_parts=parts)
            step = lambda: mla_decode_sparse(c["q"], c["cache"], c["indices"], metadata=md, out=c["out"],  # noqa: E731
                                             lse=c["lse"], check=False)
        else:
            md = decode_metadata(c["seqlens"], s_q=1, heads=h, num_parts=parts)
            step = lambda: mla_decode(c["q"], c["cache"], c["block_table"], c["seqlens"], metadata=md,  # noqa: E731
                                      out=c["out"], lse=c["lse"], check=False)
        ops.DECODE_TUNING.update(cluster=k)
        try:
            step()
            plan = int(md.split_offsets[-1].item())
            us = min(time_us(step) for _ in range(a.reps))
        except Exception as e:
            us, plan = float("nan"), f"{type(e).__name__}: {str(e)[:50]}"
        finally:
            ops.DECODE_TUNING.clear()
        table.append([name, k, parts, plan, round(shipped, 1), round(us, 1), f"{100 * (us / shipped - 1):+.1f}%"])
        print(table[-1], flush=True)
    print(tabulate(table, headers=["shape", "k", "parts", "splits (cluster run)", "shipped µs", "cluster µs", "Δ"]))


if __name__ == "__main__":
    main()
