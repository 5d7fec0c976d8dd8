"""GPU: where the host time of one ``mla_decode`` call goes (profiles/host_overhead.md).

Splits one ``mla_decode(check=False)`` call with metadata/out/lse given into the bare
compiled step call (one TVM-FFI call: argument decoding and three or four launches) and
the Python around it (the compiled step swapped for a no-op), for a quantized and a bf16
query. ``ffi_cost.py`` splits the bare call further (per tensor argument, per launch).

    python3 profiles/experiments/host_overhead.py
"""

import snapmla_cute.decode as ops
from snapmla_cute.bench import host_us_per_call
from snapmla_cute.profiling import Shape, make_case


def main():
    c = make_case(Shape("b1 h128 s_q1 s_k640", 1, 128, 1, 640, False))
    q, cache, bt, lens, md, out, lse = (c[k] for k in ("q", "cache", "block_table", "seqlens", "metadata", "out", "lse"))
    q16 = c["q_bf16"]
    rows = []
    for name, qq in (("quantized q", q), ("bf16 q", q16)):
        def call():
            ops.mla_decode(qq, cache, bt, lens, metadata=md, out=out, lse=lse, check=False)

        step, args = ops._step_call(qq, cache, bt, lens, md, out, lse, None, False)
        rows.append((f"mla_decode, {name}", host_us_per_call(call, 2000)))
        rows.append((f"bare step call, {name}", host_us_per_call(lambda: step(*args), 2000)))
        key = next(k for k, v in ops._hot_steps.items() if v is step)
        ops._hot_steps[key] = lambda *a: None
        rows.append((f"Python only (step swapped for a no-op), {name}", host_us_per_call(call, 2000)))
        ops._hot_steps[key] = step
    for name, us in rows:
        print(f"{name:55s} {us:7.2f} us")


if __name__ == "__main__":
    main()
