"""The bench's peer figures, targets and ratio chart (CPU: no timing)."""

import json
from pathlib import Path

import pytest
import torch

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


def test_decode_peer_columns_and_target():
    # FlashMLA absent (``peers.dense_us`` gives Nones): the anchors' figures and target stand
    peers = anchors.peer_us("H100", 32, 64, 1, 8192, False)
    cols, figures = bench.peer_columns(75.0, dict(bf16=None, dense_fp8=None), peers)
    assert figures == dict(dense_fp8=77.3, bf16=120.9) and cols["peer_src"] == "anchors"
    assert list(cols) == ["flashmla_fp8_us", "x_fp8", "flashmla_bf16_us", "x_bf16", "peer_src"]
    assert anchors.target_us(figures, 57.2) == 67.3
    # timed here: the run's figures set the target
    cols, figures = bench.peer_columns(75.0, dict(bf16=110.0, dense_fp8=70.0), peers)
    assert cols["flashmla_fp8_us"] == 70.0 and cols["x_fp8"] == 0.93 and cols["peer_src"] == "here"
    assert anchors.target_us(figures, 10.0) == round(70.0 / 1.3, 1)
    # no figure at all (a shape the anchors lack, no flash_mla)
    cols, figures = bench.peer_columns(75.0, {}, anchors.peer_us("H100", 3, 64, 1, 999, False))
    assert cols["peer_src"] is None and anchors.target_us(figures, 10.0) is None


def test_flashinfer_columns():
    # FlashInfer absent or not asked for (``peers.flashinfer_us`` gives {}): no column at all
    assert bench.flashinfer_columns(75.0, {}) == {}
    cols = bench.flashinfer_columns(75.0, dict(fi_bf16=120.04, fi_fp8=90.0, note=None))
    assert list(cols) == list(bench.FI_COLUMN_NAMES)
    assert cols == dict(flashinfer_fp8_us=90.0, x_fi_fp8=1.2, flashinfer_bf16_us=120.0, x_fi_bf16=1.6, fi_note=None)
    # a refused kind: no figure, the reason in one line
    cols = bench.flashinfer_columns(75.0, dict(fi_bf16=None, fi_fp8=None, note="bf16: ValueError: page size"))
    assert cols["flashinfer_bf16_us"] is cols["x_fi_bf16"] is cols["flashinfer_fp8_us"] is None
    assert cols["fi_note"] == "bf16: ValueError: page size"


def test_print_table_takes_every_rows_columns(capsys):
    bench.print_table([dict(shape="a", us=1.0), dict(shape="b", us=2.0, x_fp8=1.234)])
    out = capsys.readouterr().out
    assert "x_fp8" in out and "1.23" in out


def test_sparse_peer_columns_from_the_anchors():
    from snapmla_cute.bench_sparse import sparse_peer

    # 8 heads: beside FlashMLA padded to h64; 128: as is (the anchors' figures, nothing timed)
    cols, figures = sparse_peer("H100", 64, 8, 1, 2048, 8192, 40.5, None, None, None, here=False)
    assert cols == dict(padded_h64_us=81.0, x_padded=2.0, peer_src="anchors") and figures == dict(sparse_h64=81.0)
    cols, _ = sparse_peer("H100", 128, 128, 1, 2048, 8192, 110.0, None, None, None, here=False)
    assert cols == dict(flashmla_sparse_us=178.3, x_flashmla=1.62, peer_src="anchors")
    cols, _ = sparse_peer("H200", 128, 128, 1, 2048, 8192, 110.0, None, None, None, here=False)
    assert cols == dict(flashmla_sparse_us=None, x_flashmla=None, peer_src=None)


def test_cp_rows_from_every_ranks_figures(monkeypatch):
    """``bench cp``'s rows (no GPU: the caches and timings stood in for): a row per dense and
    sparse shape, every rank's shard, the slowest rank's exchange, merge and whole call, and
    the slowest shard's share of the call; in one process the projection for ``world``."""
    import torch.distributed as dist

    from snapmla_cute import bench_cp

    built = []
    monkeypatch.setattr(bench_cp, "_cache_of", lambda b, L, ps, world=1, rank=0: built.append((b, L, world, rank)) or (b, L))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def dense(b, h, s_q, whole, shard, rank, world, multi):
        assert shard == (b, 262144 if h == 64 else 1048576) and (whole is None) == (rank > 0)
        f = dict(shard_us=100.0 + rank, merge_us=3.0, exchange_us=30.0 + rank, cp_us=140.0)
        return dict(f, one_gpu_us=200.0) if whole else f

    def sparse(b, h, s_q, L, topk, ps, whole, shard, rank, world, multi):
        assert (L, topk, shard) == (1048576, 2048, (b, L))
        f = dict(shard_us=20.0, translate_us=8.0, merge_us=3.0, exchange_us=30.0, cp_us=60.0)
        return dict(f, one_gpu_us=22.5) if whole else f

    monkeypatch.setattr(bench_cp, "_dense_figs", dense)
    monkeypatch.setattr(bench_cp, "_sparse_figs", sparse)
    shapes = [(8, 64, 1, 262144), (8, 128, 1, 1048576)]
    rows = bench_cp.bench_cp(shapes=shapes, world=4)  # one process: rank 0 of 4 projected
    assert built == [(8, 262144, 1, 0), (8, 262144, 4, 0), (8, 1048576, 1, 0), (8, 1048576, 4, 0)]
    assert [r["kind"] for r in rows] == ["dense", "dense", "sparse"]
    assert rows[0]["projected_no_exchange_us"] == 103.0 and rows[0]["speedup"] == round(200 / 103, 2)
    assert rows[2]["shape"] == "b8 h128 s_q1 topk2048 of 1048576 tokens" and rows[2]["translate_us"] == 8.0

    # under torchrun with 3 ranks: this is rank 0; the others' figures come from the gather
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def gather(figs, mine):
        figs[:] = [mine] + [{k: v + r for k, v in mine.items() if k != "one_gpu_us"} for r in (1, 2)]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    rows = bench_cp.bench_cp(shapes=shapes[:1], sparse_shapes=[])
    (row,) = rows
    assert (row["shard_us_r0"], row["shard_us_r1"], row["shard_us_r2"]) == (100.0, 101.0, 102.0)
    assert row["exchange_us"] == 32.0 and row["merge_us"] == 5.0 and row["cp_us"] == 142.0
    assert row["speedup"] == round(200 / 142, 2) and row["slowest_share"] == round(102 / 142, 2)
