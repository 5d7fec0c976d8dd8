"""Timing-only variants of the sparse decode against the dense one (same token count):
per gather unroll (``DecodeConfig.gather_unroll``; argv: the unrolls to try). Prints a table."""
import sys

import torch
from tabulate import tabulate

from snapmla_cute import ops
from snapmla_cute.bench_sparse import _dense_us
from snapmla_cute.bench import time_us
from snapmla_cute import FP8KVCache, append_kv, mla_decode_sparse, quantize_q, sparse_decode_metadata

SHAPES = [(128, 128, 1, 2048, 8192), (64, 64, 1, 2048, 8192), (32, 64, 1, 8192, 16384)]


def sparse_us(b, h, s_q, topk, s_k, page_size=64):
    pages = b * ((s_k + page_size - 1) // page_size)
    cache = FP8KVCache.allocate(pages, page_size)
    kv = (torch.randn(pages * page_size, 576, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    append_kv(cache, kv, torch.randperm(pages * page_size, device="cuda"), check=False)
    per = pages * page_size // b
    pick = torch.rand(b, s_q, per, device="cuda").argsort(dim=-1)[..., :topk]
    idx = (pick + torch.arange(b, device="cuda").view(b, 1, 1) * per).to(torch.int32).contiguous()
    qq = quantize_q(torch.randn(b, s_q, h, 576, device="cuda").to(torch.bfloat16))
    md = sparse_decode_metadata(b, s_q, h, topk)
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
