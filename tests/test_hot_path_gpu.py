"""GPU: the ``check=False`` hot path of ``mla_decode`` (one TVM-FFI call, structure checked by
the compiled step's argument decoder) gives the full path's results and its errors."""

import pytest
import torch

from decode_cases import build_case
from snapmla_cute import decode_metadata, mla_decode, quantize_q
from snapmla_cute import decode

pytestmark = pytest.mark.gpu


@pytest.fixture
def counted_validation(monkeypatch):
    calls = []
    real = decode.validate_decode

    def counted(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(decode, "validate_decode", counted)
    return calls


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True)])
def test_hot_path_matches_full_path(seed, counted_validation, s_q, causal):
    b, h = 3, 64
    c = build_case(b, s_q, h, 64, [700, 1, 2000], seed=seed)
    q, cache, bt, lens = c["q"], c["cache"], c["block_table"], c["cache_seqlens"]
    want = mla_decode(q, cache, bt, lens, causal=causal)
    md = decode_metadata(lens, s_q=s_q, heads=h)
    for qq in (q, quantize_q(q)):
        out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, h, s_q), float("nan"), device="cuda")
        mla_decode(qq, cache, bt, lens, causal=causal, metadata=md, out=out, lse=lse, check=False)  # fills the table
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        counted_validation.clear()
        r = mla_decode(qq, cache, bt, lens, causal=causal, metadata=md, out=out, lse=lse, check=False)
        assert not counted_validation, "the hot path ran the Python checks"
        assert r[0] is out and r[1] is lse
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_hot_path_rejects_bad_inputs_like_the_full_path(seed):
    b, h = 2, 64
    c = build_case(b, 1, h, 64, [100, 200], seed=seed)
    q, cache, bt, lens = c["q"], c["cache"], c["block_table"], c["cache_seqlens"]
    qn, qr, qs = quantize_q(q)
    md = decode_metadata(lens, s_q=1, heads=h)
    out = torch.full((b, 1, h, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, h, 1), 7.0, device="cuda")
    mla_decode((qn, qr, qs), cache, bt, lens, metadata=md, out=out, lse=lse, check=False)
    mla_decode(q, cache, bt, lens, metadata=md, out=out, lse=lse, check=False)
    out.fill_(7.0)
    lse.fill_(7.0)
    sched = md.sched.clone()
    dev = dict(device="cuda")

    def call(qq=(qn, qr, qs), cache=cache, bt=bt, lens=lens, md=md, out=out, lse=lse, **kw):
        return lambda: mla_decode(qq, cache, bt, lens, metadata=md, out=out, lse=lse, check=False, **kw)

    cases = [
        (call(qq=(qn.view(torch.uint8), qr, qs)), TypeError, "q_nope"),
        (call(qq=(qn, qr[:1], qs)), ValueError, "shapes disagree"),
        (call(qq=(qn, qr)), ValueError, "expected \\(q_nope"),
        (call(bt=bt[:1]), ValueError, "batch"),
        (call(bt=bt.long()), TypeError, "block_table"),
        (call(lens=lens.long()), TypeError, "cache_seqlens"),
        (call(bt=bt.cpu()), ValueError, "CUDA"),
        (call(cache=cache.kv), TypeError, "FP8KVCache"),
        (call(out=torch.empty(b, 1, 32, 512, dtype=torch.bfloat16, **dev)), ValueError, "out: expected shape"),
        (call(out=out.float()), TypeError, "out"),
        (call(out=torch.empty(b, 1, h, 1024, dtype=torch.bfloat16, **dev)[..., :512]), ValueError, "contiguous"),
        (call(lse=torch.empty(b, 1, h, **dev)), ValueError, "lse: expected shape"),
        (call(md=decode_metadata(torch.cat([lens, lens[:1]]), s_q=1, heads=h)), ValueError, "metadata"),
        (call(md=decode_metadata(lens, s_q=2, heads=h)), ValueError, "metadata"),
        (call(softmax_scale="0.1"), TypeError, "softmax_scale"),
        (call(qq=q.float()), TypeError, "bfloat16"),
        (call(qq=q[:, :, :32].contiguous()), ValueError, "out: expected shape"),
        (call(qq=q[:1]), ValueError, "batch"),
    ]
    for fn, exc, words in cases:
        with pytest.raises(exc, match=words):
            fn()
    torch.cuda.synchronize()
    assert torch.all(out == 7.0) and torch.all(lse == 7.0), "a rejected call wrote the outputs"
    assert torch.equal(md.sched, sched), "a rejected call ran the scheduler"
