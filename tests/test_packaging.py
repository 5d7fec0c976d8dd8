"""layouts/ and pipelines/ install as snapmla_cute.layouts / snapmla_cute.pipelines only."""

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_subpackages_import_from_the_install_not_the_checkout(tmp_path):
    # From a directory outside the checkout only the installed package can be found.
    r = _run(
        "import importlib.util, snapmla_cute.layouts as L, snapmla_cute.pipelines as P;"
        "print(L.__file__); print(P.__file__);"
        "print(importlib.util.find_spec('layouts'), importlib.util.find_spec('pipelines'))",
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    lay, pipe, top = r.stdout.strip().splitlines()
    assert lay.endswith(os.path.join("layouts", "__init__.py"))
    assert pipe.endswith(os.path.join("pipelines", "__init__.py"))
    assert top == "None None"  # never generic top-level names


def test_distribution_declares_no_top_level_layouts():
    dist = importlib.metadata.distribution("snapmla-cute")
    top = (dist.read_text("top_level.txt") or "").split()
    assert "layouts" not in top and "pipelines" not in top
    assert dist.entry_points.select(group="console_scripts", name="snapmla-cute")


def test_every_package_of_the_tree_is_declared():
    """pyproject lists its packages by hand: a subpackage left out installs without its files
    (an editable install still finds them, a wheel does not)."""
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "snapmla_cute").rglob("__init__.py")}
    found |= {"snapmla_cute.layouts", "snapmla_cute.pipelines"}
    assert found == declared, (sorted(found - declared), sorted(declared - found))
