import os

import pytest
import torch

# Compile-only tests target Hopper even on a machine without a GPU.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a") if not torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (SM90)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure) so each run draws new inputs;
    ``SNAPMLA_SEED`` replays a printed one."""
    s = int(os.environ["SNAPMLA_SEED"]) if os.environ.get("SNAPMLA_SEED") else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


def pytest_configure(config):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))  # tests/decode_cases.py
