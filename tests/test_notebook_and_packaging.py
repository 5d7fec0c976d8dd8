"""The layout notebook executes on the CPU; a plain `pip install .` gives a working CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_layout_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "layouts" / "layouts.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit it without outputs"
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "transposed in place: ok" in text


def test_cli_layouts_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from snapmla_cute.cli import main

    assert main(["layouts", "--png", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["content.png", "p.png", "rope.png", "vt.png"]


def test_pip_install_into_fresh_venv(tmp_path):
    """A non-editable install (dependencies from this environment) runs the CLI and keeps
    layouts/pipelines under snapmla_cute only."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
        check=True, env=env, cwd=tmp_path,
    )
    r = subprocess.run([str(venv / "bin" / "snapmla-cute"), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "accuracy" in r.stdout
    code = (
        "import importlib.util, snapmla_cute, snapmla_cute.layouts, snapmla_cute.pipelines;"
        "assert 'site-packages' in snapmla_cute.__file__, snapmla_cute.__file__;"
        "assert importlib.util.find_spec('layouts') is None and importlib.util.find_spec('pipelines') is None"
    )
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
