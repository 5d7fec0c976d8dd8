"""GPU: a kernel exported to the disk cache by one process is loaded (not compiled) by the
next and computes the same decode, bit for bit."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

CODE = """
import sys, torch
sys.path.insert(0, "tests")
if sys.argv[2] == "load":
    import cutlass.cute as cute
    def boom(*a, **k):
        raise AssertionError("compiled again instead of loading the cached object")
    cute.compile = boom
from decode_cases import build_case
from snapmla_cute import decode_metadata, mla_decode
c = build_case(2, 1, 64, 64, [1000, 333], seed=5)
md = decode_metadata(c["cache_seqlens"], s_q=1, heads=64)
out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
torch.save((out.cpu(), lse.cpu()), sys.argv[1])
"""


def test_second_process_loads_from_disk_and_matches(tmp_path):
    import torch

    env = dict(os.environ, SNAPMLA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("SNAPMLA_DISABLE_DISK_CACHE", None)
    for run in ("compile", "load"):
        r = subprocess.run(
            [sys.executable, "-c", CODE, str(tmp_path / f"{run}.pt"), run], capture_output=True, text=True, env=env
        )
        assert r.returncode == 0, r.stderr[-3000:]
    assert list((tmp_path / "cache").glob("decode_step_q-*.o"))  # the bf16-query step
    a, b = torch.load(tmp_path / "compile.pt"), torch.load(tmp_path / "load.pt")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
