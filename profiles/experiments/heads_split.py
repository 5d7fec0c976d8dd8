"""GPU, timing: a small batch's heads split across CTAs with the shipped kernel, by viewing
b requests of h heads as b·h/16 requests of 16 heads that share their block-table row (one
64-row tile each, 16 rows live), on the split plan and on the cluster plan forced at k = 2,
4, 8 (a request's blocks over k CTAs, merged on-chip; the split plan priced out by
raising ``SPLIT_UNITS_PER_TILE`` in this process). Each output against the shipped call's.

    python3 profiles/experiments/heads_split.py
"""

from __future__ import annotations

import torch
from tabulate import tabulate

SHAPES = [(1, 128, 640), (2, 128, 640), (1, 128, 2048), (1, 64, 8192), (4, 128, 640)]
GROUP = 16  # heads per kernel request


def main():
    from snapmla_cute import decode_metadata, mla_decode
    from snapmla_cute.bench import decode_case
    from snapmla_cute.kernels.decode import config as dconf
    from snapmla_cute.timing import time_us

    rows, cases = [], []
    for b, h, s_k in SHAPES:  # the shipped calls first, before the plan constant moves
        c = decode_case(b, h, 1, [s_k] * b, 64, False)
        us = time_us(c.serving_call())
        cases.append(c)
        rows.append([f"b{b} h{h} s_k{s_k}", "shipped", c.metadata.num_parts, c.metadata.cluster, round(us, 1), "-"])
        print(rows[-1], flush=True)
    for forced in (False, True):
        if forced:
            dconf.SPLIT_UNITS_PER_TILE = 10_000  # a split priced out: the rule takes whole or cluster plans
        for (b, h, s_k), c in zip(SHAPES, cases):
            g = h // GROUP
            qq = tuple(t.reshape(b * g, 1, GROUP, *t.shape[3:]) for t in c.qq)
            bt = c.block_table.repeat_interleave(g, 0)
            lens = c.seqlens.repeat_interleave(g)
            out = torch.full((b * g, 1, GROUP, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(b * g, GROUP, 1, dtype=torch.float32, device="cuda")
            ref_out = c.out.float().reshape(b * g, 1, GROUP, 512)
            for k in ((2, 4, 8) if forced else (1,)):
                parts = b * g * k if forced else None  # the cluster plan: k parts per request
                label = f"as b{b * g} h{GROUP}" + (" cluster plan" if forced else "")
                try:
                    md = decode_metadata(lens, s_q=1, heads=GROUP, num_parts=parts, cluster=1)
                    md.cluster = k
                    call = lambda: mla_decode(qq, c.cache, bt, lens, metadata=md, out=out, lse=lse,  # noqa: E731
                                              check=False)
                    call()
                    torch.cuda.synchronize()
                    d = ((out.float() - ref_out).norm() / ref_out.norm()).item()
                    rows.append([f"b{b} h{h} s_k{s_k}", label, md.num_parts, k, round(time_us(call), 1), f"{d:.1e}"])
                except Exception as e:  # noqa: BLE001
                    rows.append([f"b{b} h{h} s_k{s_k}", label, parts, k, "-", f"{type(e).__name__}: {str(e)[:50]}"])
                print(rows[-1], flush=True)
    print(tabulate(rows, headers=["shape", "call", "parts", "k", "us", "rel vs shipped"]))


if __name__ == "__main__":
    main()
