"""Accuracy study (paper §4.3, Table 2): SnapMLA vs Configs A–D and the FP8 formats Hopper
users run today, against float64 exact attention, plus an error budget per quantization step.

Runs on the CPU through ``emulation.mla_decode_emulated``. Four data sets (``make_inputs``):

* ``flashmla``: FlashMLA's test data — K = randn/10 clamped to ±1, q = randn.
* ``paper``: shaped after §3.1.1 / Fig. 3 — content concentrated around zero (std 0.1
  with a log-normal per-token spread, rare sink-like tokens 30x larger, clamped to ±10); RoPE heavy-tailed (Student-t) with six
  outlier channels of magnitude 1e2–1e3 and its own per-token spread; queries weighted so
  content and RoPE terms contribute comparably, scaled to a logit standard deviation of 1.5.
* ``realistic``: a DeepSeek-style MLA cache (``_realistic_keys``): the latent c_KV is
  RMS-normalized per token and multiplied by a per-channel gain with outlier channels; the
  RoPE key is an un-normalized projection with heavy-tailed, channel-dependent magnitudes
  (largest in the low-frequency pairs) rotated by its position; queries come from other
  projections, rotated at the decode position, scaled to a logit std of 2 per head.
* ``stress``: the realistic structure with a wide per-token content scale (log-normal,
  σ_ln = 2: 10³–10⁴ between the largest and smallest token of a 64-token block) and sink
  tokens (1 in 64) 30x larger — the case where per-token scales vary most inside a P′ block.

Generated values are bf16 (what a model writes); the exact reference sees the same values.
"""

from __future__ import annotations

import math

import torch

from snapmla_cute import emulation
from snapmla_cute import reference as ref
from snapmla_cute.format import Q_PRECISIONS

CONFIG_ORDER = ("snapmla", "A", "B", "C", "D", "flashmla_fp8", "v32", "bf16")
DISTS = ("flashmla", "paper", "realistic", "stress")
# the emulation config of SnapMLA's row in the formats table per query precision (``--q-precision``)
Q_PRECISION_CONFIGS = dict(zip(Q_PRECISIONS, ("snapmla", "snapmla_x2"), strict=True))
ROTATIONS = ("off", "on", "both")


def _student_t(shape, dof: int, gen: torch.Generator) -> torch.Tensor:
    chi2 = torch.randn(dof, *shape, generator=gen).pow(2).sum(0)
    return torch.randn(*shape, generator=gen) / (chi2 / dof).sqrt()


def _rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """RoPE on the last 64 dims of ``x`` [..., 64] at positions ``pos`` [...] (pairs (2i, 2i+1),
    θ_i = 10000^(-2i/64), as DeepSeek's rotary embedding before YaRN scaling)."""
    theta = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = pos.double()[..., None] * theta
    c, s = ang.cos().float(), ang.sin().float()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


def _realistic_keys(b: int, L: int, gen: torch.Generator, token_spread: float = 0.0, sinks: float = 0.0):
    """K ``[b, L, 576]``, the per-channel RoPE magnitudes ``[64]`` and content gain ``[512]``.

    * Content: c_KV = RMSNorm(x)·g (DeepSeek-V2/V3's ``kv_a_layernorm`` on the compressed
      latent): x is Student-t (ν = 5, mildly heavy-tailed activations), every token has unit
      RMS before the gain; g is log-normal around 0.5 (σ_ln = 0.4) with 1% outlier channels
      at 8–16x — a shape assumption (learned norm gains are O(1) with a few large channels),
      not measured weights.
    * RoPE: k_R = W_KR·h is not normalized; channel magnitudes are log-normal with the four
      lowest-frequency pairs 10–30x larger (massive values concentrate in low-frequency RoPE
      dims), Student-t (ν = 4) per element, rotated at the token's position.
    * ``token_spread`` / ``sinks`` (stress): a log-normal per-token factor on the content with
      σ_ln = ``token_spread``, and that fraction of tokens 30x larger.
    """
    x = _student_t((b, L, 512), 5, gen)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    g = 0.5 * torch.exp(0.4 * torch.randn(512, generator=gen))
    out_ch = torch.randperm(512, generator=gen)[:5]
    g[out_ch] *= 8 + 8 * torch.rand(5, generator=gen)
    content = x * g
    if token_spread:
        content = content * torch.exp(token_spread * torch.randn(b, L, 1, generator=gen))
    if sinks:
        content = content * torch.where(torch.rand(b, L, 1, generator=gen) < sinks, 30.0, 1.0)
    ch = torch.exp(0.5 * torch.randn(32, generator=gen)).repeat_interleave(2)
    ch[-8:] *= 10 + 20 * torch.rand(8, generator=gen)  # the lowest-frequency pairs (θ_i smallest)
    rope = _rotate(ch * _student_t((b, L, 64), 4, gen) / 2, torch.arange(L).expand(b, L))
    return torch.cat([content, rope], dim=-1), ch, g


