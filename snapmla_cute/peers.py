"""FlashMLA's Hopper decode kernels timed in this process, on the data a bench row gives ours.

The peer is sgl-flash-mla's ``flash_mla``: its frozen ``use_legacy=True`` kernels, the ones
built for SM90. Each function takes the row's bf16 query ``q [b, s_q, h, 576]`` and its
tokens ``kv_pages`` bf16 ``[num_pages, page_size, 576]`` (the bf16 tokens our FP8 cache was
written from, page for page), with the row's ``block_table`` int32 ``[b, pages]`` and
``cache_seqlens`` int32 ``[b]`` (dense) or ``indices`` int32 ``[b, s_q, topk]`` of slot ids
``page * page_size + offset`` (sparse), so both sides read the same tokens:

* ``dense_bf16_us`` — the BF16 dense decode on the tokens as they are.
* ``dense_fp8_us`` — the dense FP8 decode (what vLLM and TensorRT-LLM run on Hopper): q and
  all 576 dims of the cache in e4m3 under one per-tensor scale each, given as descales.
* ``sparse_fp8_us`` — the sparse FP8 decode on DeepSeek-V3.2's 656-byte tokens
  (``v32_cache``). It runs 64 or 128 heads only: fewer heads are padded to 64
  (``sparse_heads``), as an engine pads them.

FlashInfer's MLA decode (``flashinfer.mla.BatchMLAPagedAttentionWrapper``, backend "fa3",
its SM90 kernel; ``flashinfer_us``) on the same rows, q as bf16 ``[b * s_q, h, 576]``, causal
for s_q > 1 as FlashMLA's:

* ``fi_bf16`` — BF16 KV: ``kv_pages`` as they are (the tokens FlashMLA's BF16 decode reads).
* ``fi_fp8`` — FP8 KV (``flashinfer_fp8_cache``): our cache's 512 content codes as they are,
  our per-token scale repeated over its four 128-channel groups (``ckv_scale_arr``), and the
  RoPE, which it takes in e4m3 under ONE scale for the whole cache (``kpe_scale``): our bf16
  RoPE times the token's scale, quantized to e4m3 under a power-of-two per-tensor scale. That
  RoPE rounding is FlashInfer's format, not ours (ours keeps the RoPE in bf16).
* ``fi_fp8_tensor`` — FP8 KV with one scale for the whole cache (``ckv_scale``, ``kpe_scale``:
  ``flashinfer_fp8_tensor_cache``), FlashMLA's dense FP8 format. Not a bench column: what its
  per-token scale array costs (``profiles/experiments/flashinfer_fp8.py``).

FlashInfer compiles its kernels at first use (nvcc, ninja; ``flashinfer_jit_report`` times
it); ``profiles/flashinfer_bundle.sh`` packs it for a machine without a registry. There is no
anchor for it: where it does not import, the benches print no FlashInfer column; where it
refuses a row, the row's ``fi_note`` says why in one line.

Each checks the peer's output once, before timing, against the float64 reference (rel-L2 at
most ``PEER_TOLERANCE``: it proves a correct call is timed, not the peer's accuracy) and raises
``PeerMismatch`` if it is off; then returns the median µs of CUDA-graph replays
(``timing.time_us``), the peer's metadata (plan) made before the graph. Where ``flash_mla``
does not import (no GPU, not installed, no legacy kernels) or the peer refuses a call, the
result is None and one line on stderr says why: the benches then use the anchors' figures.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time

import torch

from snapmla_cute import reference as ref
from snapmla_cute.sparse_reference import mla_decode_sparse_exact
from snapmla_cute.timing import time_us

# rel-L2 against float64 exact attention above which the peer's call is wrong, not inexact:
# its BF16 decode rounds only the output; the FP8 ones round q, K, V (and P) to e4m3
PEER_TOLERANCE = {"bf16": 2e-2, "dense_fp8": 0.1, "sparse_fp8": 0.1, "fi_bf16": 2e-2, "fi_fp8": 0.1,
                  "fi_fp8_tensor": 0.1}
CHECK_REQUESTS = 2  # requests compared with the reference (the first ones)
V32_BYTES = 512 + 4 * 4 + 2 * 64  # 512 e4m3, four fp32 tile scales, 64 bf16 RoPE = 656
V32_TILE = 128


class PeerMismatch(RuntimeError):
    """The peer's output is far from the reference: a timing of it would not mean anything."""


