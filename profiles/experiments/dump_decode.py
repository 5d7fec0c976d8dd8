"""GPU: save decode inputs and kernel outputs per kernel variant, to fit the emulation's model
of the FP8 tensor-core adder on the CPU afterwards. The adder fit used the QK-promotion
variants (``qk_promote`` 1/0), removed in abeb379 when QK became one WGMMA chain
(``git show abeb379^:profiles/experiments/dump_decode.py``); today it dumps the shipped kernel
and any ``DECODE_TUNING`` overrides listed in VARIANTS.

    python3 profiles/experiments/dump_decode.py $OUT/decode_dump.pt
"""

import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case  # noqa: E402

import snapmla_cute.tuning as ops  # noqa: E402
from snapmla_cute import decode_metadata, emulation, mla_decode, quantize_q  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402
from snapmla_cute.bench import time_us  # noqa: E402

CASES = [  # b, s_q, h, page, lens, causal
    (1, 1, 128, 64, [640], False),
    (2, 1, 64, 64, [2048, 1000], False),
    (3, 2, 32, 32, [77, 3000, 500], True),
    (1, 4, 16, 16, [1500], True),
]
VARIANTS = [dict()]  # DecodeConfig field overrides, e.g. dict(pi_order=False)


def main(path):
    cases = [build_case(b, s_q, h, ps, lens, seed=100 + i) for i, (b, s_q, h, ps, lens, _) in enumerate(CASES)]
    dump = {"cases": [], "variants": VARIANTS}
    for (b, s_q, h, ps, lens, causal), c in zip(CASES, cases):
        dump["cases"].append(
            dict(
                spec=(b, s_q, h, ps, lens, causal),
                q=c["q"].cpu(), kv=c["cache"].kv.cpu(), kv_scale=c["cache"].kv_scale.cpu(),
                block_table=c["block_table"].cpu(), cache_seqlens=c["cache_seqlens"].cpu(), outs={},
            )
        )
    torch.save(dump, path)  # inputs first: a failure below still leaves them
    big = build_case(128, 1, 128, 64, [4096] * 128, seed=1)
    for vi, v in enumerate(VARIANTS):
        ops.DECODE_TUNING.clear()
        ops.DECODE_TUNING.update(v)
        errs = []
        for (b, s_q, h, ps, lens, causal), c, d in zip(CASES, cases, dump["cases"]):
            out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal)
            d["outs"][vi] = (out.cpu(), lse.cpu())
            oe, le = emulation.mla_decode_emulated(
                c["q"], (c["cache"].kv, c["cache"].kv_scale), c["block_table"], c["cache_seqlens"], causal=causal
            )
            errs.append(f"{ref.rel_l2(out.float(), oe.bfloat16().float()):.2e}")
        qq = quantize_q(big["q"])
        md = decode_metadata(big["cache_seqlens"], s_q=1, heads=128)
        o = torch.empty(128, 1, 128, 512, device="cuda", dtype=torch.bfloat16)
        lz = torch.empty(128, 128, 1, device="cuda")
        t = time_us(lambda: mla_decode(
            qq, big["cache"], big["block_table"], big["cache_seqlens"], metadata=md, out=o, lse=lz, check=False))
        print(v, "rel-L2 vs fp32 emulation:", errs, f"b128 h128 s_k4096: {t:.1f} us", flush=True)
    torch.save(dump, path)


if __name__ == "__main__":
    main(sys.argv[1])
