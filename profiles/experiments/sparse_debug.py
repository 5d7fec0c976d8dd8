"""Sparse decode vs its emulation on small cases, one variable at a time (debug aid)."""
import sys
import torch
sys.path.insert(0, "tests")
from test_sparse_gpu import build_sparse_case
from snapmla_cute import mla_decode_sparse, sparse_decode_metadata, sparse_reference
from snapmla_cute import reference as ref

rows = []
def run(name, h, b, s_q, topk, ctx=1000, num_parts=None, minus_one=0.0, sort=False, page=64):
    c = build_sparse_case(b, s_q, h, page, ctx, topk, seed=1, minus_one=minus_one)
    if sort:
        c["indices"] = torch.sort(c["indices"], dim=-1).values.contiguous()
    md = sparse_decode_metadata(b, s_q, h, topk, num_parts=num_parts)
    out, lse = mla_decode_sparse(c["q"], c["cache"], c["indices"], metadata=md)
    torch.cuda.synchronize()
    oe, le = sparse_reference.mla_decode_sparse_emulated(c["q"], (c["cache"].kv, c["cache"].kv_scale), c["indices"])
    err = ref.rel_l2(out.float(), oe.bfloat16().float())
    lerr = ref.lse_max_abs(lse, le)
    per_head = [round(ref.rel_l2(out[0, 0, i].float(), oe[0, 0, i]), 3) for i in range(0, h, max(1, h // 8))]
    rows.append((name, h, b, s_q, topk, num_parts, md.num_parts, f"{err:.2e}", f"{lerr:.2e}", per_head))

for h in (16, 128):
    run("one block", h, 1, 1, 64, num_parts=1)
    run("one block sorted", h, 1, 1, 64, num_parts=1, sort=True)
    run("8 tokens", h, 1, 1, 8, num_parts=1)
    run("two blocks", h, 1, 1, 128, num_parts=1)
    run("5 blocks", h, 1, 1, 320, num_parts=1)
    run("5 blocks 2 parts", h, 1, 1, 320, num_parts=2)
    run("16 blocks default parts", h, 1, 1, 1000)
for r in rows:
    print(*r)