_NOTED: set[str] = set()


def _note(message: str) -> None:
    """One stderr line per distinct message (a bench asks for the peer at every row)."""
    if message not in _NOTED:
        _NOTED.add(message)
        print(f"peers: {message}", file=sys.stderr, flush=True)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def flash_mla():
    """The ``flash_mla`` module where it runs here (a GPU, the package, its legacy SM90
    kernels), else None after one stderr line."""
    if not torch.cuda.is_available():
        _note("FlashMLA not timed here: no CUDA device")
        return None
    try:
        import flash_mla as fm

        if not fm.has_legacy():
            raise RuntimeError("its legacy (SM90) kernels are not in this build")
    except Exception as e:  # ImportError, or OSError from an extension that will not load
        _note(f"FlashMLA not timed here: import flash_mla failed ({_one_line(e)})")
        return None
    return fm


def sparse_heads(h: int) -> int | None:
    """The heads FlashMLA's sparse decode runs for ``h`` of ours: 64 and 128 as they are,
    fewer padded to 64; None where it has no kernel."""
    if h in (64, 128):
        return h
    return 64 if 0 < h < 64 else None


def per_tensor_e4m3(x: torch.Tensor, chunk: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 under one scale (amax / 448), as FlashMLA's dense FP8 decode takes q and
    the cache: ``(codes e4m3, same shape; scale fp32 [1])``. Converted ``chunk`` elements at a
    time, so a cache of GBs needs no fp32 copy of itself."""
    amax = torch.maximum(x.max(), -x.min()).float().clamp(min=ref.AMAX_FLOOR)
    scale = (amax / ref.FP8_MAX).reshape(1)
    flat = x.reshape(-1)
    codes = torch.empty(flat.shape, dtype=ref.FP8, device=x.device)
    for i in range(0, flat.numel(), chunk):
        codes[i : i + chunk] = ref.to_e4m3(flat[i : i + chunk].float() / scale)
    return codes.view(x.shape), scale


def v32_cache(kv_pages: torch.Tensor) -> torch.Tensor:
    """bf16 tokens ``[P, page_size, 576]`` → FlashMLA's DeepSeek-V3.2 sparse cache
    ``[P, page_size, 1, 656]`` (e4m3 view of the bytes): per token the 512 content dims in
    e4m3 under four fp32 scales, one per 128 channels (a power of two, 2^ceil(log2(amax/448)),
    as ``emulation``'s V3.2 format), the four scales, then the 64 RoPE dims in bf16."""
    P, ps, _ = kv_pages.shape
    x = kv_pages.reshape(-1, ref.HEAD_DIM)
    n = x.shape[0]
    codes, scale = ref.pow2_tile_codes(x[:, : ref.CONTENT_DIM], V32_TILE)
    codes = codes.view(n, ref.CONTENT_DIM)
    rows = torch.cat([
        codes.view(torch.uint8),
        scale.reshape(n, -1).contiguous().view(torch.uint8),
        x[:, ref.CONTENT_DIM :].to(torch.bfloat16).contiguous().view(torch.uint8),
    ], dim=-1)
    return rows.view(P, ps, 1, V32_BYTES).view(ref.FP8)


def _check(label: str, out: torch.Tensor, expect: torch.Tensor, tol: float) -> None:
    err = ref.rel_l2(out.float(), expect)
    if not err <= tol:  # NaN fails too
        raise PeerMismatch(f"{label}: rel-L2 {err:.3g} against the float64 reference (limit {tol})")


def _run(label: str, make_call, check, why: list | None = None) -> float | None:
    """Builds the peer's call (``make_call()``, its metadata included), runs it once and
    checks the output (``check(out)``), then times it; None, with a note (and the reason
    appended to ``why``), where the peer refuses the call or its capture."""
    def refused(what, e):
        _note(f"{label}: not timed, {what} ({_one_line(e)})")
        if why is not None:
            why.append(_one_line(e))

    try:
        call = make_call()
        out = call()[0]
        torch.cuda.synchronize()
    except Exception as e:
        return refused("the call failed", e)
    check(out)
    try:
        return time_us(call)
    except Exception as e:
        return refused("the timing failed", e)


def _dense_expect(q, kv_pages, block_table, cache_seqlens, causal):
    """The float64 output of the first ``CHECK_REQUESTS`` requests, computed on first use."""
    n = min(q.shape[0], CHECK_REQUESTS)
    return functools.cache(lambda: ref.mla_decode_exact(
        q[:n], kv_pages, block_table[:n], cache_seqlens[:n], causal=causal)[0])


def _label(name: str, q: torch.Tensor, extra: str = "") -> str:
    b, s_q, h, _ = q.shape
    return f"FlashMLA {name} b{b} h{h} s_q{s_q}{extra}"


def _dense_bf16(fm, q, kv_pages, block_table, cache_seqlens, causal, expect) -> float | None:
    b, s_q, h, _ = q.shape
    label = _label("dense BF16", q)

    def make_call():
        meta = fm.get_mla_metadata()[0]  # an empty FlashMLASchedMeta
        try:
            meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
                cache_seqlens, s_q * h, 1, use_legacy=True)
        except Exception as e:  # the first call (untimed) fills it instead
            _note(f"{label}: metadata from the first call ({_one_line(e)})")
        qb, k_cache = q.contiguous(), kv_pages.unsqueeze(2)  # [P, page_size, 1, 576]
        return lambda: fm.flash_mla_with_kvcache(
            qb, k_cache, block_table, cache_seqlens, ref.CONTENT_DIM, meta, causal=causal, use_legacy=True)

    return _run(label, make_call, lambda out: _check(label, out[: CHECK_REQUESTS], expect(), PEER_TOLERANCE["bf16"]))


def _dense_fp8(fm, q, kv_pages, block_table, cache_seqlens, causal, expect) -> float | None:
    b, s_q, h, _ = q.shape
    label = _label("dense FP8", q)

    def make_call():  # the peer's inputs too: a failure (memory, say) is a note, not the bench's end
        q_codes, descale_q = per_tensor_e4m3(q)
        k_codes, descale_k = per_tensor_e4m3(kv_pages)
        meta = fm.get_mla_metadata()[0]
        meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
            cache_seqlens, s_q * h, 1, is_fp8_kvcache=True, use_legacy=True)
        k_cache = k_codes.unsqueeze(2)
        return lambda: fm.flash_mla_with_kvcache(
            q_codes, k_cache, block_table, cache_seqlens, ref.CONTENT_DIM, meta, causal=causal,
            is_fp8_kvcache=True, use_legacy=True, descale_q=descale_q, descale_k=descale_k)

    return _run(label, make_call, lambda out: _check(label, out[: CHECK_REQUESTS], expect(), PEER_TOLERANCE["dense_fp8"]))


