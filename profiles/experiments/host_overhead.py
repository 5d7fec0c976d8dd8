"""GPU: where the host time of one ``mla_decode`` call goes (not yet run; for issue 5).

Splits one ``mla_decode(check=False)`` call with metadata/out/lse given into: the Python
checks and view building (launcher replaced by a no-op), the bare compiled step call with
the same argument objects every time, and the bare call with freshly built views each time
(to test whether TVM-FFI's per-object tensor conversion is what costs).

    python3 profiles/experiments/host_overhead.py
"""

import snapmla_cute.ops as ops
from snapmla_cute.bench import host_us_per_call
from snapmla_cute.profiling import Shape, make_case


def main():
    c = make_case(Shape("b1 h128 s_q1 s_k640", 1, 128, 1, 640, False))
    full = c["step"]
    fixed = (*c["q"], c["cache"], c["block_table"], c["seqlens"], c["metadata"], c["out"], c["lse"], None, False)
    step, args = ops._step_call(*fixed)

    def fresh():
        _, a = ops._step_call(*fixed)
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
