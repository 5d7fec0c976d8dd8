"""What Hopper's WGMMA adder does to an accumulation, bit for bit (part of the decode's spec:
``emulation.mla_decode_emulated`` runs QK and PV through it)."""

from __future__ import annotations

import torch

# --------------------------------------------------------------------------------------------
# Hopper tensor-core accumulation (what WGMMA's adder does, bit for bit)
# --------------------------------------------------------------------------------------------
#
# Fitted on the H100 against cuBLAS fast-accumulation GEMMs and matched on 5 x 65536
# outputs with no exception (K = 16 ... 512, chained instructions included): one WGMMA
# instruction takes its K-chunk of exact products and the incoming accumulator, aligns them
# to E = max(e_a + e_b over the chunk's nonzero products, exponent of the accumulator)
# (e_x = floor(log2|x|)), truncates every term toward zero to a multiple of 2^(E - F), adds
# the terms exactly and truncates the sum toward zero to `out_bits` fraction bits.
#   e4m3 (QGMMA, k = 32): F = 13, out_bits = 13 — the "e8m13 accumulator";
#   bf16 (HGMMA, k = 16): F = 25, out_bits = 23.
# The probe is `git show cc70d70:profiles/experiments/fp8_accum_probe.py`.


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) as int32; zeros get a very small exponent (they never set the max)."""
    _, e = torch.frexp(x)
    return torch.where(x == 0, torch.full_like(e, -(1 << 20)), e - 1)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, exactly, from the exponent bits (e integer, in [-1022, 1023]).
    ``torch.ldexp`` multiplies by ``pow(2, e)``, which CUDA rounds for some e: the emulation
    then truncated at other boundaries on the GPU than on the CPU (seen as a 7e-5 score
    difference at softmax scale 30)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _trunc_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x truncated toward zero to `bits` fraction bits (float64 in, float64 out)."""
    q = _pow2((_floor_log2(x) - bits).clamp(min=-1000))
    return torch.where(x == 0, x, torch.trunc(x / q) * q)


def tensor_core_mma(
    a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None, *, kind: str = "e4m3", tile: int = 1 << 24
) -> torch.Tensor:
    """``acc + a @ b.T`` as a chain of Hopper WGMMA instructions along K, bit for bit.

    ``a [M, K]``, ``b [N, K]``: e4m3 (``kind="e4m3"``, k = 32 per instruction) or bf16
    (``kind="bf16"``, k = 16) values in any float dtype; ``acc [M, N]`` fp32 or None (zero,
    i.e. the first instruction runs with scale-d = 0). Returns fp32 ``[M, N]``.
    """
    k_step, frac, out_bits = {"e4m3": (32, 13, 13), "bf16": (16, 25, 23)}[kind]
    a, b = a.double(), b.double()
    M, K = a.shape
    N = b.shape[0]
    out = torch.zeros(M, N, dtype=torch.float64, device=a.device) if acc is None else acc.double().clone()
    ea, eb = _floor_log2(a), _floor_log2(b)
    n_tile = max(1, min(N, tile // max(1, M * k_step)))
    for n0 in range(0, N, n_tile):
        n1 = min(N, n0 + n_tile)
        c = out[:, n0:n1]
        for k0 in range(0, K, k_step):
            ks = slice(k0, min(K, k0 + k_step))
            prod = a[:, None, ks] * b[None, n0:n1, ks]  # exact: 8 x 8 (or 8 x 8 bf16) significand bits
            e = (ea[:, None, ks] + eb[None, n0:n1, ks]).masked_fill(prod == 0, -(1 << 20)).amax(-1)
            e = torch.maximum(e, _floor_log2(c))
            q = _pow2((e - frac).clamp(min=-1000))
            terms = torch.trunc(prod / q[..., None]).sum(-1) + torch.trunc(c / q)
            c = _trunc_bits(terms * q, out_bits)
        out[:, n0:n1] = c
    return out.float()
