"""GPU: the split merge of few-split requests batched over rows and items
(``DecodeConfig.merge_few``) against the general merge (a warp per row for the LSE, one
8-dim item per thread at a time), at dense and sparse shapes of split requests (a few ways at
b32-b64; b8 h128 about 8 ways; b128 h128 unsplit, as a control). Prints graph-replay µs per
variant, rounds interleaved. Since bb02679 ``merge_few`` = 0 also keeps every split's
partial fp32 (a few-split request's are f16 otherwise), so the two variants differ in the
partials' format too.

    python3 profiles/experiments/merge_few.py
"""
from tabulate import tabulate

from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute.bench import time_us
from snapmla_cute.profiling import Shape, make_case, make_sparse_case

DENSE = [(64, 64, 2048), (32, 64, 8192), (32, 64, 2048), (8, 128, 8192), (128, 128, 4096)]
SPARSE = [(64, 64, 1, 2048, 8192), (32, 64, 1, 8192, 16384), (64, 8, 1, 2048, 8192), (128, 128, 1, 2048, 8192)]
VARIANTS = {"general merge": {"merge_few": 0}, "few-split merge": {}}


def main():
    calls = []
    for b, h, n in DENSE:
        c = make_case(Shape(f"b{b} h{h} s_k{n}", b, h, 1, n, False))
        calls.append((f"dense b{b} h{h} s_k{n}", c["step"]))
    for b, h, s_q, topk, s_k in SPARSE:
        c = make_sparse_case(Shape(f"sparse b{b} h{h} topk{topk}", b, h, s_q, s_k, False, topk=topk))
        calls.append((f"sparse b{b} h{h} topk{topk}", c["step"]))
    rows = {name: {"shape": name} for name, _ in calls}
    for rnd in range(2):
        for vname, tune in VARIANTS.items():
            DECODE_TUNING.clear()
            DECODE_TUNING.update(tune)
            for name, step in calls:
                us = time_us(step)
                rows[name][f"{vname} r{rnd}"] = round(us, 1)
                print(name, vname, rnd, round(us, 1), flush=True)
    DECODE_TUNING.clear()
    print(tabulate(list(rows.values()), headers="keys"))


if __name__ == "__main__":
    main()
