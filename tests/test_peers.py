"""The in-process FlashMLA and FlashInfer timings (``snapmla_cute.peers``), on the CPU: None
(FlashInfer: no figures at all) and one note when ``flash_mla`` / ``flashinfer`` is absent or
refuses a call; the inputs they build (per-tensor e4m3, the V3.2 656-byte cache, heads padded
to 64, FlashInfer's FP8 cache with per-128-channel scales and a one-scale e4m3 RoPE) decoded
back by stand-ins that compute what the real ones are documented to; a wrong output raises.
GPU tests run the real peers where they are installed."""

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


# --------------------------------------------------------------------------------------------
# FlashInfer (flashinfer.mla.BatchMLAPagedAttentionWrapper, backend "fa3", 0.7.4's interface)
# --------------------------------------------------------------------------------------------


def fi_fp8_tokens(kv_fi, ckv_scale_arr, kpe_scale):
    """FlashInfer's FP8 MLA cache ``[P, ps, 576]`` back to fp32 tokens as its fa3 kernel
    dequantizes them (``repack_fp8_kv_to_bf16`` in mla_hopper.cuh): content bf16(code · the
    scale of its 128-channel group, in fp32), RoPE bf16(code) · bf16(kpe_scale) in bf16."""
    P, ps, _ = kv_fi.shape
    codes = kv_fi[..., :512].float().view(P, ps, 4, 128)
    content = (codes * ckv_scale_arr[..., None]).view(P, ps, 512).bfloat16()
    rope = kv_fi[..., 512:].bfloat16() * torch.tensor(kpe_scale).bfloat16()
    return torch.cat([content, rope], -1).float()


class FakeFlashInferMLA(types.ModuleType):
    """Stands in for ``flashinfer.mla`` 0.7.4: its wrapper checks ``plan``'s and ``run``'s
    arguments as that version's fa3 path takes them (CSR metadata, packed query and cache, FP8
    scales) and computes the decode in float64 from what it is given (``wrong``: zeros;
    ``refuse``: ``plan`` raises that message)."""

    def __init__(self, wrong=False, refuse=None):
        super().__init__("flashinfer.mla")
        self.wrong, self.refuse, self.calls = wrong, refuse, []
        fake = self

        class MLAPlanMetadata(types.SimpleNamespace):
            @classmethod
            def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
                return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)

        class BatchMLAPagedAttentionWrapper:
            def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
                assert backend == "fa3" and not use_cuda_graph and float_workspace_buffer.dtype == torch.uint8

            def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                     q_data_type, kv_data_type, scale_mode="default"):
                if fake.refuse:
                    raise ValueError(fake.refuse)
                m = metadata
                assert all(t.dtype == torch.int32 for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_len_arr))
                assert (head_dim_ckv, head_dim_kpe, q_data_type) == (512, 64, torch.bfloat16)
                assert scale_mode == ("kv-per-tensor" if kv_data_type == FP8 else "default")
                assert kv_data_type in (FP8, torch.bfloat16) and sm_scale == 576**-0.5
                self.m, self.h, self.ps, self.causal, self.kv_dtype = m, num_heads, page_size, causal, kv_data_type
                fake.calls.append(("plan", kv_data_type))

            def run(self, *, query, kv_cache, out=None, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None):
                m, n = self.m, int(self.m.qo_indptr[-1])
                b = m.kv_len_arr.numel()
                assert query.dtype == torch.bfloat16 and query.shape == (n, self.h, 576)
                assert kv_cache.dtype == self.kv_dtype and kv_cache.shape[1:] == (self.ps, 576)
                assert out.shape == (n, self.h, 512) and out.dtype == torch.bfloat16
                if self.kv_dtype == FP8:
                    assert (ckv_scale is None) != (ckv_scale_arr is None)  # exactly one, as 0.7.4 asks
                    assert isinstance(kpe_scale, float) and kpe_scale > 0
                    if ckv_scale is not None:
                        assert isinstance(ckv_scale, float) and ckv_scale > 0
                        ckv_scale_arr = torch.full((*kv_cache.shape[:2], 4), ckv_scale)
                    assert ckv_scale_arr.shape == (*kv_cache.shape[:2], 4) and ckv_scale_arr.dtype == torch.float32
                    assert ckv_scale_arr.is_contiguous()
                    tokens = fi_fp8_tokens(kv_cache, ckv_scale_arr, kpe_scale)
                else:
                    assert ckv_scale is ckv_scale_arr is kpe_scale is None
                    tokens = kv_cache
                pages = (m.kv_indptr[1:] - m.kv_indptr[:-1]).tolist()
                table = torch.zeros(b, max(pages), dtype=torch.int32)
                for i, k in enumerate(pages):
                    table[i, :k] = m.kv_indices[m.kv_indptr[i] : m.kv_indptr[i + 1]]
                got = ref.mla_decode_exact(query.view(b, n // b, self.h, 576), tokens, table, m.kv_len_arr,
                                           causal=self.causal)[0]
                out.copy_(torch.zeros_like(out) if fake.wrong else got.view(n, self.h, 512).bfloat16())
                fake.calls.append(("run", self.kv_dtype))
                return out

        self.BatchMLAPagedAttentionWrapper, self.MLAPlanMetadata = BatchMLAPagedAttentionWrapper, MLAPlanMetadata


def install_flashinfer(monkeypatch, mla):
    """``flashinfer`` as the peers import it: the package (a version, ``jit.env``'s cache
    folder) and ``flashinfer.mla`` (``mla``; None: not installed)."""
    if mla is None:
        monkeypatch.setitem(sys.modules, "flashinfer.mla", None)
        return
    env = types.SimpleNamespace(FLASHINFER_JIT_DIR="/tmp/fi-ws/cached_ops")
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.7.4", mla=mla))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", types.SimpleNamespace(env=env))
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)


