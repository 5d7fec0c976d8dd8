"""GPU: host cost of a TVM-FFI call of a CuTe DSL function, by tensor-argument count and
number of kernel launches, to decide how to cut ``mla_decode``'s host time
(profiles/host_overhead.md).

Empty kernels; every row is the wall time of issuing one call from Python.

    python3 profiles/experiments/ffi_cost.py
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from snapmla_cute.bench import host_us_per_call


class Empty:
    """``launches`` empty kernels; each takes the first tensor argument."""

    def __init__(self, launches: int):
        self.launches = launches

    @cute.kernel
    def kernel(self, t0: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx > 1024:
            t0[0] = t0[1]

    @cute.jit
    def launch_all(self, t0: cute.Tensor, stream):
        for _ in cutlass.range_constexpr(self.launches):
            self.kernel(t0).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


class Args1(Empty):
    @cute.jit
    def __call__(self, t0: cute.Tensor, stream):
        self.launch_all(t0, stream)


class Args4(Empty):
    @cute.jit
    def __call__(self, t0: cute.Tensor, t1: cute.Tensor, t2: cute.Tensor, t3: cute.Tensor, stream):
        self.launch_all(t0, stream)


class Args8(Empty):
    @cute.jit
    def __call__(
        self, t0: cute.Tensor, t1: cute.Tensor, t2: cute.Tensor, t3: cute.Tensor,
        t4: cute.Tensor, t5: cute.Tensor, t6: cute.Tensor, t7: cute.Tensor, stream,
    ):
        self.launch_all(t0, stream)


class Args16(Empty):
    @cute.jit
    def __call__(
        self, t0: cute.Tensor, t1: cute.Tensor, t2: cute.Tensor, t3: cute.Tensor,
        t4: cute.Tensor, t5: cute.Tensor, t6: cute.Tensor, t7: cute.Tensor,
        t8: cute.Tensor, t9: cute.Tensor, t10: cute.Tensor, t11: cute.Tensor,
        t12: cute.Tensor, t13: cute.Tensor, t14: cute.Tensor, t15: cute.Tensor, stream,
    ):
        self.launch_all(t0, stream)


def compile_variant(cls, n_args: int, launches: int, dyn: bool, dtype=cutlass.Int32):
    shape = (cute.sym_int(),) if dyn else (16,)
    fakes = [make_fake_tensor(dtype, shape, (1,), assumed_align=16) for _ in range(n_args)]
    return cute.compile(cls(launches), *fakes, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def main():
    rows = []
    t = torch.zeros(16, dtype=torch.int32, device="cuda")
    for cls, n in ((Args1, 1), (Args4, 4), (Args8, 8), (Args16, 16)):
        for launches in (0, 1, 3):
            for dyn in (False, True):
                fn = compile_variant(cls, n, launches, dyn)
                args = [t] * n
                rows.append((f"{n:2d} tensors, {launches} launches, {'dynamic' if dyn else 'static'} shape", host_us_per_call(lambda: fn(*args), 2000)))
                print(rows[-1], flush=True)
    try:
        f8 = torch.zeros(16, dtype=torch.float8_e4m3fn, device="cuda")
        fn = compile_variant(Args1, 1, 1, True, cutlass.Float8E4M3FN)
        rows.append(("fp8 torch tensor into a Float8E4M3FN arg", host_us_per_call(lambda: fn(f8), 2000)))
    except Exception as e:  # DLPack may not carry FP8
        rows.append((f"fp8 torch tensor: {type(e).__name__}: {str(e)[:80]}", float("nan")))
    x = torch.zeros(128, 128, 512, device="cuda")
    rows.append(("torch: x.zero_() (one launch via torch)", host_us_per_call(lambda: x.zero_(), 2000)))
    rows.append(("torch: x.view(-1) ", host_us_per_call(lambda: x.view(-1), 2000)))
    rows.append(("torch: x.permute(1, 2, 0)", host_us_per_call(lambda: x.permute(1, 2, 0), 2000)))
    rows.append(("python: empty lambda", host_us_per_call(lambda: None, 2000)))
    for name, us in rows:
        print(f"{name:60s} {us:7.2f} us")


if __name__ == "__main__":
    main()
