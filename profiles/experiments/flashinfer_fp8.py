"""Why FlashInfer's FP8 MLA decode is slower than its own BF16 one on Hopper: times its fa3
kernel with BF16 KV, FP8 KV with per-token scales (``ckv_scale_arr``, the benches' column) and
FP8 KV under one scale per tensor (``ckv_scale``), each checked against float64, beside ours,
on bench rows (CUDA-graph replay, page 64). Its FP8 path keeps the tile in e4m3 in shared memory
and one consumer warpgroup converts it to BF16 before a BF16 WGMMA (``repack_fp8_kv_to_bf16``
in mla_hopper.cuh; a scalar multiply per element with the scale array, ``__hmul2`` with one
scale): the two FP8 columns split that cost between the conversion and the array.

    source .cutedsl/activate.sh && source .flashinfer/activate.sh && \\
        python profiles/experiments/flashinfer_fp8.py [--rows b128h128s4096 b1h128s640 ...]
"""

import argparse

import torch

from snapmla_cute import peers
from snapmla_cute.bench import decode_case, decode_lengths, verify_decode
from snapmla_cute.timing import time_us

ROWS = ["b128h128s4096", "b128h128s8192", "b32h64s8192", "b128h8s32768", "b16h16s65536", "b1h128s640",
        "b8h128s8192"]
KINDS = ("fi_bf16", "fi_fp8", "fi_fp8_tensor")


def parse(row: str) -> tuple[int, int, int]:
    b, rest = row[1:].split("h")
    h, s_k = rest.split("s")
    return int(b), int(h), int(s_k)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=ROWS)
    a = ap.parse_args()
    print(peers.flashinfer_jit_report() or "FlashInfer does not import here", flush=True)
    print(f"device: {torch.cuda.get_device_name()}")
    table = []
    for row in a.rows:
        b, h, s_k = parse(row)
        c = decode_case(b, h, 1, decode_lengths(b, s_k, False), 64)
        verify_decode(c, row)
        ours = time_us(c.serving_call())
        fi = peers.flashinfer_us(c.q, c.kv_pages, c.block_table, c.seqlens, cache=(c.cache.kv, c.cache.kv_scale),
                                 which=KINDS)
        table.append((row, ours, *(fi.get(k) for k in KINDS), fi.get("note")))
        print(table[-1], flush=True)
        del c
        torch.cuda.empty_cache()

    def f(x):
        return "-" if x is None else f"{x:.1f}"

    print("\n| row | ours µs | FI BF16 µs | FI FP8 per-token µs | FI FP8 per-tensor µs | per-token ÷ BF16 | "
          "per-tensor ÷ BF16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row, ours, bf, tok, ten, note in table:
        r1 = f"{tok / bf:.2f}" if tok and bf else "-"
        r2 = f"{ten / bf:.2f}" if ten and bf else "-"
        print(f"| {row} | {ours:.1f} | {f(bf)} | {f(tok)} | {f(ten)} | {r1} | {r2} |" + (f" {note}" if note else ""))


if __name__ == "__main__":
    main()