def test_flashinfer_absent_gives_no_figures(fake_gpu, monkeypatch, capsys):
    install_flashinfer(monkeypatch, None)
    q, kv_pages, bt, lens = dense_inputs()
    assert peers.flashinfer_us(q, kv_pages, bt, lens) == {}
    assert peers.flashinfer_sparse() == {} and peers.flashinfer_jit_report() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "import flashinfer.mla failed" in err[0]


def test_flashinfer_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(peers, "_NOTED", set())
    install_flashinfer(monkeypatch, FakeFlashInferMLA())
    assert peers.flashinfer_us(*dense_inputs()) == {} and peers.flashinfer_sparse() == {}


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True)])
def test_flashinfer_times_checked_calls(fake_gpu, monkeypatch, s_q, causal):
    fake = FakeFlashInferMLA()
    install_flashinfer(monkeypatch, fake)
    q, kv_pages, bt, lens = dense_inputs(s_q=s_q, lens=(130, 300))
    cache = ref.quantize_kv_cache(kv_pages)
    assert peers.flashinfer_us(q, kv_pages, bt, lens, cache=cache, causal=causal) == dict(fi_bf16=7.5, fi_fp8=7.5, note=None)
    bf, f8 = torch.bfloat16, FP8
    assert fake.calls == [("plan", bf), ("run", bf), ("run", bf), ("plan", f8), ("run", f8), ("run", f8)]
    # without the cache: our quantization of the tokens, the same bytes
    assert peers.flashinfer_us(q, kv_pages, bt, lens, causal=causal, which=("fi_fp8",))["fi_fp8"] == 7.5
    assert peers.flashinfer_sparse() == dict(fi_bf16=None, fi_fp8=None, note=peers.FI_SPARSE_NOTE)


def test_flashinfer_per_tensor_fp8_kind(fake_gpu, monkeypatch):
    """``fi_fp8_tensor`` (not a bench column): FP8 KV under one scale per tensor, timed only
    when asked for, checked like the others."""
    fake = FakeFlashInferMLA()
    install_flashinfer(monkeypatch, fake)
    q, kv_pages, bt, lens = dense_inputs(lens=(130, 300))
    got = peers.flashinfer_us(q, kv_pages, bt, lens, which=("fi_fp8_tensor",))
    assert got == dict(fi_bf16=None, fi_fp8=None, fi_fp8_tensor=7.5, note=None)
    assert fake.calls == [("plan", FP8), ("run", FP8), ("run", FP8)]
    install_flashinfer(monkeypatch, FakeFlashInferMLA(wrong=True))
    with pytest.raises(peers.PeerMismatch, match="FlashInfer FP8 per-tensor KV"):
        peers.flashinfer_us(q, kv_pages, bt, lens, which=("fi_fp8_tensor",))


def test_flashinfer_fp8_tensor_cache():
    """One power-of-two scale for the content and one for the RoPE (its kernel rounds both
    to bf16); every code under 448; the same bytes converted a page at a time."""
    kv_pages = (torch.randn(3, 64, 576) / 10).to(torch.bfloat16)
    kv_pages[1, :, 512:] *= 30
    kv_fi, ckv, kpe = peers.flashinfer_fp8_tensor_cache(kv_pages)
    assert kv_fi.shape == (3, 64, 576) and kv_fi.dtype == FP8
    for scale, part in ((ckv, kv_pages[..., :512]), (kpe, kv_pages[..., 512:])):
        assert math.log2(scale) == int(math.log2(scale))
        assert scale >= float(part.float().abs().max()) / 448 > scale / 2
    theirs = fi_fp8_tokens(kv_fi, torch.full((3, 64, 4), ckv), kpe)
    assert ref.rel_l2(theirs, kv_pages.float()) < 0.05
    again = peers.flashinfer_fp8_tensor_cache(kv_pages, chunk=64 * 576)
    assert torch.equal(again[0].view(torch.uint8), kv_fi.view(torch.uint8)) and again[1:] == (ckv, kpe)


