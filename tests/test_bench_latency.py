"""``snapmla-cute bench latency`` (CPU: no timing): the shape list, the H100 targets, rows
built from made-up figures with FlashMLA absent, timed here or taken from the anchors, with
FlashInfer absent (no columns) or present (its columns, a reason where it has no figure), and
the command line."""

import pytest

from snapmla_cute import anchors, bench, bench_latency, timing
from snapmla_cute.cli import build_parser, main


def test_latency_shapes_are_the_named_ones():
    dense = {("dense", b, h, s_k) for b in (1, 2, 4, 8) for h, s_k in ((128, 640), (128, 8192), (64, 8192), (16, 32768))}
    sparse = {("sparse", b, h, 2048, 8192) for b in (1, 2, 4, 8) for h in (8, 128)}
    shapes = bench_latency.latency_shapes()
    assert len(shapes) == len(set(shapes)) == 24
    assert set(shapes) == dense | sparse


def test_latency_targets_are_set_for_the_h100_only():
    targets = {
        ("dense", 1, 128, 640): 9.0, ("dense", 1, 64, 8192): 11.0, ("dense", 8, 128, 8192): 19.0,
        ("sparse", 1, 128, 2048, 8192): 10.0, ("sparse", 1, 8, 2048, 8192): 8.0, ("sparse", 8, 8, 2048, 8192): 9.0,
    }
    assert anchors.LATENCY_TARGETS_US == {"H100": targets}
    assert set(targets) <= set(bench_latency.latency_shapes())  # every target names a row
    for spec, us in targets.items():
        assert anchors.latency_target_us("H100", spec) == us
        assert anchors.latency_target_us("H200", spec) is None and anchors.latency_target_us(None, spec) is None
    assert anchors.latency_target_us("H100", ("dense", 2, 128, 640)) is None


def test_latency_row_without_any_peer():
    spec = ("dense", 1, 128, 640)
    row = bench_latency.latency_row(spec, 9.5, 6.04, 0.26, {}, anchors.peer_us(None, 1, 128, 1, 640, False), 9.0)
    assert list(row) == list(bench_latency.COLUMNS)
    assert row["shape"] == "dense b1 h128 s_k640" and row["us"] == 9.5 and row["host_us"] == 6.0
    assert row["flashmla_fp8_us"] is row["x_fp8"] is row["flashmla_bf16_us"] is row["x_bf16"] is None
    assert row["flashmla_sparse_us"] is row["peer_heads"] is row["peer_src"] is None
    assert row["pct_floor"] == 2.7 and row["target_us"] == 9.0 and row["met"] is False


def test_latency_row_takes_the_anchors_where_the_peer_did_not_run():
    spec = ("dense", 1, 128, 640)
    row = bench_latency.latency_row(spec, 8.0, 6.0, 0.3, dict(bf16=None, dense_fp8=None),
                                    anchors.peer_us("H100", 1, 128, 1, 640, False), 9.0)
    assert row["flashmla_bf16_us"] == 12.2 and row["flashmla_fp8_us"] == 12.1 and row["peer_src"] == "anchors"
    assert row["x_fp8"] == round(12.1 / 8.0, 2) and row["met"] is True


def test_latency_row_prefers_the_figure_timed_here():
    spec = ("dense", 8, 128, 8192)
    row = bench_latency.latency_row(spec, 20.0, 7.0, 10.0, dict(bf16=30.04, dense_fp8=None),
                                    dict(bf16=35.0, dense_fp8=25.0), 19.0)
    assert row["flashmla_bf16_us"] == 30.0 and row["x_bf16"] == 1.5  # here
    assert row["flashmla_fp8_us"] == 25.0 and row["x_fp8"] == 1.25  # the anchors
    assert row["peer_src"] == "mixed" and row["met"] is False


@pytest.mark.parametrize("h, heads", [(8, "h64 padded"), (128, "h128")])
def test_sparse_latency_row(h, heads):
    spec = ("sparse", 1, h, 2048, 8192)
    row = bench_latency.latency_row(spec, 10.0, 8.0, 0.5, {"sparse": 17.14}, {"sparse": 18.8}, 10.0)
    assert list(row) == list(bench_latency.COLUMNS) and row["shape"] == f"sparse b1 h{h} topk2048 of 8192"
    assert row["flashmla_sparse_us"] == 17.1 and row["x_flashmla"] == 1.71 and row["peer_src"] == "here"
    assert row["peer_heads"] == heads and row["flashmla_fp8_us"] is None and row["met"] is True


