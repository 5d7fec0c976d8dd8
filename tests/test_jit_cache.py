"""Compile cache: memory and disk levels, keys, concurrency guard, corrupt and unwritable dirs (CPU)."""

import os
import subprocess
import sys
import warnings

import pytest

from snapmla_cute import jit_cache
from snapmla_cute.kernels import append_kv, dequant_kv, quant_q


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("SNAPMLA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SNAPMLA_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.setattr(jit_cache, "_memory_cache", {})
    return tmp_path


def test_keys_depend_on_config_and_arch_not_on_values(fresh):
    from snapmla_cute.kernels.decode import DecodeConfig

    a = jit_cache._disk_key("decode", DecodeConfig(128, 1, 64, False), "sm_90a")
    assert a == jit_cache._disk_key("decode", DecodeConfig(128, 1, 64, False), "sm_90a")
    assert a != jit_cache._disk_key("decode", DecodeConfig(128, 2, 64, False), "sm_90a")
    assert a != jit_cache._disk_key("decode", DecodeConfig(128, 1, 64, False), "sm_100a")
    assert len(jit_cache.source_fingerprint()) == 64


def test_disk_entry_written_then_loaded_without_compiling(fresh):
    k = quant_q.compile(arch="sm_90a")
    assert quant_q.compile(arch="sm_90a") is k  # memory level
    entries = list(fresh.glob("quant_q-*.o"))
    assert len(entries) == 1
    # a new process finds it on disk: cute.compile must not run
    code = (
        "import cutlass.cute as cute\n"
        "def boom(*a, **k): raise AssertionError('compiled again')\n"
        "cute.compile = boom\n"
        "from snapmla_cute.kernels import quant_q\n"
        "k = quant_q.compile(arch='sm_90a')\n"
        "print(type(k.fn).__name__)\n"
    )
    env = dict(os.environ, SNAPMLA_CACHE_DIR=str(fresh), CUTE_DSL_ARCH="sm_90a")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "Function" in r.stdout


def test_corrupt_entry_is_rebuilt_with_a_warning(fresh):
    dequant_kv.compile(arch="sm_90a")
    (entry,) = fresh.glob("dequant_kv-*.o")
    entry.write_bytes(b"not an object file")
    jit_cache._memory_cache.clear()
    with pytest.warns(UserWarning, match="could not be loaded"):
        dequant_kv.compile(arch="sm_90a")
    assert entry.read_bytes()[:4] == b"\x7fELF"


def test_unwritable_dir_falls_back_to_memory(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SNAPMLA_CACHE_DIR", str(blocker / "sub"))  # cannot mkdir under a file
    monkeypatch.setattr(jit_cache, "_memory_cache", {})
    with pytest.warns(UserWarning, match="not usable"):
        k = append_kv.compile(arch="sm_90a")
    assert callable(k.fn)


def test_disable_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("SNAPMLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SNAPMLA_DISABLE_DISK_CACHE", "1")
    monkeypatch.setattr(jit_cache, "_memory_cache", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quant_q.compile(arch="sm_90a")
    assert not list(tmp_path.iterdir())


def test_warmup_compiles_a_serving_set_without_gpu(fresh):
    from snapmla_cute import warmup

    n = warmup(heads=(64,), s_q=(1,), page_sizes=(64,), causal=(False,), head_groups=False, arch="sm_90a",
               progress=False)
    # 3 fused kernels, scheduler (metadata), decode step (one decode kernel) for a
    # quantized and for a bf16 query, each plain and in clusters of two (the head-group
    # steps left out: CI's compile report builds them)
    assert n == 8
    assert len(list(fresh.glob("*.o"))) == 8
    assert len(list(fresh.glob("decode_step_q-*.o"))) == 2