def test_flashinfer_refusal_is_a_one_line_note(fake_gpu, monkeypatch, capsys):
    install_flashinfer(monkeypatch, FakeFlashInferMLA(refuse="fa3 MLA requires head_dim_ckv in (128, 256, 512).\nmore text"))
    figures = peers.flashinfer_us(*dense_inputs())
    assert figures["fi_bf16"] is figures["fi_fp8"] is None
    assert figures["note"] == "bf16: ValueError: fa3 MLA requires head_dim_ckv in (128, 256, 512)."
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("FlashInfer" in e and "more text" not in e for e in err)


def test_a_wrong_flashinfer_output_raises(fake_gpu, monkeypatch):
    install_flashinfer(monkeypatch, FakeFlashInferMLA(wrong=True))
    with pytest.raises(peers.PeerMismatch, match="FlashInfer BF16 KV"):
        peers.flashinfer_us(*dense_inputs())
    with pytest.raises(peers.PeerMismatch, match="FlashInfer FP8 KV"):
        peers.flashinfer_us(*dense_inputs(), which=("fi_fp8",))


def test_flashinfer_jit_report_plans_each_kind(fake_gpu, monkeypatch):
    fake = FakeFlashInferMLA()
    install_flashinfer(monkeypatch, fake)
    line = peers.flashinfer_jit_report(device="cpu")
    assert line.startswith("FlashInfer 0.7.4 fa3 MLA: first plan (JIT build or load) BF16 KV ")
    assert "FP8 KV" in line and "s wall, side by side); JIT cache /tmp/fi-ws/cached_ops" in line
    assert sorted(fake.calls, key=str) == [("plan", torch.bfloat16), ("plan", FP8)]


def test_flashinfer_csr_from_a_block_table():
    table = torch.tensor([[5, 2, 9], [7, 0, 0], [3, 4, 0]], dtype=torch.int32)
    qo, kv_indptr, kv_indices, lens = peers._csr(table, torch.tensor([130, 64, 65], dtype=torch.int32), 64, 2)
    assert qo.tolist() == [0, 2, 4, 6] and kv_indptr.tolist() == [0, 3, 4, 6]
    assert kv_indices.tolist() == [5, 2, 9, 7, 3, 4] and lens.tolist() == [130, 64, 65]
    assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, kv_indices, lens))


def test_flashinfer_fp8_cache_maps_our_scales():
    """Our per-token scale becomes FlashInfer's per-128-channel scales by repetition (the
    content codes are ours byte for byte, so its content equals our dequantized content); its
    RoPE is e4m3 under one power-of-two scale for the whole cache."""
    kv_pages = (torch.randn(3, 64, 576) / 10).to(torch.bfloat16)
    kv_pages[1, :, 512:] *= 30  # RoPE far larger than the content on one page
    kv, kv_scale = ref.quantize_kv_cache(kv_pages)
    kv_fi, scale_arr, kpe_scale = peers.flashinfer_fp8_cache(kv, kv_scale)
    assert kv_fi.shape == (3, 64, 576) and kv_fi.dtype == FP8 and kv_fi.is_contiguous()
    assert torch.equal(kv_fi[..., :512].view(torch.uint8), kv[..., :512])
    assert scale_arr.shape == (3, 64, 4) and scale_arr.is_contiguous()
    assert torch.equal(scale_arr, kv_scale[..., None].expand(3, 64, 4))
    content, rope = ref.unpack_kv_rows(kv)
    ours = ref.dequantize_rows(content, rope, kv_scale).float()
    rope_values = rope.float() * kv_scale[..., None]
    assert math.log2(kpe_scale) == int(math.log2(kpe_scale))
    assert kpe_scale >= float(rope_values.abs().max()) / 448 > kpe_scale / 2
    assert float(kv_fi[..., 512:].float().abs().max()) <= 448
    theirs = fi_fp8_tokens(kv_fi, scale_arr, kpe_scale)
    assert torch.equal(theirs[..., :512], ours[..., :512])
    assert ref.rel_l2(theirs[..., 512:], rope_values) < 0.05
    # converted a page at a time: the same bytes
    again = peers.flashinfer_fp8_cache(kv, kv_scale, chunk=64 * 640)
    assert torch.equal(again[0].view(torch.uint8), kv_fi.view(torch.uint8)) and again[2] == kpe_scale


@pytest.mark.gpu
def test_real_flashinfer_times_each_kind():
    pytest.importorskip("flashinfer.mla")
    torch.manual_seed(0)
    q, kv_pages, bt, lens = (t.cuda() for t in dense_inputs(h=64, lens=(300, 1000)))
    for s_q, causal in ((1, False), (2, True)):
        qs = torch.randn(2, s_q, 64, 576, device="cuda").to(torch.bfloat16)
        figures = peers.flashinfer_us(qs, kv_pages, bt, lens, causal=causal, which=(*peers.FI_KEYS, "fi_fp8_tensor"))
        assert all(figures[k] > 0 for k in (*peers.FI_KEYS, "fi_fp8_tensor")) and figures["note"] is None, figures