def test_latency_row_with_flashinfer():
    spec = ("dense", 1, 128, 640)
    fi = dict(fi_bf16=14.04, fi_fp8=None, note="fp8: ValueError: no")
    row = bench_latency.latency_row(spec, 8.0, 6.0, 0.3, {}, anchors.peer_us("H100", 1, 128, 1, 640, False), 9.0, fi)
    at = list(bench_latency.COLUMNS).index("peer_src") + 1
    assert list(row) == [*bench_latency.COLUMNS[:at], *bench.FI_COLUMN_NAMES, *bench_latency.COLUMNS[at:]]
    assert row["flashinfer_bf16_us"] == 14.0 and row["x_fi_bf16"] == 1.75
    assert row["flashinfer_fp8_us"] is row["x_fi_fp8"] is None and row["fi_note"] == "fp8: ValueError: no"
    # FlashInfer absent (or not asked for): the row has exactly COLUMNS, as without it
    for absent in ({}, None):
        row = bench_latency.latency_row(spec, 8.0, 6.0, 0.3, {}, {}, 9.0, absent)
        assert list(row) == list(bench_latency.COLUMNS)


def test_cli_accepts_bench_latency(monkeypatch, capsys):
    args = build_parser().parse_args(["bench", "latency"])
    assert args.what == "latency" and args.peers is True
    assert build_parser().parse_args(["bench", "latency", "--no-peers"]).peers is False
    seen = {}

    def fake_bench(page_size, peers_here):
        seen.update(page_size=page_size, peers_here=peers_here)
        return [bench_latency.latency_row(("sparse", 8, 8, 2048, 8192), 9.0, 7.0, 4.0, {}, {"sparse": None}, 9.0)]

    monkeypatch.setattr(bench, "device_copy_tbps", lambda: ("a GPU", 3.0))
    monkeypatch.setattr(bench_latency, "bench_latency", fake_bench)
    assert main(["bench", "latency", "--no-peers", "--page-size", "64"]) == 0
    assert seen == dict(page_size=64, peers_here=False)
    assert "sparse b8 h8 topk2048 of 8192" in capsys.readouterr().out


