"""The in-process FlashMLA timings (``snapmla_cute.peers``), on the CPU: None and one note when
``flash_mla`` is absent or refuses a call; the inputs they build (per-tensor e4m3, the V3.2
656-byte cache, heads padded to 64) decoded back by a stand-in ``flash_mla`` that computes
what the real one is documented to; a wrong output raises. One GPU test runs the real peer
where it is installed."""

import math
import sys
import types

import pytest
import torch

from snapmla_cute import peers
from snapmla_cute import reference as ref
from snapmla_cute.sparse_reference import mla_decode_sparse_exact

FP8 = torch.float8_e4m3fn


def dense_inputs(b=2, h=16, s_q=1, lens=(130, 200), page_size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_per = [(L + page_size - 1) // page_size for L in lens]
    P = sum(pages_per)
    kv_pages = (torch.randn(P, page_size, 576, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    perm = torch.randperm(P, generator=g).int()
    block_table = torch.zeros(b, max(pages_per), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(pages_per):
        block_table[i, :n] = perm[pos : pos + n]
        pos += n
    q = torch.randn(b, s_q, h, 576, generator=g).to(torch.bfloat16)
    return q, kv_pages, block_table, torch.tensor(lens, dtype=torch.int32)


def sparse_inputs(b=2, h=8, s_q=1, topk=64, P=8, page_size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_pages = (torch.randn(P, page_size, 576, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    indices = torch.stack([torch.randperm(P * page_size, generator=g)[:topk] for _ in range(b * s_q)])
    q = torch.randn(b, s_q, h, 576, generator=g).to(torch.bfloat16)
    return q, kv_pages, indices.view(b, s_q, topk).int()


def v32_tokens(k_cache: torch.Tensor) -> torch.Tensor:
    """FlashMLA's V3.2 bytes ``[P, ps, 1, 656]`` back to fp32 tokens ``[P, ps, 576]``."""
    P, ps = k_cache.shape[:2]
    raw = k_cache.view(torch.uint8).reshape(P * ps, 656)
    codes = raw[:, :512].contiguous().view(FP8).float().view(-1, 4, 128)
    scales = raw[:, 512:528].contiguous().view(torch.float32)
    rope = raw[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(codes * scales[..., None]).reshape(-1, 512), rope], -1).view(P, ps, 576)


class FakeFlashMLA(types.ModuleType):
    """Stands in for ``flash_mla``: checks the arguments as the wheel's interface documents
    them and computes the decode in float64 from the bytes it is given (``wrong``: zeros)."""

    def __init__(self, wrong=False, refuse=False):
        super().__init__("flash_mla")
        self.wrong, self.refuse, self.calls = wrong, refuse, []

    def has_legacy(self):
        return True

    def get_mla_metadata(self, *args, **kwargs):
        return types.SimpleNamespace(tile_scheduler_metadata=None, num_splits=None), None

    def get_mla_decoding_metadata(self, seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False,
                                  topk=None, use_legacy=False):
        assert use_legacy and h_k == 1 and topk is None
        return ("sched", num_q_tokens_per_head_k), ("splits", is_fp8_kvcache)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits=None,
                               softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               topk_length=None, use_legacy=False, kv_format=None, descale_q=None, descale_k=None):
        if self.refuse:
            raise RuntimeError("Expected h_q == 64 || h_q == 128 to be true, but got false.\nmore text")
        assert use_legacy and head_dim_v == 512 and softmax_scale is None and k_cache.shape[2] == 1
        if indices is not None:  # sparse: V3.2 bytes, 64 or 128 heads
            assert is_fp8_kvcache and kv_format == "V32" and k_cache.shape[-1] == 656 and q.shape[2] in (64, 128)
            assert q.dtype == torch.bfloat16 and indices.dtype == torch.int32 and block_table is None
            self.calls.append("sparse")
            out, lse = mla_decode_sparse_exact(q.double(), v32_tokens(k_cache), indices, topk_length=topk_length)
        elif is_fp8_kvcache:  # dense FP8: e4m3 q and cache, per-tensor fp32 descales [1]
            assert q.dtype == k_cache.dtype == FP8 and k_cache.shape[-1] == 576
            assert descale_q.shape == descale_k.shape == (1,) and descale_q.dtype == descale_k.dtype == torch.float32
            assert meta.tile_scheduler_metadata == ("sched", q.shape[1] * q.shape[2]) and meta.num_splits[1]
            self.calls.append("dense_fp8")
            out, lse = ref.mla_decode_exact(q.float().double() * descale_q.double(),
                                            k_cache.squeeze(2).float().double() * descale_k.double(),
                                            block_table, cache_seqlens, causal=causal)
        else:  # dense BF16
            assert q.dtype == k_cache.dtype == torch.bfloat16 and descale_q is None
            assert meta.tile_scheduler_metadata == ("sched", q.shape[1] * q.shape[2]) and not meta.num_splits[1]
            self.calls.append("bf16")
            out, lse = ref.mla_decode_exact(q, k_cache.squeeze(2), block_table, cache_seqlens, causal=causal)
        out = out.to(torch.bfloat16)
        return (torch.zeros_like(out) if self.wrong else out), lse.float()


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as ``peers`` can tell, a fresh note log, and timing by one call."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(peers, "_NOTED", set())
    monkeypatch.setattr(peers, "time_us", lambda call: (call(), 7.5)[1])


def test_every_peer_is_none_without_flash_mla(fake_gpu, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # `import flash_mla` raises ImportError
    q, kv_pages, bt, lens = dense_inputs()
    assert peers.dense_bf16_us(q, kv_pages, bt, lens) is None
    assert peers.dense_fp8_us(q, kv_pages, bt, lens, causal=False) is None
    assert peers.dense_us(q, kv_pages, bt, lens) == dict(bf16=None, dense_fp8=None)
    qs, kvs, idx = sparse_inputs()
    assert peers.sparse_fp8_us(qs, kvs, idx) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "import flash_mla failed" in err[0] and "ModuleNotFoundError" in err[0]


def test_every_peer_is_none_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(peers, "_NOTED", set())
    q, kv_pages, bt, lens = dense_inputs()
    assert peers.dense_us(q, kv_pages, bt, lens) == dict(bf16=None, dense_fp8=None)
    assert peers.sparse_fp8_us(*sparse_inputs()) is None


def test_a_refused_call_is_none_with_one_line(fake_gpu, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_mla", FakeFlashMLA(refuse=True))
    q, kv_pages, idx = sparse_inputs(h=128)
    assert peers.sparse_fp8_us(q, kv_pages, idx) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sparse FP8 b2 h128" in err[0] and "the call failed" in err[0] and "more text" not in err[0]


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True)])
def test_dense_peers_time_a_checked_call(fake_gpu, monkeypatch, s_q, causal):
    fake = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    q, kv_pages, bt, lens = dense_inputs(s_q=s_q)
    assert peers.dense_us(q, kv_pages, bt, lens, causal=causal) == dict(bf16=7.5, dense_fp8=7.5)
    assert fake.calls == ["bf16", "bf16", "dense_fp8", "dense_fp8"]  # the checked call, then the timed one


@pytest.mark.parametrize("h, heads", [(8, 64), (16, 64), (64, 64), (128, 128)])
def test_sparse_peer_pads_few_heads_to_64(fake_gpu, monkeypatch, h, heads):
    fake = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    assert peers.sparse_heads(h) == heads
    q, kv_pages, idx = sparse_inputs(h=h, s_q=2)
    assert peers.sparse_fp8_us(q, kv_pages, idx) == 7.5
    assert peers.sparse_fp8_us(q, kv_pages, idx, topk_length=torch.tensor([64, 10], dtype=torch.int32)) == 7.5


def test_a_wrong_peer_output_raises(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", FakeFlashMLA(wrong=True))
    q, kv_pages, bt, lens = dense_inputs()
    with pytest.raises(peers.PeerMismatch, match="dense BF16"):
        peers.dense_bf16_us(q, kv_pages, bt, lens)
    with pytest.raises(peers.PeerMismatch, match="dense FP8"):
        peers.dense_fp8_us(q, kv_pages, bt, lens)
    with pytest.raises(peers.PeerMismatch, match="sparse FP8"):
        peers.sparse_fp8_us(*sparse_inputs())


def test_sparse_heads():
    assert [peers.sparse_heads(h) for h in (8, 16, 32, 64, 128, 256)] == [64, 64, 64, 64, 128, None]


def test_per_tensor_e4m3_one_scale_any_chunking():
    x = (torch.randn(3, 100, 576) / 10).to(torch.bfloat16)
    codes, scale = peers.per_tensor_e4m3(x)
    assert codes.dtype == FP8 and codes.shape == x.shape and scale.shape == (1,) and scale.dtype == torch.float32
    assert float(scale) == pytest.approx(float(x.float().abs().max()) / 448, rel=1e-6)
    assert float(codes.float().abs().max()) == 448.0
    assert torch.equal(peers.per_tensor_e4m3(x, chunk=1000)[0].view(torch.uint8), codes.view(torch.uint8))
    assert ref.rel_l2(codes.float() * scale, x.float()) < 0.05


def test_v32_cache_layout():
    kv = (torch.randn(3, 64, 576) / 10).to(torch.bfloat16)
    kv[0, 0, :128] = 0  # an all-zero tile: the floor's scale, zero codes
    cache = peers.v32_cache(kv)
    assert cache.shape == (3, 64, 1, 656) and cache.dtype == FP8 and cache.is_contiguous()
    raw = cache.view(torch.uint8).reshape(-1, 656)
    scales = raw[:, 512:528].contiguous().view(torch.float32)
    assert all(math.log2(s) == int(math.log2(s)) for s in scales.flatten().tolist())  # powers of two
    assert torch.equal(raw[:, 528:].contiguous().view(torch.bfloat16), kv.reshape(-1, 576)[:, 512:])
    back = v32_tokens(cache)
    assert torch.all(back[0, 0, :128] == 0)
    assert ref.rel_l2(back[..., :512], kv[..., :512].float()) < 0.05


@pytest.mark.gpu
def test_real_flash_mla_times_each_peer():
    pytest.importorskip("flash_mla")
    torch.manual_seed(0)
    q, kv_pages, bt, lens = (t.cuda() for t in dense_inputs(h=64, lens=(300, 1000)))
    figures = peers.dense_us(q, kv_pages, bt, lens)
    assert all(v and v > 0 for v in figures.values()), figures
    qs, kvs, idx = (t.cuda() for t in sparse_inputs(h=8, topk=128, P=16))
    assert peers.sparse_fp8_us(qs, kvs, idx) > 0
