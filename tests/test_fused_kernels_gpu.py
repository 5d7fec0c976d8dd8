"""GPU tests of the fused kernels: bytes and scales bit-exact with reference.quantize_rows."""

import pytest
import torch

from snapmla_cute import FP8KVCache, append_kv, dequantize_kv, quantize_q
from snapmla_cute import reference as ref

pytestmark = pytest.mark.gpu


def _rows(n, kind, device="cuda"):
    """Inputs that exercise the rounding: FlashMLA-style, paper-style outliers, zeros, extremes."""
    if kind == "flashmla":
        x = (torch.randn(n, 576, device=device) / 10).clamp(-1, 1)
    elif kind == "paper":
        x = torch.randn(n, 576, device=device)
        x[:, :512] *= 3.0 * torch.rand(n, 1, device=device).exp()
        ch = torch.ones(64, device=device)
        ch[torch.randperm(64, device=device)[:6]] = torch.logspace(1, 3, 6, device=device)
        x[:, 512:] *= ch * torch.rand(n, 1, device=device).mul(3).exp()
    elif kind == "mixed":
        x = torch.randn(n, 576, device=device) * torch.logspace(-8, 4, n, device=device)[:, None]
        x[::7] = 0.0  # all-zero rows take the AMAX_FLOOR scale
        x[1::7, :512] = 0.0  # zero content, non-zero RoPE
        x[2::7, 5] = 3.0e38  # near bf16 max: saturates nothing, scale stays finite
    return x.to(torch.bfloat16)


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind", ["flashmla", "paper", "mixed"])
@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 2, 128), (7, 4, 32), (128, 1, 128)])
def test_quantize_q_bit_exact(seed, kind, shape):
    b, s_q, h = shape
    q = _rows(b * s_q * h, kind).view(b, s_q, h, 576)
    q_nope, q_rope, q_scale = quantize_q(q)
    c, r, s = ref.quantize_rows(q)
    assert q_nope.dtype == torch.float8_e4m3fn and q_nope.shape == (b, s_q, h, 512)
    assert q_rope.dtype == torch.bfloat16 and q_rope.shape == (b, s_q, h, 64)
    assert q_scale.dtype == torch.float32 and q_scale.shape == (b, s_q, h)
    assert torch.equal(_bits(q_scale), _bits(s))
    assert torch.equal(_bits(q_nope), _bits(c))
    assert torch.equal(_bits(q_rope), _bits(r))


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("kind", ["flashmla", "paper", "mixed"])
def test_append_kv_bit_exact_and_untouched_slots(seed, page_size, kind):
    num_pages = 37
    cache = FP8KVCache.allocate(num_pages, page_size, fill_nan=True)
    poisoned = (cache.kv.clone(), cache.kv_scale.clone())
    n = 500
    slots = torch.randperm(cache.num_slots, device="cuda")[:n]
    slots[::9] = -1  # skipped rows
    kv = _rows(n, kind)
    append_kv(cache, kv, slots)
    c, r, s = ref.quantize_rows(kv)
    want_rows = ref.pack_kv_rows(c, r)
    written = slots >= 0
    flat_kv = cache.kv.view(-1, 640)
    flat_s = cache.kv_scale.view(-1)
    assert torch.equal(flat_kv[slots[written]], want_rows[written])
    assert torch.equal(_bits(flat_s[slots[written]]), _bits(s[written]))
    untouched = torch.ones(cache.num_slots, dtype=torch.bool, device="cuda")
    untouched[slots[written]] = False
    assert torch.equal(flat_kv[untouched], poisoned[0].view(-1, 640)[untouched])
    assert torch.equal(_bits(flat_s[untouched]), _bits(poisoned[1].view(-1)[untouched]))


