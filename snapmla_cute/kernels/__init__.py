"""CuTe DSL kernels, one kernel class per module.

Memory-bound helpers of SnapMLA §3.3.1 (fused Q-quant, K-append, fetch-dequant) live in
``quant_q``, ``append_kv`` and ``dequant_kv``; their shared per-row math is in ``rowquant``.
The decode is ``decode`` (FP8 MLA, warp-specialized; plans its own part of the split-KV
work and merges split requests in the last split's CTA), ``decode_scheduler`` (the same
plan as a kernel of its own, for ``decode_metadata``) and ``decode_step`` (the one-launch
host function ``mla_decode`` calls).
"""
