"""Compile cache: one compiled object per (kernel, config, arch), never keyed by tensor values.

Kernels are compiled against fake tensors (symbolic row counts, static strides), so one
object serves every batch size, and compiling needs no GPU: with ``arch="sm_90a"`` this
works on a CPU-only machine, which is how CI checks the generated code.
Calls go through TVM-FFI with torch tensors directly (FP8 passes as uint8 views).

Two levels: in memory (per process), and on disk as exported TVM-FFI objects
(``SNAPMLA_CACHE_DIR``, default ``~/.cache/snapmla_cute``; ``SNAPMLA_DISABLE_DISK_CACHE=1``
turns it off). A disk entry's name carries a hash of everything that changes the code: the
kernel, its config, the arch, the DSL version and a fingerprint of our kernel sources.
Writers take a file lock and publish with an atomic rename, so processes starting together
compile each kernel once; an unreadable entry is recompiled with a warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

_lock = threading.Lock()
_memory_cache: dict[tuple, Any] = {}
_fingerprint: str | None = None
_PACKAGE = Path(__file__).resolve().parent


def source_fingerprint() -> str:
    """sha256 over the sources that generate device code, and the DSL version."""
    global _fingerprint
    if _fingerprint is None:
        import cutlass

        h = hashlib.sha256(f"cutlass-dsl {cutlass.__version__}".encode())
        files = sorted(_PACKAGE.glob("kernels/*.py")) + sorted(_PACKAGE.joinpath("layouts").glob("*.py"))
        files += sorted(_PACKAGE.joinpath("pipelines").glob("*.py")) + [_PACKAGE / "format.py", Path(__file__)]
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
        _fingerprint = h.hexdigest()
    return _fingerprint


def cache_dir() -> Path | None:
    if os.environ.get("SNAPMLA_DISABLE_DISK_CACHE", "") not in ("", "0"):
        return None
    return Path(os.environ.get("SNAPMLA_CACHE_DIR") or Path.home() / ".cache" / "snapmla_cute")


def _disk_key(name: str, config, arch: str) -> str:
    text = f"{name}|{config!r}|{arch or 'native'}|{source_fingerprint()}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    config: Any
    arch: str
    fn: Callable
    artifacts: Any = field(default=None, compare=False, repr=False)

    def __call__(self, *args):
        return self.fn(*args)


def _fake_args(name: str, config=None, n=None):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from snapmla_cute.format import CONTENT_DIM, HEAD_DIM, KV_ROW_BYTES, ROPE_DIM  # noqa: F401

    bf16, u8, f32, i64, i32 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float32, cutlass.Int64, cutlass.Int32
    n = cute.sym_int() if n is None else n
    slots = cute.sym_int()
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)

    def rows_in():  # bf16 [n, 576] split into its content and RoPE views
        return (
            make_fake_tensor(bf16, (n, CONTENT_DIM), (HEAD_DIM, 1), assumed_align=16),
            make_fake_tensor(bf16, (n, ROPE_DIM), (HEAD_DIM, 1), assumed_align=16),
        )

    def cache():  # uint8 [S, 640] split into content bytes, bf16 RoPE, and fp32 scales
        return (
            make_fake_tensor(u8, (slots, CONTENT_DIM), (KV_ROW_BYTES, 1), assumed_align=16),
            make_fake_tensor(bf16, (slots, ROPE_DIM), (KV_ROW_BYTES // 2, 1), assumed_align=16),
            make_fake_tensor(f32, (slots,), (1,), assumed_align=4),
        )

    if name == "quant_q":
        return (
            *rows_in(),
            make_fake_tensor(u8, (n, CONTENT_DIM), (CONTENT_DIM, 1), assumed_align=16),
            make_fake_tensor(bf16, (n, ROPE_DIM), (ROPE_DIM, 1), assumed_align=16),
            make_fake_tensor(f32, (n,), (1,), assumed_align=4),
            stream,
        )
    if name == "append_kv":
        return (*rows_in(), make_fake_tensor(i64, (n,), (1,), assumed_align=8), *cache(), stream)
    if name == "dequant_kv":
        return (*cache(), make_fake_tensor(i64, (n,), (1,), assumed_align=8), *rows_in(), stream)
    if name == "decode_scheduler":
        parts = cute.sym_int()
        return (
            make_fake_tensor(i32, (n,), (1,), assumed_align=4),
            make_fake_tensor(i32, (parts, 8), (8, 1), assumed_align=16),
            make_fake_tensor(i32, (cute.sym_int(),), (1,), assumed_align=4),
            stream,
        )
    if name == "decode_step":
        # natural (contiguous PyTorch) layouts; one symbolic batch size ties q, the table,
        # the lengths and the outputs together, so TVM-FFI rejects a mismatch before launch
        h, s_q, ps = config.decode.heads, config.decode.s_q, config.decode.page_size
        R = h * s_q
        fp8 = cutlass.Float8E4M3FN
        pages, splits = cute.sym_int(), cute.sym_int()
        return (
            make_fake_tensor(fp8, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), assumed_align=16),
            make_fake_tensor(bf16, (n, s_q, h, ROPE_DIM), (R * ROPE_DIM, h * ROPE_DIM, ROPE_DIM, 1), assumed_align=16),
            make_fake_tensor(f32, (n, s_q, h), (R, h, 1), assumed_align=4),
            make_fake_tensor(i32, (n, cute.sym_int()), (cute.sym_int(), 1), assumed_align=4),
            make_fake_tensor(i32, (n,), (1,), assumed_align=4),
            make_fake_tensor(bf16, (n, s_q, h, CONTENT_DIM), (R * CONTENT_DIM, h * CONTENT_DIM, CONTENT_DIM, 1), assumed_align=16),
            make_fake_tensor(f32, (n, h, s_q), (R, s_q, 1), assumed_align=4),
            make_fake_tensor(u8, (pages, ps, KV_ROW_BYTES), (ps * KV_ROW_BYTES, KV_ROW_BYTES, 1), assumed_align=16),
            make_fake_tensor(f32, (pages, ps), (ps, 1), assumed_align=16),
            make_fake_tensor(i32, (cute.sym_int(), 8), (8, 1), assumed_align=16),
            make_fake_tensor(i32, (n,), (1,), assumed_align=4),
            make_fake_tensor(f32, (splits, R, CONTENT_DIM), (R * CONTENT_DIM, CONTENT_DIM, 1), assumed_align=16),
            make_fake_tensor(f32, (splits, R), (R, 1), assumed_align=4),
            make_fake_tensor(i32, (n, 2 * config.decode.m_tiles), (2 * config.decode.m_tiles, 1), assumed_align=4),
            cutlass.Float32(0.0),
            stream,
        )
    if name == "decode_step_q":  # the same from a bf16 query, quantized into the q buffers
        s_q, h = config.decode.s_q, config.decode.heads
        q = make_fake_tensor(bf16, (n, s_q, h, HEAD_DIM), (s_q * h * HEAD_DIM, h * HEAD_DIM, HEAD_DIM, 1), assumed_align=16)
        return (q, *_fake_args("decode_step", config, n))
    if name == "decode":
        h, s_q, ps = config.heads, config.s_q, config.page_size
        R = h * s_q
        pages, splits, parts, width = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
        return (
            make_fake_tensor(u8, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), assumed_align=16),
            make_fake_tensor(bf16, (R, ROPE_DIM, n), (ROPE_DIM, 1, R * ROPE_DIM), assumed_align=16),
            make_fake_tensor(f32, (R, n), (1, R), assumed_align=4),
            make_fake_tensor(u8, (ps, CONTENT_DIM, pages), (KV_ROW_BYTES, 1, ps * KV_ROW_BYTES), assumed_align=16),
            make_fake_tensor(bf16, (ps, ROPE_DIM, pages), (KV_ROW_BYTES // 2, 1, ps * KV_ROW_BYTES // 2), assumed_align=16),
            make_fake_tensor(f32, (ps, pages), (1, ps), assumed_align=16),
            make_fake_tensor(i32, (n, width), (cute.sym_int(), 1), assumed_align=4),
            make_fake_tensor(i32, (n,), (1,), assumed_align=4),
            make_fake_tensor(i32, (parts, 8), (8, 1), assumed_align=16),
            make_fake_tensor(i32, (cute.sym_int(),), (1,), assumed_align=4),
            make_fake_tensor(bf16, (R, CONTENT_DIM, n), (CONTENT_DIM, 1, R * CONTENT_DIM), assumed_align=16),
            make_fake_tensor(f32, (n, h, s_q), (h * s_q, s_q, 1), assumed_align=4),
            make_fake_tensor(f32, (R, CONTENT_DIM, splits), (CONTENT_DIM, 1, R * CONTENT_DIM), assumed_align=16),
            make_fake_tensor(f32, (R, splits), (1, R), assumed_align=4),
            make_fake_tensor(i32, (n, 2 * config.m_tiles), (2 * config.m_tiles, 1), assumed_align=4),
            cutlass.Float32(0.0),
            stream,
        )
    raise KeyError(name)


# name → (module under snapmla_cute.kernels, kernel class, default config class or None)
_KERNELS = {
    "quant_q": ("quant_q", "QuantizeQKernel", "QuantQConfig"),
    "append_kv": ("append_kv", "AppendKVKernel", "AppendKVConfig"),
    "dequant_kv": ("dequant_kv", "DequantizeKVKernel", "DequantKVConfig"),
    "decode_scheduler": ("decode_scheduler", "DecodeSchedulerKernel", "SchedulerConfig"),
    "decode": ("decode", "DecodeKernel", None),
    "decode_step": ("decode_step", "DecodeStepKernel", None),
    "decode_step_q": ("decode_step", "DecodeStepQuantKernel", None),
}


def _kernel_module(name: str):
    import importlib

    return importlib.import_module(f"snapmla_cute.kernels.{_KERNELS[name][0]}")


def _kernel_object(name: str, config):
    return getattr(_kernel_module(name), _KERNELS[name][1])(config)


def default_config(name: str):
    """The default config of a kernel that has one (the decode kernels need shape configs)."""
    cls = _KERNELS[name][2]
    if cls is None:
        raise KeyError(f"{name} has no default config: pass one")
    return getattr(_kernel_module(name), cls)()


KERNEL_NAMES = ("quant_q", "append_kv", "dequant_kv")


def compile_kernel(name: str, config=None, *, arch: str | None = None, keep_sass: bool = False):
    """Compiles (or returns the cached) kernel ``name`` for ``config``.

    ``arch`` (e.g. ``"sm_90a"``) cross-compiles without a GPU; ``None`` targets the local GPU.
    ``keep_sass`` keeps PTX, cubin and SASS on the returned object's ``artifacts``.
    """
    import cutlass.cute as cute

    config = default_config(name) if config is None else config
    arch = arch or os.environ.get("CUTE_DSL_ARCH") or ""
    key = (name, config, arch, keep_sass)
    with _lock:
        hit = _memory_cache.get(key)
        if hit is not None:
            return hit

        def build():
            options = ["--enable-tvm-ffi"]
            if arch:
                options.append(f"--gpu-arch {arch}")
            if keep_sass:
                dump_dir = tempfile.mkdtemp(prefix=f"snapmla-{name}-")
                options += ["--keep-ptx", "--keep-cubin", "--keep-sass", f"--dump-dir {dump_dir}"]
            return cute.compile(_kernel_object(name, config), *_fake_args(name, config), options=" ".join(options))

        if keep_sass:  # the report needs the artifacts of a fresh compile
            fn = build()
            compiled = CompiledKernel(name, config, arch, fn, artifacts=fn.artifacts)
        else:
            compiled = CompiledKernel(name, config, arch, _disk_cached(name, config, arch, build))
        _memory_cache[key] = compiled
        return compiled


def _load(path: Path, symbol: str):
    from cutlass.cute.runtime import load_module

    return load_module(str(path), enable_tvm_ffi=True)[symbol]


def _disk_cached(name: str, config, arch: str, build: Callable):
    """Loads the exported object for this key, or compiles, exports and loads it."""
    root = cache_dir()
    if root is None:
        return build()
    key = _disk_key(name, config, arch)
    symbol = f"snapmla_{name}_{key[:12]}"
    path = root / f"{name}-{key}.o"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_file = open(root / f"{name}-{key}.lock", "a")
    except OSError as e:
        warnings.warn(f"snapmla_cute: compile cache directory {root} is not usable ({e}); compiling in memory only")
        return build()
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # one writer per entry; others wait, then load
        if path.exists():
            try:
                return _load(path, symbol)
            except Exception as e:  # corrupt or foreign entry: rebuild it
                warnings.warn(f"snapmla_cute: cached kernel {path} could not be loaded ({e}); recompiling")
        fn = build()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.o")
        try:
            fn.export_to_c(str(tmp), function_name=symbol, export_only_tvm_ffi_symbols=True)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"snapmla_cute: could not write {path} ({e}); using the in-memory kernel")
            tmp.unlink(missing_ok=True)
            return fn
        return fn
