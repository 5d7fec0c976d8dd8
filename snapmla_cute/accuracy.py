"""Accuracy study (paper §4.3, Table 2): SnapMLA vs Configs A–D against float64 exact attention.

Runs on the CPU through ``reference.mla_decode_emulated``. Two synthetic distributions:

* ``flashmla``: FlashMLA's test data — K = randn/10 clamped to ±1, q = randn.
* ``paper``: shaped after §3.1.1 / Fig. 3 — content concentrated around zero (std 0.1
  with a log-normal per-token spread, rare sink-like tokens 30x larger, clamped to ±10); RoPE heavy-tailed (Student-t) with six
  outlier channels of magnitude 1e2–1e3 and its own per-token spread; queries weighted so
  content and RoPE terms contribute comparably, scaled to a logit standard deviation of 1.5.
"""

from __future__ import annotations

import math

import torch

from snapmla_cute import reference as ref

CONFIG_ORDER = ("snapmla", "A", "B", "C", "D")


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
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    k_pages = k.to(torch.bfloat16).view(P, page_size, 576)
    block_table = torch.randperm(P, generator=gen).view(b, n_pages_per).int()
    lens = torch.full((b,), L, dtype=torch.int32)
    return q.to(torch.bfloat16), k_pages, block_table, lens


def accuracy_study(
    lengths=(1024, 4096, 16384),
    dists=("flashmla", "paper"),
    batch: int = 2,
    heads: int = 16,
    s_q: int = 1,
    page_size: int = 64,
    seeds=(0, 1, 2, 3),
    device: str = "cpu",
) -> list[dict]:
    """One row per (distribution, length, config): rel-L2, cos diff and RMSE are means over
    ``seeds`` (each seed a fresh draw of q and K), the LSE error is the max over them."""
    rows = []
    for dist in dists:
        for L in lengths:
            per_cfg = {name: [] for name in CONFIG_ORDER}
            for seed in seeds:
                gen = torch.Generator().manual_seed(1_000_003 * seed + L)
                q, k_pages, bt, lens = make_inputs(dist, batch, s_q, heads, L, page_size, gen)
                q, k_pages = q.to(device), k_pages.to(device)
                out_x, lse_x = ref.mla_decode_exact(q, k_pages, bt, lens)
                fp8_cache = ref.quantize_kv_cache(k_pages)
                for name in CONFIG_ORDER:
                    cache = fp8_cache if name == "snapmla" else k_pages
                    out, lse = ref.mla_decode_emulated(q, cache, bt, lens, config=name)
                    per_cfg[name].append(
                        (ref.rel_l2(out, out_x), ref.cos_diff(out, out_x), ref.rmse(out, out_x), ref.lse_max_abs(lse, lse_x))
                    )
            for name, vals in per_cfg.items():
                mean = [sum(v[i] for v in vals) / len(vals) for i in range(3)]
                rows.append(
                    dict(
                        dist=dist,
                        L=L,
                        config=ref.CONFIGS[name].name,
                        rel_l2=mean[0],
                        cos_diff=mean[1],
                        rmse=mean[2],
                        lse_max_abs=max(v[3] for v in vals),
                    )
                )
    return rows


def print_accuracy(rows, markdown: bool = False):
    from tabulate import tabulate

    table = [
        [r["dist"], r["L"], r["config"], f"{r['rel_l2']:.3e}", f"{r['cos_diff']:.3e}", f"{r['rmse']:.3e}", f"{r['lse_max_abs']:.3e}"]
        for r in rows
    ]
    headers = ["data", "L", "config", "rel-L2", "cos diff", "RMSE", "LSE max |Δ|"]
    print(tabulate(table, headers=headers, tablefmt="github" if markdown else "simple"))
