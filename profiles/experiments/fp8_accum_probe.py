"""Probe how Hopper's FP8 tensor cores accumulate (GPU part; fit on the CPU afterwards).

Runs e4m3 x e4m3 -> fp32 products through cuBLAS with fast accumulation (no promotion:
every K step goes through the tensor core's own adder) and saves inputs and outputs, so
candidate accumulation models can be checked bit for bit on the CPU:

    python3 profiles/experiments/fp8_accum_probe.py $OUT/fp8_probe.pt
"""

import sys

import torch

FP8 = torch.float8_e4m3fn


def codes(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    # like quantize_rows: randn rows scaled so each row's amax lands on 448
    x = torch.randn(rows, k, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    x = x * (448.0 / x.abs().amax(-1, keepdim=True))
    return x.clamp(-448, 448).to(FP8)


def main(path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    res = {}
    one = torch.ones((), device="cuda")
    for k in (16, 32, 64, 128, 512):
        a = codes(256, k, gen)
        b = codes(256, k, gen)
        out = {}
        for fast in (True, False):
            d = torch._scaled_mm(
                a.cuda(), b.cuda().t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast
            )
            out[fast] = d.cpu()
        res[k] = {"a": a.view(torch.uint8), "b": b.view(torch.uint8), "fast": out[True], "slow": out[False]}
    # bf16 products into fp32 (the RoPE GEMM) where torch offers an fp32 output
    try:
        ab = torch.randn(256, 64, generator=gen).to(torch.bfloat16)
        bb = torch.randn(256, 64, generator=gen).to(torch.bfloat16)
        res["bf16"] = {"a": ab, "b": bb, "d": torch.mm(ab.cuda(), bb.cuda().t(), out_dtype=torch.float32).cpu()}
    except Exception as e:  # noqa: BLE001 - optional
        print("bf16 fp32-out probe skipped:", e)
    torch.save(res, path)
    print("saved", path, list(res))


if __name__ == "__main__":
    main(sys.argv[1])
