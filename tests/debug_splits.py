"""GPU debug: compare the kernel's split partials with the emulation of the same blocks."""

import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case  # noqa: E402

from snapmla_cute import decode_metadata, emulation, mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402
from snapmla_cute.kernels.decode.config import MERGE_FEW  # noqa: E402
from snapmla_cute.planning import schedule_reference  # noqa: E402

for L, parts in [(640, 66), (8192, 1), (65536, 1)]:
    c = build_case(2, 1, 128, 64, [L, L], seed=5)
    md = decode_metadata(c["cache_seqlens"], s_q=1, heads=128, num_parts=parts)
    out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
    torch.cuda.synchronize()
    sched, offsets = schedule_reference([L, L], parts)
    kv, ks = c["cache"].kv, c["cache"].kv_scale
    content, rope = ref.unpack_kv_rows(ref.gather_pages(kv, c["block_table"], 0, L))
    s_k = ref.gather_pages(ks, c["block_table"], 0, L).float()
    q_codes, q_scale = emulation.quantize_q_codes(c["q"], emulation.SNAPMLA)
    errs = []
    for row in sched:
        if row[0] != 0:
            continue
        lo = row[1] * 64
        hi = (row[3] * 64 if row[2] == 0 else L)
        split = row[4]
        kq = emulation.QuantizedK(torch.cat([content.float(), rope.float()], -1)[lo:hi], s_k[lo:hi], content.float()[lo:hi], s_k[lo:hi])
        o, l_ = emulation.decode_one(q_codes[0].reshape(128, 576), q_scale[0].reshape(128), kq, torch.full((128,), hi - lo, device="cuda"), ref.default_softmax_scale(), "hopper")
        n_splits = offsets[1] - offsets[0]
        if n_splits > 1:
            slot = md.o_partial[offsets[0] + split]  # fp32 (R, 512)
            if n_splits <= MERGE_FEW:
                # o/ℓ·f as f16 in the slot's first half, then 1/f per row
                R = slot.shape[0]
                flat = slot.reshape(-1)
                got = flat[: R * 256].view(torch.float16).view(R, 512).float() * flat[R * 256:][:R, None]
            else:
                got = slot
            errs.append((hi - lo, ref.rel_l2(got, o), ref.lse_max_abs(md.lse_partial[offsets[0] + split], l_)))
    full_emu = emulation.mla_decode_emulated(c["q"], (kv, ks), c["block_table"], c["cache_seqlens"])
    print(f"L={L} parts={parts}: splits(tokens, relL2, lse)={[(a, f'{b:.1e}', f'{d:.1e}') for a, b, d in errs][:6]} "
          f"final vs emu={ref.rel_l2(out.float(), full_emu[0]):.2e} vs emu-bf16={ref.rel_l2(out.float(), full_emu[0].bfloat16().float()):.2e}", flush=True)