@pytest.mark.parametrize("kind", ["flashmla", "paper", "mixed"])
def test_dequantize_kv_bit_exact(seed, kind):
    cache = FP8KVCache.allocate(64, 64, fill_nan=True)
    n = cache.num_slots // 2
    slots = torch.randperm(cache.num_slots, device="cuda")[:n]
    append_kv(cache, _rows(n, kind), slots)
    gather = slots[torch.randint(0, n, (777,), device="cuda")]
    gather[::11] = -1
    out = torch.full((777, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    dequantize_kv(cache, gather, out=out)
    content, rope = ref.unpack_kv_rows(cache.kv.view(-1, 640)[gather.clamp(min=0)])
    want = ref.dequantize_rows(content, rope, cache.kv_scale.view(-1)[gather.clamp(min=0)])
    want[gather < 0] = 0
    assert torch.equal(_bits(out), _bits(want))
    got = dequantize_kv(cache, gather)  # allocating path
    assert torch.equal(_bits(got), _bits(want))


def test_round_trip_error_is_fp8_sized(seed):
    cache = FP8KVCache.allocate(8, 64)
    kv = _rows(512, "flashmla")
    slots = torch.arange(512, device="cuda")
    append_kv(cache, kv, slots)
    back = dequantize_kv(cache, slots)
    assert ref.rel_l2(back[:, :512], kv[:, :512]) < 0.04  # e4m3: 3 mantissa bits
    assert ref.rel_l2(back[:, 512:], kv[:, 512:]) < 0.01  # bf16 RoPE survives


def test_runs_on_current_stream(seed):
    side = torch.cuda.Stream()
    q = _rows(4096 * 16, "flashmla").view(4096, 1, 16, 576)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        q2 = q * 2  # queued on `side`; the kernel must see it finished
        q_nope, q_rope, q_scale = quantize_q(q2, check=False)
    side.synchronize()
    _, _, s = ref.quantize_rows(q2)
    assert torch.equal(_bits(q_scale), _bits(s))


def test_bad_inputs_raise_before_launch(seed):
    cache = FP8KVCache.allocate(4, 64, fill_nan=True)
    before = (cache.kv.clone(), cache.kv_scale.clone())
    kv = _rows(8, "flashmla")
    good = torch.arange(8, device="cuda")
    cases = [
        (lambda: append_kv(cache, kv, good + cache.num_slots - 4), ValueError, "slot ids"),
        (lambda: append_kv(cache, kv, good - 3), ValueError, "slot ids"),
        (lambda: append_kv(cache, kv.float(), good), TypeError, "bfloat16"),
        (lambda: append_kv(cache, kv, good.int()), TypeError, "int64"),
        (lambda: append_kv(cache, kv[:, :512], good), ValueError, "last dim 576"),
        (lambda: append_kv(cache, kv, good[:7]), ValueError, "one per kv row"),
        (lambda: append_kv(cache, kv.cpu(), good), ValueError, "CUDA"),
        (lambda: append_kv(cache, kv.t().contiguous().t(), good), ValueError, "contiguous"),
        (lambda: append_kv(cache, torch.full_like(kv, float("nan")), good), ValueError, "finite"),
        (lambda: dequantize_kv(cache, good + 1000), ValueError, "slot ids"),
        (lambda: quantize_q(kv.view(1, 1, 8, 576).float()), TypeError, "bfloat16"),
        (lambda: quantize_q(torch.full((1, 1, 8, 576), float("inf"), dtype=torch.bfloat16, device="cuda")), ValueError, "finite"),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc, match=words):
            call()
    assert torch.equal(cache.kv, before[0])
    assert torch.equal(_bits(cache.kv_scale), _bits(before[1]))


def test_check_false_is_one_compiled_call_and_still_rejects_clearly(seed):
    """With ``check=False`` (and ``out`` given) the fused ops make one compiled call whose
    argument decoder checks the tensors; a rejected call is explained by the Python checks,
    and nothing is written. A slot outside the cache is skipped by the kernel."""
    cache = FP8KVCache.allocate(4, 64, fill_nan=True)
    kv = _rows(8, "flashmla")
    good = torch.arange(8, device="cuda")
    q = kv.view(1, 1, 8, 576)
    q_out = quantize_q(q)
    deq = torch.empty(8, 576, dtype=torch.bfloat16, device="cuda")
    append_kv(cache, kv, good, check=False)
    before = (cache.kv.clone(), cache.kv_scale.clone())
    cases = [
        (lambda: append_kv(cache, kv.float(), good, check=False), TypeError, "bfloat16"),
        (lambda: append_kv(cache, kv, good.int(), check=False), TypeError, "int64"),
        (lambda: append_kv(cache, kv, good[:7], check=False), ValueError, "one per kv row"),
        (lambda: append_kv(cache, kv.t().contiguous().t(), good, check=False), ValueError, "contiguous"),
        (lambda: append_kv(cache, kv.cpu(), good, check=False), ValueError, "CUDA"),
        (lambda: dequantize_kv(cache, good.int(), out=deq, check=False), TypeError, "int64"),
        (lambda: dequantize_kv(cache, good, out=deq[:7], check=False), ValueError, "out: expected shape"),
        (lambda: quantize_q(q, out=(q_out[0], q_out[1], q_out[2].double()), check=False), TypeError, "float32"),
        (lambda: quantize_q(q[:, :, :4], out=q_out, check=False), ValueError, "out: expected shapes"),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc, match=words):
            call()
    torch.cuda.synchronize()
    assert torch.equal(cache.kv, before[0])
    assert torch.equal(_bits(cache.kv_scale), _bits(before[1]))
    # out-of-range slots with check=False: skipped on append, zero rows on dequantize
    bad = torch.tensor([-5, cache.num_slots, 1 << 40, 3, -1, 0, 1, 2], device="cuda")
    append_kv(cache, kv, bad, check=False)
    got = dequantize_kv(cache, bad, out=deq, check=False)
    assert got is deq
    assert (got[[0, 1, 2, 4]] == 0).all()
    want = ref.dequantize_rows(*ref.quantize_rows(kv[[3, 5, 6, 7]].float()))
    assert torch.equal(got[[3, 5, 6, 7]].view(torch.int16), want.view(torch.int16))
    # and quantize_q through the hot path is the same bits as through the checked one
    q2 = quantize_q(q, out=tuple(torch.empty_like(t) for t in q_out), check=False)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(q2, q_out))


def test_value_checks_sync_the_stream_once(seed):
    from decode_cases import host_syncs

    cache = FP8KVCache.allocate(4, 64)
    kv = _rows(8, "flashmla")
    slots = torch.arange(8, device="cuda")
    q = kv.view(1, 1, 8, 576)
    out = quantize_q(q)
    deq = torch.empty(8, 576, dtype=torch.bfloat16, device="cuda")
    calls = {
        "append_kv": (lambda: append_kv(cache, kv, slots), 1),
        "dequantize_kv": (lambda: dequantize_kv(cache, slots, out=deq), 1),
        "quantize_q": (lambda: quantize_q(q, out=out), 1),
        "append_kv check=False": (lambda: append_kv(cache, kv, slots, check=False), 0),
        "dequantize_kv check=False": (lambda: dequantize_kv(cache, slots, out=deq, check=False), 0),
        "quantize_q check=False": (lambda: quantize_q(q, out=out, check=False), 0),
    }
    for name, (call, want) in calls.items():
        syncs = host_syncs(call)
        assert len(syncs) == want, (name, syncs)
