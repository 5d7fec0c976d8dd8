"""GPU, with sgl-flash-mla's ``flash_mla`` importable: each FlashMLA peer of
``snapmla_cute.peers`` once at a small shape (dense FP8 and BF16 at b2 h128 s_k 2048; sparse
FP8 at b2 h128 and at b2 h8 padded to h64, topk 2048 of 8192), each checked against float64
attention before it is timed; then ``snapmla-cute bench latency`` as a module.

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PYTHONPATH python3 profiles/experiments/peers_check.py
"""
import subprocess
import sys

import torch

from snapmla_cute import peers
from snapmla_cute.bench import decode_case
from snapmla_cute.bench_sparse import sparse_case_tokens


def main() -> int:
    fm = peers.flash_mla()
    if fm is None:
        print("flash_mla does not run here (stderr says why): nothing to check")
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flash_mla {fm.__version__} ({fm.__file__})")
    c = decode_case(2, 128, 1, [2048, 2048])
    figures = {
        "dense BF16 b2 h128 s_k2048": peers.dense_bf16_us(c.q, c.kv_pages, c.block_table, c.seqlens),
        "dense FP8 b2 h128 s_k2048": peers.dense_fp8_us(c.q, c.kv_pages, c.block_table, c.seqlens),
    }
    del c
    for h in (128, 8):
        kv_pages, _, q, _, indices, _ = sparse_case_tokens(2, h, 1, 2048, 8192)
        padded = "" if peers.sparse_heads(h) == h else " (padded to h64)"
        figures[f"sparse FP8 b2 h{h}{padded} topk2048 of 8192"] = peers.sparse_fp8_us(q, kv_pages, indices)
    for name, us in figures.items():
        print(f"FlashMLA {name}: {'not timed' if us is None else f'{us:.1f} µs'}", flush=True)
    bench = subprocess.run([sys.executable, "-m", "snapmla_cute.cli", "bench", "latency"])
    return 1 if None in figures.values() or bench.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
