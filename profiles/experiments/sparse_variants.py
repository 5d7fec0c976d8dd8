"""Timing-only variants of the sparse decode against the dense one (same token count):
per gather unroll (``DecodeConfig.gather_unroll``; argv: the unrolls to try). Prints a table."""
import sys

from tabulate import tabulate

from snapmla_cute import ops
from snapmla_cute import mla_decode_sparse
from snapmla_cute.bench import time_us
from snapmla_cute.bench_sparse import _dense_us, sparse_case

SHAPES = [(128, 128, 1, 2048, 8192), (64, 64, 1, 2048, 8192), (32, 64, 1, 8192, 16384)]


def sparse_us(b, h, s_q, topk, s_k, page_size=64):
    cache, _, qq, idx, md = sparse_case(b, h, s_q, topk, s_k, page_size)
    out, lse = mla_decode_sparse(qq, cache, idx, metadata=md)
    return time_us(lambda: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False))


rows = []
variants = [("shipped", {})] + [(f"unroll {u}", {"gather_unroll": u}) for u in sys.argv[1:] and map(int, sys.argv[1:]) or (1, 4)]
for shape in SHAPES:
    b, h, s_q, topk, s_k = shape
    for name, tune in variants:
        ops.DECODE_TUNING.clear()
        ops.DECODE_TUNING.update(tune)
        row = dict(shape=f"b{b} h{h} topk{topk}", variant=name, sparse_us=round(sparse_us(*shape), 1))
        if name == "shipped":
            row["dense_us"] = round(_dense_us(b * s_q, h, topk, 64), 1)
        rows.append(row)
        print(row, flush=True)
ops.DECODE_TUNING.clear()
print(tabulate(rows, headers="keys"))
