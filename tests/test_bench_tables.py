"""The bench's peer figures, targets and ratio chart (CPU: no timing)."""

import json
from pathlib import Path

import pytest

from snapmla_cute import anchors, bench

SHARED = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "h100_anchors.json"


def test_every_standard_shape_has_both_peers_on_both_kinds():
    # the twelve rows FlashMLA's kernels were measured at (h8 and s_q8 rows have no peer figure)
    measured = [s for s in bench.DECODE_SHAPES if s in anchors.FLASHMLA_HOPPER_US]
    assert len(measured) == 12
    for shape in measured:
        for kind in ("H100", "H200"):
            peers = anchors.peer_us(kind, *shape)
            assert peers["bf16"] and peers["dense_fp8"], (kind, shape)
    assert anchors.peer_us(None, *bench.DECODE_SHAPES[0]) == dict(bf16=None, dense_fp8=None)


@pytest.mark.skipif(not SHARED.exists(), reason="the shared anchors file is not beside this checkout")
def test_peer_table_restates_the_shared_anchors():
    src = json.loads(SHARED.read_text())["flashmla_hopper_kernels_2026_11_23"]
    for kind in ("h100", "h200"):
        for r in src[kind]:
            key = (r["b"], r["h"], r["s_q"], r["s_k"], r["varlen"])
            assert anchors.FLASHMLA_HOPPER_US[key][kind.upper()] == (r["bf16_us"], r["dense_fp8_us"])


def test_target_rule():
    # best peer 77.3 -> 59.5; floor 57.2 -> 67.3: the slower (larger) one
    assert anchors.target_us(dict(bf16=120.9, dense_fp8=77.3), 57.2) == 67.3
    assert anchors.target_us(dict(bf16=245.3, dense_fp8=221.8), 121.3) == round(221.8 / 1.3, 1)
    assert anchors.target_us(dict(bf16=None, dense_fp8=None), 10.0) is None


def test_ratio_chart(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        dict(shape="b128 h128 s_q1 s_k4096", us=196.0, floor_us=121.3, pct_floor=61.9, x_fp8=1.13, x_bf16=1.25, target_us=171.0),
        dict(shape="b1 h128 s_q1 s_k640", us=13.6, floor_us=0.2, pct_floor=1.5, x_fp8=0.89, x_bf16=0.9, target_us=9.3),
        dict(shape="custom", us=50.0, floor_us=20.0, pct_floor=40.0, x_fp8=None, x_bf16=None, target_us=None),
    ]
    bench.plot_rows(rows, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 1000
