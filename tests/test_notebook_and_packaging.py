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


def test_cli_layouts_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from snapmla_cute.cli import main
    from snapmla_cute.layouts import p_permute

    assert main(["layouts", "--png", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["content.png", "p.png", "rope.png", "vt.png"]
    text = capsys.readouterr().out
    # The pictures are of what the kernel ships: Vᵀ and P by token in the order π.
    assert "vt, token order π (kernel default)" in text and "p, token order π (kernel default)" in text
    assert f"π order (shipped) {p_permute.pi_packed_labels(0)}" in text


def _host_path_file():
    """A path file giving a fresh venv this environment's site-packages: each directory, then
    the lines of its own path files (the DSL puts its packages on sys.path through one) except
    this checkout's editable-install hook, which would shadow the install under test."""
    import site
    import sysconfig

    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    lines = []
    for d in dict.fromkeys(d for d in dirs if Path(d).is_dir()):
        lines.append(d)
        for pth in sorted(Path(d).glob("*.pth")):
            if not pth.name.startswith("__editable__"):
                lines += pth.read_text().splitlines()
    return "".join(line + "\n" for line in lines)


def test_pip_install_into_fresh_venv(tmp_path):
    """A non-editable install runs the CLI and keeps layouts/pipelines under snapmla_cute only.

    The new venv has no system site-packages: when this interpreter is itself a venv (as in
    .ci/run), `--system-site-packages` would expose the *base* Python's packages, not this
    environment's torch. Its dependencies come from this environment's site-packages through
    a path file appended after the venv's own, so the fresh install is found first."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout.strip()
    (Path(purelib) / "zz_host_env.pth").write_text(_host_path_file())
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
        check=True, env=env, cwd=tmp_path,
    )
    r = subprocess.run([str(venv / "bin" / "snapmla-cute"), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "accuracy" in r.stdout, r.stderr
    code = (
        "import importlib.util, sys, snapmla_cute, snapmla_cute.layouts, snapmla_cute.pipelines;"
        "import snapmla_cute.kernels.decode as D;"
        "assert snapmla_cute.__file__.startswith(sys.argv[1]), snapmla_cute.__file__;"
        "assert D.__file__.startswith(sys.argv[1]), D.__file__;"
        "assert snapmla_cute.layouts.__file__.startswith(sys.argv[1]), snapmla_cute.layouts.__file__;"
        "assert importlib.util.find_spec('layouts') is None and importlib.util.find_spec('pipelines') is None"
    )
    r = subprocess.run([str(py), "-c", code, purelib], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