_DENSE = {"bf16": _dense_bf16, "dense_fp8": _dense_fp8}


def dense_us(q, kv_pages, block_table, cache_seqlens, *, causal: bool = False, which=tuple(_DENSE)) -> dict:
    """The dense peers ``which`` on one row: ``dict(bf16=µs, dense_fp8=µs)`` (``anchors.peer_us``'s
    keys), None for a peer not timed here (or not asked for)."""
    times = dict.fromkeys(_DENSE)
    fm = flash_mla()
    if fm is None:
        return times
    expect = _dense_expect(q, kv_pages, block_table, cache_seqlens, causal)
    for key in which:
        times[key] = _DENSE[key](fm, q, kv_pages, block_table, cache_seqlens, causal, expect)
    return times


def dense_bf16_us(q, kv_pages, block_table, cache_seqlens, *, causal: bool = False) -> float | None:
    """FlashMLA's BF16 dense decode on the row's tokens (µs), or None."""
    return dense_us(q, kv_pages, block_table, cache_seqlens, causal=causal, which=("bf16",))["bf16"]


def dense_fp8_us(q, kv_pages, block_table, cache_seqlens, *, causal: bool = False) -> float | None:
    """FlashMLA's dense FP8 decode (per-tensor e4m3 q and cache) on the row's tokens (µs), or None."""
    return dense_us(q, kv_pages, block_table, cache_seqlens, causal=causal, which=("dense_fp8",))["dense_fp8"]


