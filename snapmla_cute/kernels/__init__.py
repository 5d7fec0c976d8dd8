"""CuTe DSL kernels, one kernel class per module.

Memory-bound helpers of SnapMLA §3.3.1 (fused Q-quant, K-append, fetch-dequant) live in
``quant_q``, ``append_kv`` and ``dequant_kv``; their shared per-row math is in ``rowquant``.
The decode is ``decode`` (FP8 MLA, warp-specialized), ``decode_scheduler`` (split-KV plan
on the device) and ``decode_combine`` (LSE-weighted merge of split results).
"""
