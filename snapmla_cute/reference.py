"""The specification, in plain torch (CPU or GPU): SnapMLA's FP8 formats and exact MLA decode.

Everything a GPU kernel of this project computes is defined here first (or, for the decode's
arithmetic, in ``emulation`` and ``sparse_reference``), and GPU tests hold the kernels to it:

* ``quantize_rows`` / ``dequantize_rows`` — RoPE-aware per-token FP8 quantization
  (paper §3.1, Eq. 6): the exact bytes ``quantize_q``, ``append_kv`` and ``dequantize_kv``
  must produce; ``pack_kv_rows`` / ``quantize_kv_cache`` the FP8 cache they fill.
* ``mla_decode_exact`` — paged MLA decode in float64 on unquantized inputs.
* ``merge_partials`` — the LSE merge of partial decodes (context parallelism), float64.
* ``rel_l2``, ``cos_diff``, ``rmse``, ``lse_max_abs`` — the error metrics (§4.3).

Shapes: q ``[b, s_q, h, 576]``; paged cache ``[num_pages, page_size, 576]`` (unquantized) or
the FP8 format (``kv`` uint8 ``[num_pages, page_size, 640]`` + ``kv_scale`` fp32
``[num_pages, page_size]``); ``block_table`` int32 ``[b, max_pages]``; ``cache_seqlens`` int32
``[b]``. Outputs: ``out [b, s_q, h, 512]``, ``lse [b, h, s_q]`` (natural log; ``-inf`` and a
zero output for an empty sequence). With ``causal`` query ``i`` of ``s_q`` sees keys
``< L - s_q + i + 1``.

This module imports nothing of ours on purpose: it restates the format constants.
"""

from __future__ import annotations

import math

import torch

CONTENT_DIM = 512
ROPE_DIM = 64
HEAD_DIM = CONTENT_DIM + ROPE_DIM
KV_ROW_BYTES = CONTENT_DIM + 2 * ROPE_DIM
FP8_MAX = 448.0
AMAX_FLOOR = 1e-6
LOG2E = math.log2(math.e)

FP8 = torch.float8_e4m3fn


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 → e4m3 with round-to-nearest-even and saturation at ±448 (= cvt.rn.satfinite)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def pow2_tile_codes(content: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, C]`` in e4m3 under one power-of-two scale per ``tile`` channels, 2^ceil(log2(amax /
    448)) (DeepSeek-V3.2's cache format; code·scale is exact in bf16): ``(codes e4m3 [n, C /
    tile, tile], scales fp32 [n, C / tile, 1])``."""
    n, c = content.shape
    tiles = content.float().view(n, c // tile, tile)
    amax = tiles.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return to_e4m3(tiles / scale), scale


# --------------------------------------------------------------------------------------------
# RoPE-aware per-token quantization (§3.1, Eq. 6)
# --------------------------------------------------------------------------------------------


def row_scale(content: torch.Tensor) -> torch.Tensor:
    """σ = max(amax(|content|), AMAX_FLOOR) / 448 in fp32, one per row."""
    amax = content.float().abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # a true division: torch would turn "/ python_scalar" into a multiply by its reciprocal
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes ``[..., 576]`` rows: content → e4m3, RoPE → bf16 pre-divided, one fp32 scale.

    The fused kernels run exactly these fp32 operations (one IEEE division for the scale,
    one reciprocal, one multiply per element, then one rounding), so their bytes are equal::

        σ     = max(amax|x_c|, 1e-6) / 448
        inv   = 1 / σ
        x_c8  = e4m3_rne_sat(x_c · inv)
        x_r'  = bf16_rne(x_r · inv)          # Eq. 6: RoPE pre-divided by the content scale

    Returns ``(content e4m3 [..., 512], rope bf16 [..., 64], scale fp32 [...])``.
    """
    if x.shape[-1] != HEAD_DIM:
        raise ValueError(f"quantize_rows: expected last dim {HEAD_DIM}, got {x.shape[-1]}")
    xf = x.float()
    scale = row_scale(xf[..., :CONTENT_DIM])
    inv = (1.0 / scale).unsqueeze(-1)
    content = to_e4m3(xf[..., :CONTENT_DIM] * inv)
    rope = (xf[..., CONTENT_DIM:] * inv).to(torch.bfloat16)
    return content, rope, scale


