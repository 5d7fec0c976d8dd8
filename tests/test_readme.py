"""README.md's examples run as written, so the quickstart cannot rot.

* Every ```python block runs on the GPU (`gpu` marker), each in a fresh namespace, in the
  README's order: the blocks are self-contained.
* Every line of a ```bash block that starts with ``snapmla-cute`` runs on the CPU as written
  (a subprocess, cwd a fresh tmp dir so outputs like ``--png out/`` land there) and must exit
  with 0, except lines whose comment starts with ``GPU`` (``# GPU`` or ``# GPU: ...``): those
  need a device. Lines that do not start with ``snapmla-cute`` (``pip install``, the pytest
  commands) are not run here: installing is what CI does first, and the pytest commands are
  this suite. CI runs on 2 cores, so a CPU line in the README must stay cheap (seconds); the
  long forms live in docs/.
* The README's CPU test command is the one ``.ci/run`` runs.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks(lang: str) -> list[str]:
    """The README's fenced blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def bash_lines() -> list[tuple[str, str]]:
    """(command, comment) of every command line of the README's ```bash blocks; a comment
    starts at the line's first ``#`` (no command in the README has one inside)."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            if command.strip():
                out.append((" ".join(command.split()), comment.strip()))
    return out


def cpu_cli_lines() -> list[str]:
    return [cmd for cmd, comment in bash_lines() if cmd.startswith("snapmla-cute") and not comment.startswith("GPU")]


def test_readme_has_the_examples_the_tests_run():
    assert len(blocks("python")) >= 2, "the quickstart (dense and sparse) is gone from README.md"
    assert cpu_cli_lines(), "no CPU command line left in README.md's ```bash blocks"


@pytest.mark.parametrize("command", cpu_cli_lines())
def test_readme_cpu_command_runs(command, tmp_path):
    beside = Path(sys.executable).parent / "snapmla-cute"  # this environment's install first
    exe = str(beside) if beside.exists() else shutil.which("snapmla-cute")
    assert exe, "snapmla-cute is not installed (pip install -e .)"
    argv = [exe, *shlex.split(command)[1:]]
    env = {**os.environ, "CUTE_DSL_ARCH": os.environ.get("CUTE_DSL_ARCH", "sm_90a"),
           "SNAPMLA_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_readme_test_command_is_the_ci_one():
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip()]
    assert ci[-1] == "python -m pytest -q", ci[-1]  # .ci/run ends with the README's test command
    assert "python -m pytest -q" in [cmd for cmd, _ in bash_lines()]


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(blocks("python"))), ids=lambda i: f"block{i + 1}")
def test_readme_python_block_runs(index):
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    code = blocks("python")[index]
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": f"readme_block{index + 1}"})
    torch.cuda.synchronize()