def sparse_fp8_us(q, kv_pages, indices, *, topk_length=None) -> float | None:
    """FlashMLA's sparse FP8 decode (V3.2 format) over the row's lists (µs), or None: q's
    heads as they are at 64 and 128, fewer padded with zero heads to 64 (``sparse_heads``;
    only ours are checked)."""
    fm = flash_mla()
    if fm is None:
        return None
    b, s_q, h, _ = q.shape
    heads = sparse_heads(h)
    label = _label("sparse FP8", q, f" topk{indices.shape[-1]}" + (f" (padded to h{heads})" if heads and heads != h else ""))
    if heads is None:
        _note(f"{label}: not timed, no sparse kernel for {h} heads")
        return None
    n = min(b, CHECK_REQUESTS)

    def make_call():  # the peer's inputs too: a failure (memory, say) is a note, not the bench's end
        q_in = q if heads == h else torch.cat([q, q.new_zeros(b, s_q, heads - h, ref.HEAD_DIM)], dim=2)
        q_in = q_in.contiguous()
        k_cache = v32_cache(kv_pages)
        meta = fm.get_mla_metadata()[0]  # the first call (untimed) fills it
        return lambda: fm.flash_mla_with_kvcache(
            q_in, k_cache, None, None, ref.CONTENT_DIM, meta, indices=indices, topk_length=topk_length,
            is_fp8_kvcache=True, use_legacy=True, kv_format="V32")

    def check(out):
        expect = mla_decode_sparse_exact(q[:n], kv_pages, indices[:n],
                                         topk_length=None if topk_length is None else topk_length[:n])[0]
        _check(label, out[:n, :, :h], expect, PEER_TOLERANCE["sparse_fp8"])

    return _run(label, make_call, check)


# --------------------------------------------------------------------------------------------
# FlashInfer's MLA decode: BatchMLAPagedAttentionWrapper, backend "fa3" (SM90), 0.7.x
# --------------------------------------------------------------------------------------------

FI_KEYS = ("fi_bf16", "fi_fp8")  # the benches' columns
FI_NAMES = {"fi_bf16": "BF16", "fi_fp8": "FP8", "fi_fp8_tensor": "FP8 per-tensor"}
FI_WORKSPACE_BYTES = 128 << 20  # its float workspace (partial outputs of split rows); 128 MiB as its docs start
FI_SPARSE_NOTE = "FlashInfer has no SM90 sparse MLA decode (its fa3 MLA is dense)"
FI_JIT_S: dict = {}  # seconds of the first plan of each kind in this process (its JIT build or load)


def flashinfer_mla():
    """The ``flashinfer.mla`` module where it runs here (a GPU, the package: the whole
    flashinfer-python or the trimmed one of ``profiles/flashinfer_bundle.sh``), else None
    after one stderr line."""
    if not torch.cuda.is_available():
        _note("FlashInfer not timed here: no CUDA device")
        return None
    try:
        fim = importlib.import_module("flashinfer.mla")
        fim.BatchMLAPagedAttentionWrapper, fim.MLAPlanMetadata  # noqa: B018 (0.7's planned API)
    except Exception as e:  # ImportError, AttributeError (an older flashinfer), or its own import errors
        _note(f"FlashInfer not timed here: import flashinfer.mla failed ({_one_line(e)})")
        return None
    return fim


