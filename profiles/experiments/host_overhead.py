"""GPU: where the host time of one ``mla_decode`` call goes (not yet run; for issue 5).

Splits one ``mla_decode(check=False)`` call with metadata/out/lse given into: the Python
checks and view building (launcher replaced by a no-op), the bare compiled step call with
the same argument objects every time, and the bare call with freshly built views each time
(to test whether TVM-FFI's per-object tensor conversion is what costs).

    python3 profiles/experiments/host_overhead.py
"""

import torch

import snapmla_cute.ops as ops
from snapmla_cute import FP8KVCache, decode_metadata, mla_decode, quantize_q
from snapmla_cute.bench import host_us_per_call


def main():
    b, h, L, ps = 1, 128, 640, 64
    cache = FP8KVCache.allocate(b * L // ps, ps, device="cuda")
    cache.kv.random_(0, 100)
    cache.kv_scale.fill_(1e-2)
    bt = torch.arange(b * L // ps, device="cuda", dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    qq = quantize_q(torch.randn(b, 1, h, 576, device="cuda", dtype=torch.bfloat16))
    md = decode_metadata(lens, s_q=1, heads=h)
    out = torch.empty(b, 1, h, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(b, h, 1, device="cuda")

    def full():
        mla_decode(qq, cache, bt, lens, metadata=md, out=out, lse=lse, check=False)

    step, args = ops._step_call(*qq, cache, bt, lens, md, out, lse, None, False)

    def fresh():
        _, a = ops._step_call(*qq, cache, bt, lens, md, out, lse, None, False)
        step(*a)

    rows = [("full mla_decode call", host_us_per_call(full)),
            ("bare step call, same argument objects", host_us_per_call(lambda: step(*args))),
            ("bare step call, views rebuilt each call", host_us_per_call(fresh))]
    real = ops._step_launcher
    ops._step_launcher = lambda *a: (lambda *x: None)
    rows.append(("Python only (launch replaced by a no-op)", host_us_per_call(full)))
    ops._step_launcher = real
    for name, us in rows:
        print(f"{name:45s} {us:7.1f} us")


if __name__ == "__main__":
    main()
