"""CuTe DSL kernels: each module (or, for the decode, package) holds the kernel class, its
fake arguments and its ``compile`` entry (``jit_cache`` only caches).

Memory-bound helpers of SnapMLA §3.3.1 (fused Q-quant, K-append, fetch-dequant) live in
``quant_q``, ``append_kv`` and ``dequant_kv``; their shared per-row math is in ``rowquant``.
The decode is the package ``decode`` (FP8 MLA, warp-specialized, one module per role; plans
its own part of the split-KV work and merges split requests in the same launch; its
``step`` is the one-launch host function ``mla_decode`` and ``mla_decode_sparse`` call).
``decode_scheduler`` is the same plan as a kernel of its own, for ``decode_metadata``;
``lse_merge`` merges context-parallel shards. ``fake`` builds the fake tensors kernels
compile against; ``snapmla_cute.ptx`` (below this package) wraps the PTX the DSL does not
expose.
"""