def _rope_values(kv: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """Our cache's RoPE as values, fp32 ``[..., 64]``: its bf16 (divided by the token's scale)
    times the scale."""
    return kv[..., ref.CONTENT_DIM :].contiguous().view(torch.bfloat16).float() * kv_scale.unsqueeze(-1)


def _pow2_scale(amax: torch.Tensor) -> float:
    """2^ceil(log2(amax / 448)): a per-tensor e4m3 scale FlashInfer's kernel keeps exactly (it
    rounds its scales to bf16 before it multiplies)."""
    return float(torch.exp2(torch.ceil(torch.log2(amax.clamp(min=ref.AMAX_FLOOR) / ref.FP8_MAX))))


def flashinfer_fp8_cache(kv: torch.Tensor, kv_scale: torch.Tensor, chunk: int = 1 << 24):
    """Our FP8 cache (``kv`` uint8 ``[P, ps, 640]``, ``kv_scale`` fp32 ``[P, ps]``) as FlashInfer's
    FP8 MLA cache, the same tokens: ``(kv_fi e4m3 [P, ps, 576], ckv_scale_arr fp32 [P, ps, 4],
    kpe_scale float)``. ``kv_fi``'s 512 content codes are ours byte for byte and ``ckv_scale_arr``
    repeats each token's scale over its four 128-channel groups (the kernel's per-token,
    per-128-channel scales: content = bf16(code · scale)). Its RoPE is e4m3 under one scale for
    the whole cache: our RoPE values quantized under 2^ceil(log2(amax / 448)), a power of two
    because the kernel rounds ``kpe_scale`` to bf16 before it multiplies. Converted ``chunk``
    bytes of our cache at a time."""
    P, ps, _ = kv.shape
    step = max(1, chunk // (ps * ref.KV_ROW_BYTES))
    amax = torch.zeros((), dtype=torch.float32, device=kv.device)
    for i in range(0, P, step):
        amax = torch.maximum(amax, _rope_values(kv[i : i + step], kv_scale[i : i + step]).abs().max())
    kpe_scale = _pow2_scale(amax)
    kv_fi = torch.empty(P, ps, ref.HEAD_DIM, dtype=ref.FP8, device=kv.device)
    for i in range(0, P, step):
        part = kv[i : i + step]
        kv_fi[i : i + step, :, : ref.CONTENT_DIM] = part[..., : ref.CONTENT_DIM].view(ref.FP8)
        kv_fi[i : i + step, :, ref.CONTENT_DIM :] = ref.to_e4m3(_rope_values(part, kv_scale[i : i + step]) / kpe_scale)
    ckv_scale_arr = kv_scale.unsqueeze(-1).expand(P, ps, ref.CONTENT_DIM // 128).contiguous()
    return kv_fi, ckv_scale_arr, kpe_scale


def flashinfer_fp8_tensor_cache(kv_pages: torch.Tensor, chunk: int = 1 << 24):
    """bf16 tokens ``kv_pages [P, ps, 576]`` as FlashInfer's FP8 MLA cache under one scale per
    tensor, FlashMLA's dense FP8 format: ``(kv_fi e4m3 [P, ps, 576], ckv_scale, kpe_scale)``,
    the content and the RoPE each under 2^ceil(log2(amax / 448)) (powers of two: its kernel
    rounds both scales to bf16). Converted ``chunk`` values of ``kv_pages`` at a time."""
    P, ps, _ = kv_pages.shape
    step = max(1, chunk // (ps * ref.HEAD_DIM))
    scales = []
    for part in (slice(None, ref.CONTENT_DIM), slice(ref.CONTENT_DIM, None)):
        amax = torch.zeros((), dtype=torch.float32, device=kv_pages.device)
        for i in range(0, P, step):
            x = kv_pages[i : i + step, :, part]
            amax = torch.maximum(amax, torch.maximum(x.max(), -x.min()).float())
        scales.append(_pow2_scale(amax))
    kv_fi = torch.empty(P, ps, ref.HEAD_DIM, dtype=ref.FP8, device=kv_pages.device)
    for i in range(0, P, step):
        x = kv_pages[i : i + step].float()
        kv_fi[i : i + step, :, : ref.CONTENT_DIM] = ref.to_e4m3(x[..., : ref.CONTENT_DIM] / scales[0])
        kv_fi[i : i + step, :, ref.CONTENT_DIM :] = ref.to_e4m3(x[..., ref.CONTENT_DIM :] / scales[1])
    return kv_fi, scales[0], scales[1]


def _csr(block_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int, s_q: int):
    """The CSR metadata FlashInfer's fa3 plan takes, from a block table: ``qo_indptr``
    (s_q rows a request), ``kv_indptr`` and ``kv_indices`` (each request's pages in order) and
    ``kv_len_arr``, int32 on the table's device."""
    b, dev = block_table.shape[0], block_table.device
    lens = cache_seqlens.to(dev, torch.int64)
    pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(block_table.shape[1], device=dev)[None, :] < pages[:, None]
    kv_indices = block_table[used].to(torch.int32)  # row-major: request by request, page by page
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * s_q
    return qo_indptr, kv_indptr, kv_indices, lens.to(torch.int32)


def _fi_call(fim, kind, q, kv, block_table, cache_seqlens, causal, run_kw=None):
    """A planned wrapper's call on the row: returns ``() -> (out [b, s_q, h, 512],)``;
    ``run_kw`` its FP8 scales. The first plan of each kind in the process builds (or loads) its
    JIT module: timed into ``FI_JIT_S``."""
    b, s_q, h, _ = q.shape
    fp8 = kind != "fi_bf16"
    wrapper = fim.BatchMLAPagedAttentionWrapper(
        torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device), backend="fa3")
    started = time.perf_counter()
    wrapper.plan(
        metadata=fim.MLAPlanMetadata.csr(*_csr(block_table, cache_seqlens, kv.shape[1], s_q)),
        num_heads=h, head_dim_ckv=ref.CONTENT_DIM, head_dim_kpe=ref.ROPE_DIM, page_size=kv.shape[1],
        causal=causal, sm_scale=ref.default_softmax_scale(), q_data_type=torch.bfloat16,
        kv_data_type=ref.FP8 if fp8 else torch.bfloat16, **(dict(scale_mode="kv-per-tensor") if fp8 else {}))
    FI_JIT_S.setdefault(kind, time.perf_counter() - started)
    query = q.reshape(b * s_q, h, ref.HEAD_DIM)
    out = q.new_empty(b * s_q, h, ref.CONTENT_DIM)
    run_kw = run_kw or {}
    return lambda: (wrapper.run(query=query, kv_cache=kv, out=out, **run_kw).view(b, s_q, h, ref.CONTENT_DIM),)


def flashinfer_us(q, kv_pages, block_table, cache_seqlens, *, cache=None, causal: bool = False,
                  which=FI_KEYS) -> dict:
    """FlashInfer's MLA decode on one row: ``{}`` where it does not run here (no GPU, not
    importable), else ``dict(fi_bf16=µs, fi_fp8=µs, note=...)`` (and ``fi_fp8_tensor`` where
    ``which`` names it): None for a kind not timed (refused, failed or not asked for) and
    ``note`` the one-line reason of the first refusal (None when none). ``cache``: our FP8
    cache ``(kv, kv_scale)`` of ``kv_pages`` (``reference.quantize_kv_cache`` of them when not
    given), which the FP8 kind reads."""
    fim = flashinfer_mla()
    if fim is None:
        return {}
    b, s_q, h, _ = q.shape
    expect = _dense_expect(q, kv_pages, block_table, cache_seqlens, causal)
    times, why = dict.fromkeys((*FI_KEYS, *which)), []
    for kind in which:
        label = f"FlashInfer {FI_NAMES[kind]} KV b{b} h{h} s_q{s_q}"

        def make_call(kind=kind):  # the FP8 cache too: a failure (memory, say) is a note, not the bench's end
            if kind == "fi_bf16":
                return _fi_call(fim, kind, q, kv_pages, block_table, cache_seqlens, causal)
            if kind == "fi_fp8_tensor":
                kv_fi, ckv, kpe = flashinfer_fp8_tensor_cache(kv_pages)
                return _fi_call(fim, kind, q, kv_fi, block_table, cache_seqlens, causal,
                                dict(ckv_scale=ckv, kpe_scale=kpe))
            kv, kv_scale = cache if cache is not None else ref.quantize_kv_cache(kv_pages)
            kv_fi, arr, kpe = flashinfer_fp8_cache(kv, kv_scale)
            return _fi_call(fim, kind, q, kv_fi, block_table, cache_seqlens, causal,
                            dict(ckv_scale_arr=arr, kpe_scale=kpe))

        def check(out, kind=kind, label=label):
            _check(label, out[:CHECK_REQUESTS], expect(), PEER_TOLERANCE[kind])

        reasons = []
        times[kind] = _run(label, make_call, check, reasons)
        why += [f"{FI_NAMES[kind].lower()}: {r}" for r in reasons]
    return dict(times, note=why[0][:120] if why else None)


def flashinfer_sparse() -> dict:
    """FlashInfer beside a sparse row: ``{}`` where it does not run here, else no figure and
    why (its SM90 MLA decode is dense)."""
    return {} if flashinfer_mla() is None else dict(fi_bf16=None, fi_fp8=None, note=FI_SPARSE_NOTE)


def flashinfer_jit_report(device: str = "cuda") -> str | None:
    """Plans a small row of each kind (BF16 and FP8 KV) in two threads, which builds
    FlashInfer's two fa3 MLA JIT modules side by side where its cache does not hold them yet
    (minutes) and loads them; one line with the seconds each took, the wall time, the version
    and the JIT cache's folder. None where FlashInfer does not import (after the usual note)."""
    from concurrent.futures import ThreadPoolExecutor

    fim = flashinfer_mla()
    if fim is None:
        return None
    q = torch.zeros(1, 1, 16, ref.HEAD_DIM, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(2, 64, ref.HEAD_DIM, dtype=torch.bfloat16, device=device)
    table = torch.arange(2, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([128], dtype=torch.int32, device=device)

    def plan(kind, kv_kind):
        FI_JIT_S.pop(kind, None)
        _fi_call(fim, kind, q, kv_kind, table, lens, False)
        return FI_JIT_S[kind]

    started = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        futures = {kind: pool.submit(plan, kind, k) for kind, k in (("fi_bf16", kv), ("fi_fp8", kv.to(ref.FP8)))}
    parts = []
    for kind, future in futures.items():
        name = "BF16 KV" if kind == "fi_bf16" else "FP8 KV"
        try:
            parts.append(f"{name} {future.result():.1f} s")
        except Exception as e:
            parts.append(f"{name} failed ({_one_line(e)})")
    wall = time.perf_counter() - started
    try:
        version = importlib.import_module("flashinfer").__version__
        from flashinfer.jit import env as jit_env

        where = str(jit_env.FLASHINFER_JIT_DIR)
    except Exception as e:  # an attribute moved in another version: the times still stand
        version, where = "?", f"? ({_one_line(e)})"
    return (f"FlashInfer {version} fa3 MLA: first plan (JIT build or load) {', '.join(parts)} "
            f"({wall:.1f} s wall, side by side); JIT cache {where}")
