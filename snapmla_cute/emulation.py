"""The bit-faithful emulation of SnapMLA's FP8 decode, in plain torch (part of the specification).

``mla_decode_emulated`` computes what the decode kernel computes: FP8 QK with the RoPE part
in the pre-scaled domain, V-scale fusion P' = P·σ_k, per-row block-wise dynamic P
quantization and implicit dequantization through the online-softmax rescale factors (App. B
Eq. 13–14, App. C Algorithm 1), both GEMMs through ``tensor_core.tensor_core_mma`` (the
fitted model of WGMMA's adder). ``QuantConfig`` selects the paper's Table-2 alternatives
(A: RoPE-unaware per-token, B: per-tensor static 1.0, C: per-tensor dynamic, D: per-block)
and the formats Hopper users run today, for the accuracy study.

Shapes as in ``reference``, whose formats, gather and exact decode this builds on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from snapmla_cute.reference import (
    AMAX_FLOOR,
    CONTENT_DIM,
    FP8_MAX,
    HEAD_DIM,
    LOG2E,
    default_softmax_scale,
    gather_pages,
    pow2_tile_codes,
    quantize_rows,
    row_scale,
    to_e4m3,
    unpack_kv_rows,
    visible_lengths,
)
from snapmla_cute.tensor_core import tensor_core_mma

# P' below this counts as 0 in a block's σ_p (the decode kernel's ``P_TINY``, restated)
P_TINY = 2.0**-64
BLOCK_N = 64  # KV tokens per block: the PV tile along which P is quantized (§3.2.2 ii)


# --------------------------------------------------------------------------------------------
# Quantization configurations (Table 2)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """How Q, the KV cache and P are quantized before the decode's two GEMMs (paper Table 2,
    plus the formats Hopper users run today and the error budget's one-step switches).

    ``kv``: "per_token" (SnapMLA, Configs A), "per_tensor_static" / "per_tensor_dynamic"
    (Configs B, C), "per_block" (Config D), "per_tensor_all" (FlashMLA's dense FP8: all 576
    dims e4m3 with one per-tensor scale, Q likewise), "tile128" (FlashMLA's sparse V3.2
    cache: four 128-channel power-of-two scales per token, dequantized to BF16, BF16 math) or
    "bf16" (a BF16 cache and query as they are: FlashMLA's BF16 decode, 1152 B per token).
    ``p``: how P enters the PV GEMM — "e4m3" (P' = P·σ_v, e4m3 with one scale per row and
    ``p_block`` keys: the kernel), "e5m2" (the same in e5m2), "e4m3_unit" (P ∈ [0, 1]
    converted as is, FlashMLA dense), "bf16" (P' in bf16), "none" (fp32).
    ``q_quant`` / ``k_quant`` / ``rope_bf16``: SnapMLA's per-token steps one by one (off: the
    value divided by its scale kept in fp32 instead of rounded to e4m3 / bf16). ``q_split``:
    the query's content as hi + lo e4m3 codes (the lo chain continues QK's accumulator).
    """

    name: str
    kv: str
    rope_aware: bool = True  # False: RoPE quantized to e4m3 with the content (Config A)
    block: int = 64  # token and channel extent of a Config-D block
    q_quant: bool = True
    k_quant: bool = True
    rope_bf16: bool = True
    p: str = "e4m3"
    p_block: int = BLOCK_N
    q_split: bool = False  # Q content as two e4m3 terms on one scale: hi, then lo = e4m3(q/σ - hi)


SNAPMLA = QuantConfig("SnapMLA", "per_token")
CONFIG_A = QuantConfig("A: RoPE-unaware per-token", "per_token", rope_aware=False)
CONFIG_B = QuantConfig("B: per-tensor static (1.0)", "per_tensor_static")
CONFIG_C = QuantConfig("C: per-tensor dynamic", "per_tensor_dynamic")
CONFIG_D = QuantConfig("D: per-block 64x64", "per_block")
# What Hopper users run today (emulated with fp32 GEMMs): FlashMLA's dense FP8 decode
# (per-tensor e4m3 Q and KV over all 576 dims, P converted to e4m3 unscaled) and FlashMLA's
# sparse V3.2 cache format (tile scales, BF16 after dequantization).
FLASHMLA_FP8 = QuantConfig("FlashMLA dense FP8 (per-tensor, RoPE e4m3)", "per_tensor_all", p="e4m3_unit")
V32_TILE128 = QuantConfig("V3.2 tile-128 pow2 scales, BF16 math", "tile128", q_quant=False, p="bf16")
BF16_KV = QuantConfig("BF16 KV cache (FlashMLA BF16)", "bf16", q_quant=False, p="bf16")
# the accurate mode's query (``q_precision="e4m3x2"``): content as hi + lo e4m3 on one scale
SNAPMLA_X2 = QuantConfig("SnapMLA, Q e4m3x2 (hi + lo)", "per_token", q_split=True)
CONFIGS = {
    "snapmla": SNAPMLA, "snapmla_x2": SNAPMLA_X2, "A": CONFIG_A, "B": CONFIG_B, "C": CONFIG_C, "D": CONFIG_D,
    "flashmla_fp8": FLASHMLA_FP8, "v32": V32_TILE128, "bf16": BF16_KV,
}


@dataclass
class QuantizedK:
    """One request's K/V in the form the decode consumes.

    ``qk_codes``: values entering the QK GEMM (e4m3 content codes and RoPE in the scaled
    domain) ``[L, 576]``; ``qk_scale``: per-token factor applied to the QK accumulator ``[L]``;
    ``v_values``: values entering the PV GEMM ``[L, 512]``; ``v_scale``: per-token factor fused
    into P (P' = P·σ_v) ``[L]``.
    """

    qk_codes: torch.Tensor
    qk_scale: torch.Tensor
    v_values: torch.Tensor
    v_scale: torch.Tensor


def quantize_q_codes(q: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[..., 576]`` → (codes ``[..., 576]`` as fp32 values, scale ``[...]``)."""
    if cfg.kv in ("tile128", "bf16") or (cfg.kv == "per_tensor_all" and not cfg.q_quant):
        return q.float(), torch.ones(q.shape[:-1], dtype=torch.float32, device=q.device)
    if cfg.kv == "per_tensor_all":  # one dynamic scale for all of Q, RoPE included
        s = torch.full(q.shape[:-1], max(float(q.float().abs().max()), AMAX_FLOOR) / FP8_MAX, device=q.device)
        return to_e4m3(q.float() / s[..., None]).float(), s
    if cfg.rope_aware:
        if not cfg.q_quant:
            s = row_scale(q[..., :CONTENT_DIM])
            return q.float() * (1.0 / s).unsqueeze(-1), s
        c, r, s = quantize_rows(q)
        codes = torch.cat([c.float(), r.float()], dim=-1)
        if cfg.q_split:  # [..., 576 + 512]: hi, RoPE, then the residual's codes
            lo = to_e4m3(q[..., :CONTENT_DIM].float() * (1.0 / s).unsqueeze(-1) - c.float()).float()
            codes = torch.cat([codes, lo], dim=-1)
        return codes, s
    s = row_scale(q)  # Config A: one e4m3 scale over all 576 dims
    return to_e4m3(q.float() * (1.0 / s).unsqueeze(-1)).float(), s


def _quantize_k(k: torch.Tensor, cfg: QuantConfig, tensor_amax: float | None) -> QuantizedK:
    """Unquantized K ``[L, 576]`` of one request → ``QuantizedK`` under ``cfg``."""
    kf = k.float()
    L = kf.shape[0]
    ones = torch.ones(L, dtype=torch.float32, device=k.device)
    if cfg.kv == "per_token" and cfg.rope_aware:
        c, r, s = quantize_rows(kf)
        if not (cfg.k_quant and cfg.rope_bf16):  # the budget's switches: unrounded codes
            inv = (1.0 / s).unsqueeze(-1)
            c = c if cfg.k_quant else kf[:, :CONTENT_DIM] * inv
            r = r if cfg.rope_bf16 else kf[:, CONTENT_DIM:] * inv
        return QuantizedK(torch.cat([c.float(), r.float()], -1), s, c.float(), s)
    if cfg.kv == "per_tensor_all":
        s = torch.tensor(max(tensor_amax, AMAX_FLOOR), dtype=torch.float32) / FP8_MAX
        codes = to_e4m3(kf / s).float()
        sv = torch.ones(L, dtype=torch.float32, device=k.device) * s
        return QuantizedK(codes, sv, codes[:, :CONTENT_DIM], sv)
    if cfg.kv == "bf16":
        kb = kf.to(torch.bfloat16).float()
        return QuantizedK(kb, ones, kb[:, :CONTENT_DIM], ones)
    if cfg.kv == "tile128":
        # 128-channel tiles, scale 2^ceil(log2(amax/448)); code·scale is exact in bf16
        codes, sc = pow2_tile_codes(kf[:, :CONTENT_DIM])
        deq = (codes.float() * sc).view(L, CONTENT_DIM)
        ones = torch.ones(L, dtype=torch.float32, device=k.device)
        return QuantizedK(torch.cat([deq, kf[:, CONTENT_DIM:].to(torch.bfloat16).float()], -1), ones, deq, ones)
    if cfg.kv == "per_token":  # Config A
        s = row_scale(kf)
        codes = to_e4m3(kf * (1.0 / s).unsqueeze(-1)).float()
        return QuantizedK(codes, s, codes[:, :CONTENT_DIM], s)
    rope = kf[:, CONTENT_DIM:].to(torch.bfloat16).float()
    if cfg.kv in ("per_tensor_static", "per_tensor_dynamic"):
        if cfg.kv == "per_tensor_static":
            s = torch.tensor(1.0)
        else:
            s = torch.tensor(max(tensor_amax, AMAX_FLOOR), dtype=torch.float32) / FP8_MAX
        codes = to_e4m3(kf[:, :CONTENT_DIM] * (1.0 / s)).float()
        # RoPE kept high precision; pre-divided by the (shared) scale as in Eq. 6
        rope_codes = (rope / s).to(torch.bfloat16).float()
        sv = ones * s
        return QuantizedK(torch.cat([codes, rope_codes], -1), sv, codes, sv)
    if cfg.kv == "per_block":
        # Content in (block tokens x block channels) tiles, each with its own scale. The scale
        # varies along channels, so it cannot fold into the per-token QK/PV factors: QK uses
        # the dequantized content, PV post-scales each 64-channel slice (exact per P block).
        B = cfg.block
        Lp = (L + B - 1) // B * B
        c = torch.zeros(Lp, CONTENT_DIM, dtype=torch.float32, device=k.device)
        c[:L] = kf[:, :CONTENT_DIM]
        tiles = c.view(Lp // B, B, CONTENT_DIM // B, B)
        s = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
        deq = (to_e4m3(tiles * (1.0 / s)).float() * s).view(Lp, CONTENT_DIM)[:L]
        return QuantizedK(torch.cat([deq, rope], -1), ones, deq, ones)
    raise ValueError(f"unknown KV quantization {cfg.kv!r}")


# --------------------------------------------------------------------------------------------
# Emulated SnapMLA decode (App. B, App. C Algorithm 1)
# --------------------------------------------------------------------------------------------


def _qk(q_codes: torch.Tensor, kq: QuantizedK, mma: str) -> torch.Tensor:
    """The QK accumulator ``[R, L]``: with ``mma="hopper"`` 16 e4m3 instructions (for a split
    query's lo codes, ``q_codes [R, 576 + 512]``, each k-step's hi then lo: 32) and 4 bf16
    RoPE ones on one accumulator, as the kernel issues them; fp32 matmuls otherwise."""
    k_content, k_rope = kq.qk_codes[:, :CONTENT_DIM], kq.qk_codes[:, CONTENT_DIM:]
    hi, rope, lo = q_codes[:, :CONTENT_DIM], q_codes[:, CONTENT_DIM:HEAD_DIM], q_codes[:, HEAD_DIM:]
    if mma != "hopper":
        if lo.shape[1]:  # hi + lo is exact in fp32
            return torch.cat([hi + lo, rope], dim=-1) @ kq.qk_codes.T
        return q_codes @ kq.qk_codes.T
    if lo.shape[1]:
        # the kernel issues each 32-wide k-step's hi and lo instructions back to back (one K
        # descriptor for both: the longer chain then fits the consumers' registers)
        acc = None
        for k0 in range(0, CONTENT_DIM, 32):
            ks = slice(k0, k0 + 32)
            acc = tensor_core_mma(hi[:, ks], k_content[:, ks], acc)
            acc = tensor_core_mma(lo[:, ks], k_content[:, ks], acc)
    else:
        acc = tensor_core_mma(hi, k_content)
    return tensor_core_mma(rope, k_rope, acc, kind="bf16")


def _scores(q_codes, q_scale, kq: QuantizedK, vis, softmax_scale: float, mma: str, key_mask=None):
    """QK (FP8 content and BF16 RoPE into one fp32 accumulator, Eq. 6) as the kernel scales
    it: ``t = acc·σ_k`` with keys past ``vis`` at -inf, and ``q_fac = σ_q·scale·log2e``. The
    kernel takes a block's max of s = t·q_fac as q_fac·max(t) (equal: rounding is monotone)
    and 2^(s - m) as one fma of t. ``key_mask [L]`` (sparse): False keys at -inf too.
    Returns ``(t [R, L], q_fac [R])``."""
    L, dev = kq.qk_codes.shape[0], q_codes.device
    acc = _qk(q_codes, kq, mma)
    q_fac = q_scale * torch.tensor(softmax_scale * LOG2E, dtype=torch.float32)
    t2 = acc * kq.qk_scale[None, :]
    col = torch.arange(L, device=dev)
    keep = col[None, :] < vis[:, None]
    if key_mask is not None:
        keep = keep & key_mask[None, :]
    return torch.where(keep, t2, torch.tensor(-math.inf, device=dev)), q_fac


def decode_one(
    q_codes: torch.Tensor,
    q_scale: torch.Tensor,
    kq: QuantizedK,
    vis: torch.Tensor,
    softmax_scale: float,
    mma: str = "exact",
    p: str = "e4m3",
    p_block: int = BLOCK_N,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 for R query rows against one request's L keys, all in fp32.

    ``q_codes [R, 576]``, ``q_scale [R]``, ``vis [R]`` keys visible per row. Returns
    ``out [R, 512]`` (fp32) and natural-log ``lse [R]``. ``mma="hopper"`` runs both GEMMs
    through ``tensor_core_mma`` in the kernel's instruction order; ``"exact"`` in fp32.
    ``key_mask [L]``: keys that count (the sparse decode's list entries; the others are
    zero rows with σ_k 0 and score -inf, as the kernel loads them).
    """
    if (p, p_block) != ("e4m3", BLOCK_N):
        if key_mask is not None:
            raise ValueError("key_mask: only with the shipped P format")
        return _decode_one_p_variant(q_codes, q_scale, kq, vis, softmax_scale, mma, p, p_block)
    R, L = q_codes.shape[0], kq.qk_codes.shape[0]
    dev = q_codes.device
    hopper = mma == "hopper"
    t2, q_fac = _scores(q_codes, q_scale, kq, vis, softmax_scale, mma, key_mask)

    m = torch.full((R,), -math.inf, dtype=torch.float32, device=dev)  # running max (log2)
    ell = torch.zeros(R, dtype=torch.float32, device=dev)  # Σ P, in units of 1/σ_p
    o = torch.zeros(R, CONTENT_DIM, dtype=torch.float32, device=dev)  # Σ P_q·V, units of 1/σ_p
    sigma_p = torch.ones(R, dtype=torch.float32, device=dev)
    for j0 in range(0, L, BLOCK_N):
        blk = slice(j0, min(L, j0 + BLOCK_N))
        t_blk = t2[:, blk]
        m_new = torch.maximum(m, t_blk.amax(dim=-1) * q_fac)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        # Alg. 1 line 5 (masked → 0); fma: the product is exact in float64, one rounding
        p = torch.exp2((t_blk.double() * q_fac.double()[:, None] - m_safe.double()[:, None]).float())
        ell_cur = p.sum(dim=-1)
        p_fused = p * kq.v_scale[None, blk]  # line 6: P' = P·σ_k (V-scale fusion)
        p_max = p_fused.amax(dim=-1)
        # line 7: σ_p = rowmax(P')/448; a row with nothing visible keeps its σ_p, and so
        # does one whose P' is negligible (< P_TINY: 448/P'max would overflow, then γ)
        has = p_max > P_TINY
        p_max_safe = torch.where(has, p_max, torch.ones_like(p_max))
        inv_p = torch.where(has, torch.full_like(p_max, FP8_MAX) / p_max_safe, 1.0 / sigma_p)
        # σ_p = P'max · fp32(1/448): the kernel's multiply (not a division)
        sigma_cur = torch.where(has, p_max * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32), sigma_p)
        p_q = to_e4m3(p_fused * inv_p[:, None]).float()
        ell_cur = ell_cur * inv_p  # line 8: ℓ_cur / σ_p_cur
        gamma = torch.exp2(m - m_safe) * sigma_p * inv_p  # line 9: exp(m - m_new)·σ_p/σ_p_cur
        gamma = torch.where(torch.isinf(m), torch.zeros_like(gamma), gamma)
        if hopper:  # this block's P·V from a zeroed accumulator, then o = γ·o + PV as one fma
            pv = tensor_core_mma(p_q, kq.v_values[blk].T)
            o = (o.double() * gamma.double()[:, None] + pv.double()).float()
        else:
            o = gamma[:, None] * o + p_q @ kq.v_values[blk]  # lines 10, 15: implicit dequant
        ell = gamma * ell + ell_cur
        m, sigma_p = m_new, sigma_cur
    empty = ell == 0
    ell_safe = torch.where(empty, torch.ones_like(ell), ell)
    # o·fp32(1/ℓ), the epilogue's order (one reciprocal per row, then a multiply): o/ℓ is an
    # fp32 ulp away for some ℓ, which flips the bf16 rounding of outputs near a midpoint (a
    # one-token request's code·σ_k: a fifth of its outputs in one test draw)
    out = torch.where(empty[:, None], torch.zeros_like(o), o * (1.0 / ell_safe)[:, None])
    lse2 = m + torch.log2(sigma_p * ell_safe)  # line 14: L = m + log(σ_p ℓ)
    lse = torch.where(empty, torch.tensor(-math.inf, device=dev), lse2 / LOG2E)
    return out, lse


_P_FORMATS = {"e4m3": (torch.float8_e4m3fn, FP8_MAX), "e5m2": (torch.float8_e5m2, 57344.0)}


def _decode_one_p_variant(q_codes, q_scale, kq, vis, softmax_scale, mma, p, p_block):
    """``decode_one`` with another P format or P'-block length (``QuantConfig.p``,
    ``p_block``): the same QK, scores and online softmax per 64-key block, o and ℓ kept in
    true units (fp32), each block's P·V from its quantized P in true units."""
    R, L = q_codes.shape[0], kq.qk_codes.shape[0]
    dev = q_codes.device
    t2, q_fac = _scores(q_codes, q_scale, kq, vis, softmax_scale, mma)
    m = torch.full((R,), -math.inf, dtype=torch.float32, device=dev)
    ell = torch.zeros(R, dtype=torch.float32, device=dev)
    o = torch.zeros(R, CONTENT_DIM, dtype=torch.float32, device=dev)
    for j0 in range(0, L, BLOCK_N):
        blk = slice(j0, min(L, j0 + BLOCK_N))
        t_blk = t2[:, blk]
        m_new = torch.maximum(m, t_blk.amax(dim=-1) * q_fac)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        pr = torch.exp2((t_blk.double() * q_fac.double()[:, None] - m_safe.double()[:, None]).float())
        v = kq.v_values[blk]
        if p == "e4m3_unit":  # P in [0, 1] straight to e4m3; the (per-tensor) V scale after
            w = to_e4m3(pr).float() * kq.v_scale[None, blk]
        else:
            w = pr * kq.v_scale[None, blk]  # P' = P·σ_v
            if p == "bf16":
                w = w.to(torch.bfloat16).float()
            elif p in _P_FORMATS:
                dtype, fmax = _P_FORMATS[p]
                parts = []
                for s0 in range(0, w.shape[1], p_block):
                    ws = w[:, s0 : s0 + p_block]
                    mx = ws.amax(dim=-1, keepdim=True)
                    mx = torch.where(mx > P_TINY, mx, torch.ones_like(mx))
                    parts.append((ws * (fmax / mx)).clamp(-fmax, fmax).to(dtype).float() * (mx / fmax))
                w = torch.cat(parts, dim=-1)
            elif p != "none":
                raise ValueError(f"unknown P format {p!r}")
        pv = tensor_core_mma(w, v.T) if mma == "hopper" else w @ v
        gamma = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp2(m - m_safe))
        o = gamma[:, None] * o + pv
        ell = gamma * ell + pr.sum(dim=-1)
        m = m_new
    empty = ell == 0
    out = torch.where(empty[:, None], torch.zeros_like(o), o / torch.where(empty, 1.0, ell)[:, None])
    lse = torch.where(empty, torch.tensor(-math.inf, device=dev), (m + torch.log2(torch.where(empty, 1.0, ell))) / LOG2E)
    return out, lse


def mla_decode_emulated(
    q: torch.Tensor,
    cache,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    config: QuantConfig | str = SNAPMLA,
    mma: str | None = None,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-faithful emulation of SnapMLA's FP8 decode (fp32 math, e4m3 rounding as the GPU).

    ``mma``: ``"hopper"`` (default for SnapMLA's format, whatever its ``p``) runs QK and PV through
    ``tensor_core_mma``, the fitted model of WGMMA's truncating adder, in the decode
    kernel's instruction order (e4m3 content chain, then the bf16 RoPE chain on the same
    accumulator; each block's P·V from a zeroed accumulator added in fp32) — the kernel then
    matches to a few ulps except where ex2.approx flips an e4m3 rounding of P. ``"exact"``
    (default for the other configs: the accuracy study compares quantization schemes) uses
    fp32 matmuls.

    ``cache`` is either the FP8 cache ``(kv uint8 [P, ps, 640], kv_scale fp32 [P, ps])`` (only
    with SnapMLA's format — exactly what the kernel reads) or unquantized pages
    ``[P, ps, 576]``, quantized here under ``config``. ``q`` is bf16/fp32 ``[b, s_q, h, 576]``.
    ``visible`` ``[b, s_q]``: ``mla_decode``'s causal limits (clamped as the kernel does).
    Returns fp32 ``out [b, s_q, h, 512]`` and ``lse [b, h, s_q]``.
    """
    cfg = CONFIGS[config] if isinstance(config, str) else config
    vis_rows = None if visible is None else visible.tolist()
    scale = default_softmax_scale() if softmax_scale is None else softmax_scale
    kernel_format = cfg.kv == "per_token" and cfg.rope_aware and cfg.q_quant and cfg.k_quant and cfg.rope_bf16
    mma = mma or ("hopper" if kernel_format else "exact")
    if mma not in ("hopper", "exact") or (mma == "hopper" and (cfg.kv != "per_token" or not cfg.rope_aware)):
        raise ValueError(f"mma: expected 'exact', or 'hopper' with a RoPE-aware per-token config; got {mma!r} with {cfg}")
    b, s_q, h, _ = q.shape
    dev = q.device
    out = torch.zeros(b, s_q, h, CONTENT_DIM, dtype=torch.float32, device=dev)
    lse = torch.full((b, h, s_q), -math.inf, dtype=torch.float32, device=dev)
    fp8_cache = isinstance(cache, (tuple, list))
    if fp8_cache and not kernel_format:
        raise ValueError(f"an FP8 cache holds SnapMLA's format; pass unquantized pages for {cfg.name}")
    lens = [int(x) for x in cache_seqlens.tolist()]
    tensor_amax = None
    if not fp8_cache and cfg.kv in ("per_tensor_dynamic", "per_tensor_all"):
        dims = HEAD_DIM if cfg.kv == "per_tensor_all" else CONTENT_DIM
        tensor_amax = max(
            (float(gather_pages(cache, block_table, bi, L)[:, :dims].float().abs().max()) for bi, L in enumerate(lens) if L),
            default=0.0,
        )
    q_codes, q_scale = quantize_q_codes(q, cfg)
    for bi, L in enumerate(lens):
        if L == 0:
            continue
        if fp8_cache:
            kv, kv_scale = cache
            content, rope = unpack_kv_rows(gather_pages(kv, block_table, bi, L).to(dev))
            s_k = gather_pages(kv_scale, block_table, bi, L).to(dev).float()
            kq = QuantizedK(torch.cat([content.float(), rope.float()], -1), s_k, content.float(), s_k)
        else:
            kq = _quantize_k(gather_pages(cache, block_table, bi, L).to(dev), cfg, tensor_amax)
        vis_b = None if vis_rows is None else vis_rows[bi]
        vis = torch.tensor(visible_lengths(L, s_q, causal, vis_b), device=dev).repeat_interleave(h)
        o, l_ = decode_one(
            q_codes[bi].reshape(s_q * h, -1), q_scale[bi].reshape(s_q * h), kq, vis, scale, mma,
            cfg.p, cfg.p_block,
        )
        out[bi] = o.view(s_q, h, CONTENT_DIM)
        lse[bi] = l_.view(s_q, h).T
    return out, lse
