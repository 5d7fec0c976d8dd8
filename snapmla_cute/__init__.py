"""snapmla-cute: SnapMLA FP8 MLA decoding for Hopper (SM90a), written in CuTe DSL.

Public API (torch tensors on a CUDA device):

* :class:`FP8KVCache` — one layer's FP8 paged KV cache (644 B/token).
* :func:`quantize_q`, :func:`append_kv`, :func:`dequantize_kv` — the fused memory-bound kernels.
* :func:`mla_decode`, :func:`decode_metadata` — the FP8 decode (split-KV planned on the device).
* :func:`mla_decode_sparse`, :func:`sparse_decode_metadata` — the FP8 sparse (top-k) decode:
  each query token attends to its own list of cache slots.
* :mod:`snapmla_cute.distributed` and :mod:`snapmla_cute.distributed_sparse` (imported as
  modules) — decode context parallel, dense and sparse: a request's cache sharded over the
  GPUs of a ``torch.distributed`` group (``mla_decode_cp``, ``mla_decode_sparse_cp``).
* ``torch.ops.snapmla.{quantize_q,append_kv,dequantize_kv,mla_decode}`` — the same as custom
  ops (and ``mla_decode_sparse``) with fake implementations (torch.compile, CUDA graphs).
* :mod:`snapmla_cute.reference` and :mod:`snapmla_cute.emulation` — the specification: exact
  decode, and the bit-faithful emulation of the kernel.
"""

from snapmla_cute.kv_cache import FP8KVCache
from snapmla_cute.decode import mla_decode, warmup
from snapmla_cute.fused import append_kv, dequantize_kv, quantize_q
from snapmla_cute.planning import DecodeMetadata, decode_metadata
from snapmla_cute.sparse import SparseDecodeMetadata, mla_decode_sparse, sparse_decode_metadata

from snapmla_cute import torch_ops  # noqa: E402,F401  registers torch.ops.snapmla.*

__all__ = [
    "FP8KVCache",
    "quantize_q",
    "append_kv",
    "dequantize_kv",
    "mla_decode",
    "decode_metadata",
    "DecodeMetadata",
    "warmup",
    "mla_decode_sparse",
    "sparse_decode_metadata",
    "SparseDecodeMetadata",
]
__version__ = "0.1.0"
