"""Custom ops: fake-tensor shape inference and a full-graph trace of a decode step (CPU)."""

import torch

import snapmla_cute  # noqa: F401  registers torch.ops.snapmla


def _meta_step_inputs(b=3, s_q=2, h=32, pages=10, ps=64, parts=8):
    m = dict(device="meta")
    return dict(
        q=torch.empty(b, s_q, h, 576, dtype=torch.bfloat16, **m),
        kv=torch.empty(pages, ps, 640, dtype=torch.uint8, **m),
        kv_scale=torch.empty(pages, ps, dtype=torch.float32, **m),
        new_kv=torch.empty(b * s_q, 576, dtype=torch.bfloat16, **m),
        slots=torch.empty(b * s_q, dtype=torch.int64, **m),
        block_table=torch.empty(b, 4, dtype=torch.int32, **m),
        seqlens=torch.empty(b, dtype=torch.int32, **m),
        sched=torch.empty(parts, 8, dtype=torch.int32, **m),
        split_offsets=torch.empty(b + 1, dtype=torch.int32, **m),
        o_partial=torch.empty(b + parts, s_q * h, 512, dtype=torch.float32, **m),
        lse_partial=torch.empty(b + parts, s_q * h, dtype=torch.float32, **m),
        counters=torch.empty(b, 2 * ((s_q * h + 63) // 64), dtype=torch.int32, **m),
    )


def decode_step(q, kv, kv_scale, new_kv, slots, block_table, seqlens, sched, split_offsets, o_partial, lse_partial, counters):
    torch.ops.snapmla.append_kv(kv, kv_scale, new_kv, slots)
    q_nope, q_rope, q_scale = torch.ops.snapmla.quantize_q(q)
    return torch.ops.snapmla.mla_decode(
        q_nope, q_rope, q_scale, kv, kv_scale, block_table, seqlens, sched, split_offsets, o_partial, lse_partial,
        counters, 576**-0.5, True,
    )


def test_fake_shapes():
    x = _meta_step_inputs()
    q_nope, q_rope, q_scale = torch.ops.snapmla.quantize_q(x["q"])
    assert q_nope.shape == (3, 2, 32, 512) and q_nope.dtype == torch.float8_e4m3fn
    assert q_rope.shape == (3, 2, 32, 64) and q_rope.dtype == torch.bfloat16
    assert q_scale.shape == (3, 2, 32) and q_scale.dtype == torch.float32
    out = torch.ops.snapmla.dequantize_kv(x["kv"], x["kv_scale"], x["slots"])
    assert out.shape == (6, 576) and out.dtype == torch.bfloat16
    o, lse = decode_step(**x)
    assert o.shape == (3, 2, 32, 512) and o.dtype == torch.bfloat16
    assert lse.shape == (3, 32, 2) and lse.dtype == torch.float32


def test_decode_step_traces_as_one_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend=backend)
    o, lse = compiled(**_meta_step_inputs())
    assert len(graphs) == 1
    targets = " ".join(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
    for op in ("snapmla.append_kv", "snapmla.quantize_q", "snapmla.mla_decode"):
        assert op in targets, targets
    assert o.shape == (3, 2, 32, 512)


def decode_step_x2(q, kv, kv_scale, new_kv, slots, block_table, seqlens, sched, split_offsets, o_partial, lse_partial,
                   counters):
    """The accurate mode's step: the query as hi + lo, its q_lo passed to the decode."""
    torch.ops.snapmla.append_kv(kv, kv_scale, new_kv, slots)
    q_nope, q_rope, q_scale, q_lo = torch.ops.snapmla.quantize_q_x2(q)
    return torch.ops.snapmla.mla_decode(
        q_nope, q_rope, q_scale, kv, kv_scale, block_table, seqlens, sched, split_offsets, o_partial, lse_partial,
        counters, 576**-0.5, True, q_lo,
    )


def test_accurate_mode_fake_shapes_and_one_graph():
    x = _meta_step_inputs()
    *head, q_lo = torch.ops.snapmla.quantize_q_x2(x["q"])
    assert q_lo.shape == (3, 2, 32, 512) and q_lo.dtype == torch.float8_e4m3fn
    assert [t.shape for t in head] == [t.shape for t in torch.ops.snapmla.quantize_q(x["q"])]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    o, lse = torch.compile(decode_step_x2, fullgraph=True, backend=backend)(**x)
    assert len(graphs) == 1 and o.shape == (3, 2, 32, 512) and lse.shape == (3, 32, 2)
    targets = " ".join(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
    assert "snapmla.quantize_q_x2" in targets and "snapmla.mla_decode" in targets
