"""Bad input is rejected before any launch, with what/expected/got; and the host-side
plumbing of a decode call (every tuning change drops the compiled steps; the step's
arguments). CPU: no GPU needed."""

import pytest
import torch

from snapmla_cute import FP8KVCache, append_kv, dequantize_kv, quantize_q


def test_quantize_q_rejects():
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q: expected dtype torch.bfloat16, got torch.float32"):
        quantize_q(q.float())
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        quantize_q(q[0])
    with pytest.raises(ValueError, match="q: expected last dim 576"):
        quantize_q(q[..., :512])
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got device cpu"):
        quantize_q(q)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        quantize_q(q.numpy() if False else [1, 2])


def test_append_and_dequant_reject_cpu_and_types():
    cache = FP8KVCache.allocate(2, 16, device="cpu", fill_nan=True)
    before = cache.kv.clone()
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    slots = torch.arange(4)
    with pytest.raises(TypeError, match="cache: expected FP8KVCache"):
        append_kv(cache.kv, kv, slots)
    with pytest.raises(ValueError, match="kv: expected a CUDA tensor"):
        append_kv(cache, kv, slots)
    with pytest.raises(TypeError, match="slot_mapping: expected dtype torch.int64, got torch.int32"):
        append_kv(cache, kv, slots.int())
    with pytest.raises(TypeError, match="kv: expected dtype torch.bfloat16"):
        append_kv(cache, kv.half(), slots)
    with pytest.raises(ValueError, match="slot_mapping: expected 4 entries"):
        append_kv(cache, kv, slots[:3])
    with pytest.raises(ValueError, match="kv: expected a contiguous tensor"):
        append_kv(cache, kv.t().contiguous().t(), slots)
    with pytest.raises(ValueError, match="slots: expected a CUDA tensor"):
        dequantize_kv(cache, slots)
    with pytest.raises(ValueError, match="slots: expected 1 dims"):
        dequantize_kv(cache, slots[None])
    assert torch.equal(cache.kv, before)


def test_every_tuning_change_drops_the_compiled_steps():
    """DECODE_TUNING changes the compiled code: every way of mutating it must empty the hot
    path's table, or a call would keep running the old kernel."""
    import snapmla_cute.ops as ops

    saved = dict(ops.DECODE_TUNING)
    try:
        mutations = [
            lambda t: t.__setitem__("kv_stages", 3),
            lambda t: t.update(kv_stages=4),
            lambda t: t.setdefault("pv_temps", 1),
            lambda t: t.__ior__({"qk_early": True}),
            lambda t: t.pop("qk_early"),
            lambda t: t.popitem(),
            lambda t: t.__delitem__("kv_stages"),
            lambda t: t.clear(),
        ]
        ops.DECODE_TUNING.update(kv_stages=4, pv_temps=1, qk_early=True)
        for mutate in mutations:
            ops._hot_steps["sentinel"] = object()
            mutate(ops.DECODE_TUNING)
            assert "sentinel" not in ops._hot_steps, mutate
    finally:
        ops.DECODE_TUNING.clear()
        ops.DECODE_TUNING.update(saved)
        ops._hot_steps.pop("sentinel", None)


def test_step_arguments_one_builder_for_every_path():
    """The hot path and the full path build the compiled step's arguments with one helper:
    a quantized q as a tuple or a list gives the same call, a bf16 q goes with the
    metadata's query buffers, and the softmax scale arrives in the log2 domain."""
    import math
    from types import SimpleNamespace

    import snapmla_cute.ops as ops

    t = [torch.zeros(1) for _ in range(10)]
    cache = SimpleNamespace(step_args=(t[0], t[1]), page_size=64)
    md = SimpleNamespace(q_args=(t[2], t[3], t[4]), step_args=(t[5], t[6]))
    qq = (t[7], t[8], t[9])
    bt, lens, out, lse = (torch.zeros(1) for _ in range(4))
    a = ops._step_args(qq, cache, bt, lens, md, out, lse, None)
    b = ops._step_args(list(qq), cache, bt, lens, md, out, lse, None)
    assert a[0] is False and b[0] is False and len(a[1]) == len(b[1]) == 12
    assert all(x is y for x, y in zip(a[1], b[1]))
    assert a[1][:7] == (*qq, bt, lens, out, lse) and a[1][7:11] == (t[0], t[1], t[5], t[6])
    assert a[1][11] == pytest.approx(576**-0.5 * math.log2(math.e))
    q = torch.zeros(1)
    bf16_q, args = ops._step_args(q, cache, bt, lens, md, out, lse, 0.1)
    assert bf16_q is True and args[0] is q and args[1:4] == (t[2], t[3], t[4])
    assert args[-1] == pytest.approx(0.1 * math.log2(math.e))