def _realistic_queries(k: torch.Tensor, ch: torch.Tensor, s_q: int, h: int, gen: torch.Generator, logit_std: float):
    """Queries for ``_realistic_keys``: content from another projection (Gaussian with its own
    log-normal channel gain), RoPE with the keys' channel profile, rotated at the decode
    positions L - s_q + i; each (request, token, head) scaled so its logits over the request's
    keys have standard deviation ``logit_std`` (natural units, after the softmax scale)."""
    b, L, _ = k.shape
    qc = torch.randn(b, s_q, h, 512, generator=gen) * torch.exp(0.4 * torch.randn(512, generator=gen))
    qr = ch * torch.randn(b, s_q, h, 64, generator=gen)
    qr = _rotate(qr, (L - s_q + torch.arange(s_q)).view(1, s_q, 1).expand(b, s_q, h))
    # content and RoPE terms of comparable size: each normalized by its own logit std first
    kb = k.to(torch.bfloat16).double()

    def std_of(qpart, kpart):
        return torch.einsum("bshd,bld->bshl", qpart.double(), kpart).std(-1, keepdim=True)

    qc = qc / std_of(qc, kb[..., :512]).float()
    qr = qr / std_of(qr, kb[..., 512:]).float()
    q = torch.cat([qc, qr], dim=-1)
    # the std, or a quarter of the widest logit's distance from the mean where tokens of very
    # different magnitude (stress) would otherwise give one key a logit in the hundreds
    s = torch.einsum("bshd,bld->bshl", q.double(), kb) * ref.default_softmax_scale()
    spread = torch.maximum(s.std(-1, keepdim=True), (s - s.mean(-1, keepdim=True)).abs().amax(-1, keepdim=True) / 4)
    return q * (logit_std / spread).float()


