"""The SnapMLA FP8 decode kernel for SM90a (paper §3, App. B, App. C Algorithm 1), one module per role.

One CTA computes one 64-row query tile (rows = s_q·h packed) over the KV blocks its
split-KV part plans for itself. Per 64-token block:

1. QK (``consumer``): FP8 e4m3 WGMMA over the 512 content dims and BF16 WGMMA over the 64
   RoPE dims chained on one accumulator (Eq. 6: both parts live in the scaled domain), then
   s = ((acc·σ_q)·σ_k)·scale·log2e. The tensor core's truncating adder is modelled bit for
   bit by ``tensor_core.tensor_core_mma``.
2. V transposition in place (``transposer``): the content tile is rewritten as Vᵀ (tokens in
   the order π of the QK accumulator's columns), tokens past the sequence zeroed.
3. Online softmax (``softmax``) with V-scale fusion P' = P·σ_k and per-row block-wise P
   quantization (σ_p = rowmax(P')/448), implicit dequantization through
   γ = 2^(m-m_new)·σ_p/σ_p,cur.
4. P → e4m3 A-operand registers (one prmt per word inside each lane), published with the
   softmax state to the other consumer WG (``pipelines.handshakes.PairExchange``).
5. PV (``consumer``): FP8 WGMMA, each consumer WG owning 256 output dims, strictly in block
   order; each block's P·V lands in a zeroed accumulator and o = γ·o + P·V is done in fp32.
6. Epilogue (``epilogue``): o/ℓ as bf16 ``out`` or a split's partial (f16 with a per-row
   scale up to ``MERGE_FEW`` splits a request, else fp32), and the LSE; the
   splits of a request cut by a part boundary are merged in the same launch (``merge``).

Modules: ``config`` (``DecodeConfig``, constants), ``launch`` (each launch's arguments as one
bundle: ``StepArgs``, ``KernelArgs``), ``args`` (the typed bundles the wiring hands the
roles), ``kernel`` (launch and wiring), one module per role, each role a frozen
object (``plan``, ``producer``, ``transposer``, ``consumer``, ``epilogue``, ``merge``: every
merge of partial results and the final LSE),
``softmax`` (the consumers' softmax state), ``storage`` (shared memory), ``trace``
(profiling stamps), ``step`` (the host function ``mla_decode`` and ``mla_decode_sparse``
call) and ``compile`` (fake arguments and the compile entries).
Everything is checked against ``emulation.mla_decode_emulated``.
"""

from snapmla_cute.kernels.decode.config import MERGE_MAX_SPLITS, SM90_SMEM_BYTES, DecodeConfig  # noqa: F401
from snapmla_cute.kernels.decode.kernel import DecodeKernel  # noqa: F401