def test_cli_prints_flashinfer_jit_line_with_peers(monkeypatch, capsys):
    """With peers, ``bench latency`` / ``bench decode`` first plan FlashInfer (its JIT build)
    and print that line; without FlashInfer, nothing but one stderr note."""
    import torch
    from test_peers import FakeFlashInferMLA, install_flashinfer

    from snapmla_cute import peers

    report = peers.flashinfer_jit_report
    monkeypatch.setattr(peers, "flashinfer_jit_report", lambda: report(device="cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peers, "_NOTED", set())
    monkeypatch.setattr(bench, "device_copy_tbps", lambda: ("a GPU", 3.0))
    monkeypatch.setattr(bench_latency, "bench_latency", lambda page_size, peers_here: [])
    monkeypatch.setattr(bench, "bench_decode", lambda **kw: [])
    install_flashinfer(monkeypatch, FakeFlashInferMLA())
    for what in ("latency", "decode"):
        assert main(["bench", what]) == 0
        assert "FlashInfer 0.7.4 fa3 MLA: first plan" in capsys.readouterr().out
    install_flashinfer(monkeypatch, None)
    assert main(["bench", "latency"]) == 0
    out = capsys.readouterr()
    assert "FlashInfer" not in out.out and "import flashinfer.mla failed" in out.err


@pytest.fixture
def stand_ins(monkeypatch):
    """The benches' row paths on the CPU: our decode's data and outputs from the reference and
    the emulation, its timings made up (8 µs on the GPU, 6 µs on the host), an H100 by name,
    FlashMLA the stand-in of test_peers (timed at 12 µs through ``peers``), FlashInfer absent
    (``test_peers.install_flashinfer`` puts its stand-in in). Returns a function that takes
    flash_mla away (as if not installed)."""
    import sys
    import types

    import torch
    from test_peers import FakeFlashMLA, dense_inputs, install_flashinfer, sparse_inputs

    import snapmla_cute
    from snapmla_cute import bench_sparse, emulation, peers, sparse_reference, steps
    from snapmla_cute import reference as ref

    def decode_case(b, h, s_q, lens, page_size=64, causal=False):
        q, kv_pages, table, seqlens = dense_inputs(b=b, h=h, s_q=s_q, lens=lens, page_size=page_size)
        kv, kv_scale = ref.quantize_kv_cache(kv_pages)
        out = emulation.mla_decode_emulated(q, (kv, kv_scale), table, seqlens, causal=causal)[0].bfloat16()
        cache = types.SimpleNamespace(kv=kv, kv_scale=kv_scale)
        return bench.DecodeCase(q, None, kv_pages, cache, table, seqlens, causal, None, out, None)

    def sparse_case_tokens(b, h, s_q, topk, s_k, page_size=64):
        q, kv_pages, indices = sparse_inputs(b=b, h=h, s_q=s_q, topk=topk, P=b * s_k // page_size)
        kv, kv_scale = ref.quantize_kv_cache(kv_pages)
        return kv_pages, types.SimpleNamespace(kv=kv, kv_scale=kv_scale), q, q, indices, None  # "quantized" q: q

    def mla_decode_sparse(q, cache, indices, metadata=None, out=None, lse=None, check=True):
        o, l_ = sparse_reference.mla_decode_sparse_emulated(q, (cache.kv, cache.kv_scale), indices)
        return o.bfloat16(), l_

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench, "decode_case", decode_case)
    for mod in (bench, timing):  # bench's own names (bench decode) and the timers' module (bench latency)
        monkeypatch.setattr(mod, "measure_copy_tbps", lambda: 3.0)
        monkeypatch.setattr(mod, "time_us", lambda fn: 8.0)
        monkeypatch.setattr(mod, "host_us_per_call", lambda fn: 6.0)
    monkeypatch.setattr(steps, "dense_call", lambda *a: (lambda: None, ()))
    monkeypatch.setattr(bench_sparse, "sparse_case_tokens", sparse_case_tokens)
    monkeypatch.setattr(bench_sparse, "time_us", lambda fn: 8.0)
    monkeypatch.setattr(bench_sparse, "measure_copy_tbps", lambda: 3.0)
    monkeypatch.setattr(snapmla_cute, "mla_decode_sparse", mla_decode_sparse)
    monkeypatch.setattr(peers, "time_us", lambda call: (call(), 12.0)[1])
    monkeypatch.setattr(peers, "_NOTED", set())
    monkeypatch.setitem(sys.modules, "flash_mla", FakeFlashMLA())
    install_flashinfer(monkeypatch, None)
    return lambda: monkeypatch.setitem(sys.modules, "flash_mla", None)


def test_bench_latency_rows_on_stand_ins(stand_ins):
    shapes = [("dense", 1, 128, 640), ("dense", 2, 16, 300), ("sparse", 1, 8, 2048, 8192), ("sparse", 2, 128, 64, 256)]
    rows = bench_latency.bench_latency(shapes)
    assert [r["shape"] for r in rows] == [bench_latency.shape_name(s) for s in shapes]
    assert all(list(r) == list(bench_latency.COLUMNS) and r["us"] == 8.0 and r["host_us"] == 6.0 for r in rows)
    assert [r["peer_src"] for r in rows] == ["here"] * 4
    assert rows[0]["flashmla_fp8_us"] == rows[0]["flashmla_bf16_us"] == 12.0 and rows[0]["x_fp8"] == 1.5
    assert rows[0]["target_us"] == 9.0 and rows[0]["met"] is True and rows[1]["target_us"] is None
    assert rows[2]["flashmla_sparse_us"] == 12.0 and rows[2]["peer_heads"] == "h64 padded"
    assert rows[2]["target_us"] == 8.0 and rows[2]["met"] is True and rows[3]["peer_heads"] == "h128"

    stand_ins()  # flash_mla not installed: the anchors where they have the row
    rows = bench_latency.bench_latency(shapes)
    assert [r["peer_src"] for r in rows] == ["anchors", None, "anchors", None]
    assert (rows[0]["flashmla_bf16_us"], rows[0]["flashmla_fp8_us"]) == (12.2, 12.1)
    assert rows[2]["flashmla_sparse_us"] == 17.1  # FlashMLA padded to h64, b1
    assert bench_latency.bench_latency(shapes[:1], peers_here=False)[0]["peer_src"] == "anchors"


def test_bench_decode_rows_on_stand_ins(stand_ins):
    rows = bench.bench_decode([(1, 128, 1, 640, False), (2, 16, 2, 300, False)])
    assert [r["shape"] for r in rows] == ["b1 h128 s_q1 s_k640", "b2 h16 s_q2 s_k300 causal"]
    assert rows[0]["flashmla_fp8_us"] == 12.0 and rows[0]["peer_src"] == "here" and rows[0]["x_bf16"] == 1.5
    assert rows[0]["target_us"] == round(12.0 / 1.3, 1)  # the target from the figures timed here
    stand_ins()
    rows = bench.bench_decode([(1, 128, 1, 640, False), (2, 16, 2, 300, False)])
    assert rows[0]["flashmla_fp8_us"] == 12.1 and rows[0]["peer_src"] == "anchors" and rows[0]["target_us"] == 9.3
    assert rows[1]["peer_src"] is None and rows[1]["target_us"] is None and rows[1]["meets"] is None


def test_bench_sparse_rows_on_stand_ins(stand_ins, monkeypatch):
    from functools import partial

    import snapmla_cute
    from snapmla_cute import bench_sparse as bs

    # unchecked (the latency test runs the emulation's check), so our output can be anything
    monkeypatch.setattr(snapmla_cute, "mla_decode_sparse", lambda q, *a, **k: (None, None))
    bench_sparse = partial(bs.bench_sparse, verify=False)
    rows = bench_sparse([(1, 128, 1, 2048, 8192)], dense=False)
    assert rows[0]["flashmla_sparse_us"] == 12.0 and rows[0]["x_flashmla"] == 1.5 and rows[0]["peer_src"] == "here"
    rows = bench_sparse([(1, 8, 1, 2048, 8192)], few_heads=True)
    assert rows[0]["padded_h64_us"] == 12.0 and rows[0]["peer_src"] == "here"
    stand_ins()
    rows = bench_sparse([(1, 8, 1, 2048, 8192)], few_heads=True)
    assert rows[0]["padded_h64_us"] == 17.1 and rows[0]["x_padded"] == round(17.1 / 8.0, 2) and rows[0]["peer_src"] == "anchors"
    rows = bench_sparse([(1, 128, 1, 2048, 8192)], dense=False)
    assert rows[0]["flashmla_sparse_us"] == 18.8 and rows[0]["met"] is True


def test_bench_rows_with_flashinfer_on_stand_ins(stand_ins, monkeypatch):
    """FlashInfer's stand-in in (timed at 12 µs): its columns beside FlashMLA's at every row,
    our FP8 cache given to its FP8 kind, a sparse row with its reason; without flash_mla too."""
    import torch
    from test_peers import FakeFlashInferMLA, install_flashinfer

    fake = FakeFlashInferMLA()
    install_flashinfer(monkeypatch, fake)
    shapes = [("dense", 1, 128, 640), ("sparse", 1, 8, 2048, 8192)]
    for _ in range(2):
        dense, sparse = bench_latency.bench_latency(shapes)
        assert dense["flashinfer_fp8_us"] == dense["flashinfer_bf16_us"] == 12.0 and dense["x_fi_fp8"] == 1.5
        assert dense["fi_note"] is None and list(dense) == list(sparse)
        assert sparse["flashinfer_fp8_us"] is None and "no SM90 sparse" in sparse["fi_note"]
        stand_ins()  # flash_mla gone: FlashInfer's columns stay
    rows = bench.bench_decode([(1, 128, 1, 640, False), (2, 16, 2, 300, False)])
    assert [r["x_fi_bf16"] for r in rows] == [1.5, 1.5] and rows[1]["fi_note"] is None
    assert ("plan", torch.float8_e4m3fn) in fake.calls
    assert "flashinfer_fp8_us" not in bench.bench_decode([(1, 128, 1, 640, False)], peers_here=False)[0]