def hadamard_rotation(n: int, gen: torch.Generator) -> torch.Tensor:
    """An orthogonal ``[n, n]`` float64 matrix H·D: the normalized Walsh–Hadamard matrix (n a
    power of two) times random signs, drawn from ``gen``. Rotating Q's and K's content by it
    leaves every logit as it was (q R · k R = q · k); O comes out rotated (P·V R), so a model
    folds R into its query and latent projections and Rᵀ into the output's."""
    if n & (n - 1):
        raise ValueError(f"hadamard_rotation: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return h / math.sqrt(n) * signs


def _rotate_content(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x ``[..., 576]`` bf16 with its 512 content dims rotated by ``r``, back in bf16 (what a
    model with R folded into its weights would write)."""
    c = (x[..., :512].double() @ r).to(x.dtype)
    return torch.cat([c, x[..., 512:]], dim=-1)


def make_inputs(dist: str, b: int, s_q: int, h: int, L: int, page_size: int, gen: torch.Generator):
    """q bf16 ``[b,s_q,h,576]``, K pages bf16 ``[P,ps,576]``, shuffled block table, lengths."""
    n_pages_per = (L + page_size - 1) // page_size
    P = b * n_pages_per
    n = P * page_size
    if dist == "flashmla":
        k = (torch.randn(n, 576, generator=gen) / 10).clamp(-1, 1)
        q = torch.randn(b, s_q, h, 576, generator=gen)
    elif dist == "paper":
        # content: tightly around zero with a wide per-token spread; rare sink-like tokens
        # reach the ±10 edge. Attention is steered mostly by RoPE (position), as in MLA.
        tok_c = 0.02 * torch.exp(1.0 * torch.randn(n, 1, generator=gen))
        sink = torch.rand(n, 1, generator=gen) < 1 / 256
        tok_c = torch.where(sink, torch.full_like(tok_c, 3.0), tok_c)
        k_c = (tok_c * torch.randn(n, 512, generator=gen)).clamp(-10, 10)
        ch = torch.exp(0.7 * torch.randn(64, generator=gen))  # RoPE channel magnitudes
        ch[torch.randperm(64, generator=gen)[:6]] = torch.logspace(2, 3, 6)  # outliers to 1e3
        tok_r = torch.exp(0.5 * torch.randn(n, 1, generator=gen))
        # Student-t with 3 degrees of freedom, drawn from `gen` so a seed reproduces the table
        chi2 = torch.randn(3, n, 64, generator=gen).pow(2).sum(0)
        heavy = (torch.randn(n, 64, generator=gen) / (chi2 / 3).sqrt()).clamp(-20, 20)
        k_r = ch * tok_r * heavy / 3
        k = torch.cat([k_c, k_r], dim=-1)
        # sink tokens get content logits of a few units, typical tokens far less
        q_c = torch.randn(b, s_q, h, 512, generator=gen) / (3.0 * math.sqrt(512))
        q_r = torch.randn(b, s_q, h, 64, generator=gen) / (ch * math.sqrt(64))
        q_r = q_r * 1.5 / ref.default_softmax_scale()
        q = torch.cat([q_c / ref.default_softmax_scale() * 2.0, q_r], dim=-1)
    elif dist in ("realistic", "stress"):
        spread, sinks = (2.0, 1 / 64) if dist == "stress" else (0.0, 0.0)
        kr, ch, _ = _realistic_keys(b, n_pages_per * page_size, gen, spread, sinks)
        q = _realistic_queries(kr[:, :L], ch, s_q, h, gen, logit_std=2.0)
        # positions matter here: page block_table[i, j] holds tokens j·ps… of request i
        block_table = torch.randperm(P, generator=gen).view(b, n_pages_per).int()
        k_pages = torch.empty(P, page_size, 576, dtype=torch.bfloat16)
        k_pages[block_table.flatten().long()] = kr.view(P, page_size, 576).to(torch.bfloat16)
        return q.to(torch.bfloat16), k_pages, block_table, torch.full((b,), L, dtype=torch.int32)
    else:
        raise ValueError(f"unknown data set {dist!r}; expected one of {DISTS}")
    k_pages = k.to(torch.bfloat16).view(P, page_size, 576)
    block_table = torch.randperm(P, generator=gen).view(b, n_pages_per).int()
    lens = torch.full((b,), L, dtype=torch.int32)
    return q.to(torch.bfloat16), k_pages, block_table, lens


def _steps(name: str, mma: str = "exact", **on) -> tuple[str, emulation.QuantConfig, str]:
    """A budget row: SnapMLA's format with only the steps in ``on`` switched on."""
    off = dict(q_quant=False, k_quant=False, rope_bf16=False, p="none")
    return name, emulation.QuantConfig(name, "per_token", **{**off, **on}), mma


# Each quantization step of SnapMLA alone (the others exact, fp32 GEMMs), then all of them.
BUDGET = (
    ("SnapMLA (every step)", emulation.SNAPMLA, "hopper"),
    _steps("K content e4m3 (per token)", k_quant=True),
    _steps("Q e4m3 (per token, head)", q_quant=True),
    _steps("RoPE in bf16 (÷ σ)", rope_bf16=True),
    _steps("P' e4m3 (V-fused, 64-key blocks)", p="e4m3"),
    _steps("tensor-core adder (QK, PV)", mma="hopper"),
    # what removing the largest step on MLA-like data would buy: Q kept in fp32, or Q's
    # content as two e4m3 terms (hi + lo, one scale; a second QK content chain in a kernel)
    ("SnapMLA with Q unquantized", emulation.QuantConfig("SnapMLA, Q fp32", "per_token", q_quant=False), "hopper"),
    ("SnapMLA with Q as hi + lo e4m3", emulation.SNAPMLA_X2, "hopper"),
)
_SINGLE_STEPS = slice(1, 6)
# SnapMLA with another P quantization (everything else as the kernel).
P_VARIANTS = (
    ("SnapMLA", emulation.SNAPMLA, "hopper"),
    ("P' unquantized (fp32)", emulation.QuantConfig("P' fp32", "per_token", p="none"), "hopper"),
    ("P' e4m3, 32-key blocks", emulation.QuantConfig("P' 32", "per_token", p_block=32), "hopper"),
    ("P' e4m3, 16-key blocks", emulation.QuantConfig("P' 16", "per_token", p_block=16), "hopper"),
    ("P' e5m2", emulation.QuantConfig("P' e5m2", "per_token", p="e5m2"), "hopper"),
    ("P' bf16 (BF16 PV)", emulation.QuantConfig("P' bf16", "per_token", p="bf16"), "hopper"),
)
FORMATS = tuple((emulation.CONFIGS[n].name, emulation.CONFIGS[n], None) for n in CONFIG_ORDER)
TABLES = {"formats": FORMATS, "budget": BUDGET, "p": P_VARIANTS}


def accuracy_study(
    lengths=(1024, 4096, 16384),
    dists=("flashmla", "paper"),
    batch: int = 2,
    heads: int = 16,
    s_q: int = 1,
    page_size: int = 64,
    seeds=(0, 1, 2, 3),
    device: str = "cpu",
    table: str = "formats",
    q_precisions=("e4m3",),
    rotate: str = "off",
) -> list[dict]:
    """One row per (data set, length, config of ``TABLES[table]``): rel-L2, cos diff and RMSE
    are means over ``seeds`` (each seed a fresh draw of q and K), the LSE error the max.

    ``table``: "formats" (SnapMLA, Configs A–D, FlashMLA's dense FP8, V3.2 and BF16 formats),
    "budget" (each quantization step alone; the largest is marked ``dominant``) or "p"
    (P quantization variants of SnapMLA). ``q_precisions`` (formats table): SnapMLA's row
    once per query precision of ``format.Q_PRECISIONS`` ("e4m3x2": the accurate mode's hi + lo).
    ``rotate``: "on" runs every row on Q and K whose 512 content dims are rotated by
    ``hadamard_rotation`` (a fresh one per seed; the output rotated back), "both" runs each
    row without and with it; a rotated row's label says so."""
    spec = _spec(table, q_precisions)
    if rotate not in ROTATIONS:
        raise ValueError(f"rotate: expected one of {ROTATIONS}, got {rotate!r}")
    passes = {"off": (False,), "on": (True,), "both": (False, True)}[rotate]
    rows = []
    for dist in dists:
        for L in lengths:
            per_cfg = {(label, rot): [] for rot in passes for label, _, _ in spec}
            for seed in seeds:
                gen = torch.Generator().manual_seed(1_000_003 * seed + L)
                q, k_pages, bt, lens = make_inputs(dist, batch, s_q, heads, L, page_size, gen)
                q, k_pages = q.to(device), k_pages.to(device)
                r = hadamard_rotation(512, gen).to(device) if True in passes else None
                for rot in passes:
                    qi, ki = (_rotate_content(q, r), _rotate_content(k_pages, r)) if rot else (q, k_pages)
                    # the reference sees the values the model wrote (rotated ones in bf16),
                    # so each row measures its quantization, not the rotation's bf16 rounding
                    out_x, lse_x = ref.mla_decode_exact(qi, ki, bt, lens)
                    if rot:
                        out_x = (out_x.double() @ r.T).to(out_x.dtype)
                    fp8_cache = ref.quantize_kv_cache(ki)
                    for label, cfg, mma in spec:
                        # SnapMLA reads the FP8 cache, exactly as the kernel; the others quantize here
                        cache = fp8_cache if cfg == emulation.SNAPMLA else ki
                        out, lse = emulation.mla_decode_emulated(qi, cache, bt, lens, config=cfg, mma=mma)
                        if rot:
                            out = (out.double() @ r.T).float()
                        per_cfg[(label, rot)].append(
                            (ref.rel_l2(out, out_x), ref.cos_diff(out, out_x), ref.rmse(out, out_x),
                             ref.lse_max_abs(lse, lse_x))
                        )
            for rot in passes:
                block = []
                for label, _, _ in spec:
                    vals = per_cfg[(label, rot)]
                    mean = [sum(v[i] for v in vals) / len(vals) for i in range(3)]
                    block.append(
                        dict(dist=dist, L=L, config=label + (" (rotated)" if rot else ""),
                             rel_l2=mean[0], cos_diff=mean[1], rmse=mean[2], lse_max_abs=max(v[3] for v in vals),
                             dominant=False, rotated=rot)
                    )
                if table == "budget":
                    max(block[_SINGLE_STEPS], key=lambda x: x["rel_l2"])["dominant"] = True
                rows += block
    return rows


def _spec(table: str, q_precisions) -> tuple:
    """The rows of ``TABLES[table]``, SnapMLA's once per query precision (formats only)."""
    bad = [p for p in q_precisions if p not in Q_PRECISIONS]
    if bad or not q_precisions:
        raise ValueError(f"q_precisions: expected some of {tuple(Q_PRECISIONS)}, got {tuple(q_precisions)!r}")
    if tuple(q_precisions) == ("e4m3",):
        return TABLES[table]
    if table != "formats":
        raise ValueError(f"q_precisions: the {table!r} table runs SnapMLA's e4m3 query only (it has its own hi + lo row)")
    snapmla = [(emulation.CONFIGS[Q_PRECISION_CONFIGS[p]].name, emulation.CONFIGS[Q_PRECISION_CONFIGS[p]], None)
               for p in q_precisions]
    return tuple(snapmla) + tuple(row for row in FORMATS if row[1] != emulation.SNAPMLA)


def print_accuracy(rows, markdown: bool = False):
    from tabulate import tabulate

    table = [
        [r["dist"], r["L"], r["config"] + (" ◀ dominant" if r.get("dominant") else ""),
         f"{r['rel_l2']:.3e}", f"{r['cos_diff']:.3e}", f"{r['rmse']:.3e}", f"{r['lse_max_abs']:.3e}"]
        for r in rows
    ]
    headers = ["data", "L", "config", "rel-L2", "cos diff", "RMSE", "LSE max |Δ|"]
    print(tabulate(table, headers=headers, tablefmt="github" if markdown else "simple"))
