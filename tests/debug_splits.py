"""GPU debug: compare the kernel's fp32 split partials with the emulation of the same blocks."""

import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case  # noqa: E402

from snapmla_cute import decode_metadata, mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402
from snapmla_cute.kernels.decode_scheduler import schedule_reference  # noqa: E402

import snapmla_cute.ops as ops  # noqa: E402

for tuning, L, parts in [(t, L, p) for t in ({}, {"qk_promote": 1}, {"qk_promote": 4}) for L, p in [(640, 1000), (8192, 1), (65536, 1)]]:
    ops.DECODE_TUNING.clear()
    ops.DECODE_TUNING.update(tuning)
    print(tuning, end=" ")
    c = build_case(2, 1, 128, 64, [L, L], seed=5)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=128, num_parts=parts)
    out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
    torch.cuda.synchronize()
    sched, offsets = schedule_reference([L, L], parts)
    kv, ks = c["cache"].kv, c["cache"].kv_scale
    content, rope = ref.unpack_kv_rows(ref._gather(kv, c["block_table"], 0, L))
    s_k = ref._gather(ks, c["block_table"], 0, L).float()
    q_codes, q_scale = ref._quantize_q(c["q"], ref.SNAPMLA)
    errs = []
    for row in sched:
        if row[0] != 0:
            continue
        lo = row[1] * 64
        hi = (row[3] * 64 if row[2] == 0 else L)
        split = row[4]
        kq = ref._QuantizedK(torch.cat([content.float(), rope.float()], -1)[lo:hi], s_k[lo:hi], content.float()[lo:hi], s_k[lo:hi])
        o, l_ = ref._decode_one(q_codes[0].reshape(128, 576), q_scale[0].reshape(128), kq, torch.full((128,), hi - lo, device="cuda"), ref.default_softmax_scale())
        n_splits = offsets[1] - offsets[0]
        if n_splits > 1:
            got = md.o_partial[offsets[0] + split]
            errs.append((hi - lo, ref.rel_l2(got, o), ref.lse_max_abs(md.lse_partial[offsets[0] + split], l_)))
    full_emu = ref.mla_decode_emulated(c["q"], (kv, ks), c["block_table"], c["cache_seqlens"])
    print(f"L={L} parts={parts}: splits(tokens, fp32 relL2, lse)={[(a, f'{b:.1e}', f'{d:.1e}') for a, b, d in errs][:6]} "
          f"final vs emu={ref.rel_l2(out.float(), full_emu[0]):.2e} vs emu-bf16={ref.rel_l2(out.float(), full_emu[0].bfloat16().float()):.2e}", flush=True)

from snapmla_cute.bench import time_us  # noqa: E402
from snapmla_cute import quantize_q  # noqa: E402

for tuning in ({}, {"qk_promote": 1}):
    ops.DECODE_TUNING.clear()
    ops.DECODE_TUNING.update(tuning)
    for b, h, s_q, L in [(128, 128, 1, 4096), (128, 128, 2, 8192)]:
        c = build_case(b, s_q, h, 64, [L] * b, seed=1)
        qq = quantize_q(c["q"])
        md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h)
        fn = lambda: mla_decode(qq, c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, causal=s_q > 1, check=False)
        us = time_us(fn)
        print(f"{tuning} b{b} h{h} s_q{s_q} s_k{L}: {us:.1f} us", flush=True)
