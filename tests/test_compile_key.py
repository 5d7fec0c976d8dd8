"""The disk cache's key sees every source traced into a kernel, and the decode's schedule
switches are each used outside the kernel (CPU)."""

import ast
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from snapmla_cute import jit_cache

ROOT = Path(__file__).resolve().parents[1]

# a fresh process records every Python function called while one decode step is compiled
# (imports done first: what runs then is the tracing itself)
_PROFILE = """
import json, sys, threading
import snapmla_cute.kernels.decode.compile as dc
from snapmla_cute.kernels.decode import DecodeConfig
from snapmla_cute.kernels.decode.step import DecodeStepConfig
files = set()
def prof(frame, event, arg):
    if event == "call":
        files.add(frame.f_code.co_filename)
sys.setprofile(prof)
threading.setprofile(prof)
dc.compile_step_q(DecodeStepConfig(DecodeConfig(16, 2, 64, True)), arch="sm_90a")
sys.setprofile(None)
print(json.dumps(sorted(files)))
"""


def _project_roots():
    """The real directories of our packages (layouts/ and pipelines/ sit at the top of a
    checkout, mapped under snapmla_cute by the install)."""
    return [Path(p).resolve() for name in ("snapmla_cute", "snapmla_cute.layouts", "snapmla_cute.pipelines")
            for p in importlib.import_module(name).__path__]


def _ours(path) -> bool:
    path = Path(path).resolve()
    return path.suffix == ".py" and any(path.is_relative_to(r) for r in _project_roots())


def _covered():
    return {p.resolve() for p in jit_cache.fingerprint_files().values()}


def test_fingerprint_covers_every_source_run_while_tracing_the_decode():
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", SNAPMLA_DISABLE_DISK_CACHE="1")
    r = subprocess.run([sys.executable, "-c", _PROFILE], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    run = {Path(f).resolve() for f in json.loads(r.stdout.splitlines()[-1]) if _ours(f)}
    # the pipelines and the layouts are among them (what the old key missed)
    assert any(p.name == "handshakes.py" for p in run) and any(p.name == "transpose.py" for p in run)
    assert not run - _covered(), sorted(map(str, run - _covered()))


def _imports(path: Path, package: str):
    """Module names a source file imports (anywhere in it), relative imports resolved."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)  # a package's __init__ is dropped by the caller
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def test_fingerprint_covers_every_module_the_kernels_import():
    """Constants are traced in too (e.g. format's dims, the roles' register budgets): every
    module of ours that a covered file imports, directly or not, is covered."""
    import importlib.util

    covered = _covered()
    seen, todo = set(), [p for p in covered]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        label = next(k for k, v in jit_cache.fingerprint_files().items() if v.resolve() == path)
        package = label.rsplit("/", 1)[0].replace("/", ".") if "/" in label else label.rsplit(".", 1)[0]
        for name in _imports(path, package):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue
            if spec is None or not spec.origin or not _ours(spec.origin):
                continue
            if spec.submodule_search_locations is not None and not name.startswith(package):
                continue  # a parent package (`from snapmla_cute import jit_cache`): not traced
            origin = Path(spec.origin).resolve()
            assert origin in covered, f"{path} imports {name} ({origin}), which the fingerprint misses"
            todo.append(origin)


def test_fingerprint_changes_with_a_layout_file(monkeypatch, tmp_path):
    """Editing layouts/ (traced into the kernel) changes the key."""
    files = jit_cache.fingerprint_files()
    label = next(k for k in files if k.startswith("snapmla_cute.layouts/"))
    copy = tmp_path / "edited.py"
    copy.write_text(files[label].read_text() + "\n# edited\n")
    before = jit_cache.source_fingerprint()
    monkeypatch.setattr(jit_cache, "_fingerprint", None)
    monkeypatch.setattr(jit_cache, "fingerprint_files", lambda: {**files, label: copy})
    assert jit_cache.source_fingerprint() != before


def test_every_schedule_switch_is_set_outside_the_kernel():
    """The decode's schedule fields keep their non-default values alive only where a test
    or a profiling script runs them; a switch nobody sets should be deleted, not kept."""
    from snapmla_cute.kernels.decode import DecodeConfig

    profiling = {"skip", "trace"}
    schedule = [f for f in dataclasses.fields(DecodeConfig)
                if f.default is not dataclasses.MISSING and f.name not in profiling]
    assert schedule
    text = "".join(p.read_text() for d in ("tests", "profiles") for p in (ROOT / d).rglob("*.py"))
    text += (ROOT / "snapmla_cute" / "compile_report.py").read_text()
    for f in schedule:
        # `name=value` or `"name": value` with a value other than the default
        values = re.findall(rf"""(?:\b{f.name}\s*=|["']{f.name}["']\s*:)\s*([\w.]+)""", text)
        assert any(v != repr(f.default) for v in values), f"{f.name}: no test or script sets a non-default value"