def dequantize_rows(content: torch.Tensor, rope: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_rows`` as ``dequantize_kv`` computes it: bf16(value · σ), fp32 product."""
    s = scale.float().unsqueeze(-1)
    return torch.cat(
        [(content.float() * s).to(torch.bfloat16), (rope.float() * s).to(torch.bfloat16)], dim=-1
    )


def pack_kv_rows(content: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Packs e4m3 content ``[..., 512]`` and bf16 RoPE ``[..., 64]`` into 640-byte rows."""
    return torch.cat(
        [content.contiguous().view(torch.uint8), rope.contiguous().view(torch.uint8)], dim=-1
    )


def unpack_kv_rows(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits 640-byte rows into e4m3 content ``[..., 512]`` and bf16 RoPE ``[..., 64]``."""
    if kv.dtype != torch.uint8 or kv.shape[-1] != KV_ROW_BYTES:
        raise ValueError(f"unpack_kv_rows: expected uint8 [..., {KV_ROW_BYTES}], got {kv.dtype} {tuple(kv.shape)}")
    content = kv[..., :CONTENT_DIM].contiguous().view(FP8)
    rope = kv[..., CONTENT_DIM:].contiguous().view(torch.bfloat16)
    return content, rope


def quantize_kv_cache(k_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unquantized ``[P, page_size, 576]`` pages → FP8 cache ``(kv uint8 [P, ps, 640], kv_scale fp32 [P, ps])``."""
    content, rope, scale = quantize_rows(k_pages)
    return pack_kv_rows(content, rope), scale


# --------------------------------------------------------------------------------------------
# Exact decode (float64)
# --------------------------------------------------------------------------------------------


def visible_lengths(L: int, s_q: int, causal: bool, visible=None) -> list[int]:
    """Keys visible to each of the s_q query tokens of a request with L cached tokens;
    ``visible`` (its s_q counts, ``mla_decode``'s ``visible``) clamped as the kernel does."""
    if not causal:
        return [L] * s_q
    if visible is None:
        return [max(0, min(L, L - s_q + i + 1)) for i in range(s_q)]
    return [max(0, min(L, max(int(visible[i]), L - s_q + i + 1))) for i in range(s_q)]


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor, b: int, L: int) -> torch.Tensor:
    """Tokens 0..L-1 of request b from a paged tensor ``[P, page_size, ...]``."""
    page_size = pages.shape[1]
    n_pages = (L + page_size - 1) // page_size
    if n_pages > block_table.shape[1]:
        raise ValueError(
            f"block_table: request {b} needs {n_pages} pages for {L} tokens, table has {block_table.shape[1]}"
        )
    idx = block_table[b, :n_pages].long().to(pages.device)
    return pages.index_select(0, idx).reshape(n_pages * page_size, *pages.shape[2:])[:L]


def default_softmax_scale() -> float:
    return HEAD_DIM**-0.5


def mla_decode_exact(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact paged MLA decode in float64 on unquantized q ``[b,s_q,h,576]`` and K pages ``[P,ps,576]``.

    V is the first 512 dims of K (absorbed MLA). ``visible`` ``[b, s_q]``: ``mla_decode``'s
    causal limits. Returns float64 ``out [b,s_q,h,512]`` and ``lse [b,h,s_q]`` (natural log).
    """
    vis_rows = None if visible is None else visible.tolist()
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    b, s_q, h, _ = q.shape
    out = torch.zeros(b, s_q, h, CONTENT_DIM, dtype=torch.float64, device=q.device)
    lse = torch.full((b, h, s_q), -math.inf, dtype=torch.float64, device=q.device)
    lens = cache_seqlens.tolist()
    for bi in range(b):
        L = int(lens[bi])
        if L == 0:
            continue
        k = gather_pages(k_pages, block_table, bi, L).to(q.device, torch.float64)
        for i, n_vis in enumerate(visible_lengths(L, s_q, causal, None if vis_rows is None else vis_rows[bi])):
            if n_vis == 0:
                continue
            qi = q[bi, i].to(torch.float64)  # [h, 576]
            s = (qi @ k[:n_vis].T) * scale  # [h, n_vis]
            lse_i = torch.logsumexp(s, dim=-1)
            out[bi, i] = torch.softmax(s, dim=-1) @ k[:n_vis, :CONTENT_DIM]
            lse[bi, :, i] = lse_i
    return out, lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of W partial decodes in float64 (what ``kernels.lse_merge`` computes):
    ``outs [W, b, s_q, h, 512]``, ``lses [W, b, h, s_q]`` → ``out [b, s_q, h, 512]``,
    ``lse [b, h, s_q]``; rows with every ``lse_w`` = -inf give zeros and -inf."""
    lses = lses.double()
    lse = torch.logsumexp(lses, dim=0)  # -inf where every shard is -inf
    w = torch.exp(lses - lse.unsqueeze(0)).nan_to_num(0.0)  # [W, b, h, s_q]
    out = (outs.double() * w.permute(0, 1, 3, 2).unsqueeze(-1)).sum(0)
    return out, lse


# --------------------------------------------------------------------------------------------
# Error metrics (§4.3)
# --------------------------------------------------------------------------------------------


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp(min=1e-300))


def cos_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """1 − 2Σxy / Σ(x² + y²): 0 for identical tensors, sensitive to scale as well as angle."""
    x, ref = x.double(), ref.double()
    denom = (x * x + ref * ref).sum()
    return float(1 - 2 * (x * ref).sum() / denom) if denom > 0 else 0.0


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).pow(2).mean().sqrt())


def lse_max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |Δ| over finite entries; ±inf must match exactly (else inf)."""
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), fin) or not torch.equal(x[~fin], ref[~fin]):
        return math.inf
    return float((x[fin] - ref[fin]).abs().max()) if fin.any() else 0.0
