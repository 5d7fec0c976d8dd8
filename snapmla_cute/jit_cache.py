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
# the packages whose code is traced into kernels, and the modules of ours they import; the
# packages are found through their imported ``__path__`` (layouts/ and pipelines/ live at the
# top of a checkout and are mapped under snapmla_cute only by the install)
_TRACED_PACKAGES = ("snapmla_cute.kernels", "snapmla_cute.layouts", "snapmla_cute.pipelines")
_TRACED_MODULES = ("snapmla_cute.format", "snapmla_cute.heads", "snapmla_cute.jit_cache", "snapmla_cute.ptx")


def fingerprint_files() -> dict[str, Path]:
    """Every source file the compile key covers, by its name inside its package (the same in
    a checkout and in an install), wherever the packages live."""
    import importlib

    files = {}
    for name in _TRACED_PACKAGES:
        for root in importlib.import_module(name).__path__:
            root = Path(root).resolve()
            for f in root.rglob("*.py"):
                files[f"{name}/{f.relative_to(root).as_posix()}"] = f
    for name in _TRACED_MODULES:
        files[name] = Path(importlib.import_module(name).__file__).resolve()
    return dict(sorted(files.items()))


def source_fingerprint() -> str:
    """sha256 over the sources that generate device code (``fingerprint_files``) and the DSL version."""
    global _fingerprint
    if _fingerprint is None:
        import cutlass

        h = hashlib.sha256(f"cutlass-dsl {cutlass.__version__}".encode())
        for label, f in fingerprint_files().items():
            h.update(label.encode())
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


def compile_kernel(
    name: str, config, make_kernel: Callable, fake_args: Callable, *, arch: str | None = None, keep_sass: bool = False
):
    """Compiles (or returns the cached) kernel ``make_kernel(config)`` against ``fake_args(config)``.

    Each kernel module calls this from its own ``compile`` (beside the kernel, with its fake
    arguments); ``name`` names the kernel in cache keys and file names. ``arch`` (e.g.
    ``"sm_90a"``) cross-compiles without a GPU; ``None`` targets the local GPU.
    ``keep_sass`` keeps PTX, cubin and SASS on the returned object's ``artifacts``.
    """
    import cutlass.cute as cute

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
            return cute.compile(make_kernel(config), *fake_args(config), options=" ".join(options))

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
