"""CPU: the flashinfer modules that `import flashinfer.mla` loads, and a rehearsal of
``snapmla_cute.peers``' FlashInfer calls through FlashInfer's own wrapper, without a GPU.

    python profiles/flashinfer_trace.py SITE [--triton] [--rehearse] > modules.txt

SITE holds a ``flashinfer/`` package: the unpacked wheel with its ``__init__.py`` replaced by
the trimmed one (``profiles/flashinfer_bundle.sh`` writes it), or the trimmed tree itself. The
device queries answer as an H200 would (SM 9.0, 132 SMs); ``--triton`` stands in a permissive
``triton`` (the GPU machine has one, and with it fused_moe's CuTe DSL MoE loads more modules);
``--rehearse`` then plans and runs ``peers.flashinfer_us`` on small rows through the real
wrapper (its plan/run checks, the JIT spec and its ninja file) with a stand-in for the compiled
module whose ``run`` computes the decode in float64 from the tensors FlashInfer hands it. The
module list (paths under ``flashinfer/``) goes to stdout, the rest to stderr. The bundle's list
is the union of the runs with and without ``--triton``, each with ``--rehearse``.
Needs torch, apache-tvm-ffi, the CuTe DSL and flashinfer's other imports (tqdm, requests,
nvidia-ml-py, ...); with ``--rehearse``, the snapmla_cute package.
"""

import argparse
import importlib.abc
import importlib.machinery
import os
import sys
import types
from unittest.mock import MagicMock


class _Permissive(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _TritonFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Permissive(spec.name)
        module.__path__ = []
        if spec.name == "triton":
            module.__version__ = "3.6.0"
        return module

    def exec_module(self, module):
        pass


def _as_h200(torch):
    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132, name="NVIDIA H200",
                                  total_memory=140 << 30, shared_memory_per_multiprocessor=233472,
                                  shared_memory_per_block_optin=232448)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.get_device_properties = lambda *a: props
    torch.cuda.get_device_name = lambda *a: props.name
    torch.cuda.synchronize = lambda *a: None
    return props


def _rehearse(torch, props):
    """peers.flashinfer_us through the real wrapper; the compiled module stood in for."""
    from flashinfer.jit import gen_batch_mla_module
    from flashinfer.mla._batch_mla import _wrapper
    from flashinfer.mla._batch_mla._backends import _fa_common, fa3_backend

    from snapmla_cute import peers
    from snapmla_cute import reference as ref

    _wrapper._get_compute_capability = lambda d: (9, 0)
    _fa_common.get_compute_capability = lambda d: (9, 0)
    _fa_common.is_sm90a_supported = lambda d: True
    _fa_common.get_device_sm_count = lambda d: props.multi_processor_count
    _fa_common.get_device_properties = lambda d: props
    init = _fa_common._BatchMLAGeneratedFaMechanics.__init__

    def cpu_init(self, **kw):  # no pinned memory without a GPU
        kw["int_workspace_buffer"] = kw.get("int_workspace_buffer") or torch.empty(8 << 20, dtype=torch.uint8)
        kw["pin_memory_int_workspace_buffer"] = torch.empty(8 << 20, dtype=torch.uint8)
        init(self, **kw)

    _fa_common._BatchMLAGeneratedFaMechanics.__init__ = cpu_init

    class Module:  # batch_mla_sm90_{plan,run}.cu's signatures
        def plan_with_staged_workspace_bytes(self, fws, iws, pinned, qo, kvp, kvl, h, ckv, causal):
            self.qo, self.kvp, self.kvl, self.causal = qo, kvp, kvl, causal
            return [0] * 20, 0

        def run(self, fws, iws, plan_info, q_nope, q_pe, ckv, kpe, kv_indices, out, lse, mask_mode, num_heads,
                page_size, sm_scale, base_e, ckv_scale, kpe_scale, ckv_scale_arr):
            assert mask_mode == int(self.causal) and lse is None and ckv.shape[1] == page_size
            if ckv.dtype == torch.float8_e4m3fn:  # as repack_fp8_kv_to_bf16 dequantizes
                P, ps, _ = ckv.shape
                content = (ckv.float().view(P, ps, 4, 128) * ckv_scale_arr[..., None]).view(P, ps, 512).bfloat16()
                ckv, kpe = content, kpe.bfloat16() * torch.tensor(kpe_scale).bfloat16()
            b, n = self.kvl.numel(), int(self.qo[-1])
            pages = (self.kvp[1:] - self.kvp[:-1]).tolist()
            table = torch.zeros(b, max(pages), dtype=torch.int32)
            for i, k in enumerate(pages):
                table[i, :k] = kv_indices[self.kvp[i] : self.kvp[i + 1]]
            q = torch.cat([q_nope, q_pe], -1).view(b, n // b, num_heads, 576)
            o = ref.mla_decode_exact(q, torch.cat([ckv, kpe], -1).float(), table, self.kvl,
                                     causal=bool(mask_mode), softmax_scale=sm_scale)[0]
            out.copy_(o.view(n, num_heads, 512))

    def module(*jit_args):
        gen_batch_mla_module(*jit_args).write_ninja()  # the real JIT spec and ninja file
        return Module()

    fa3_backend.get_batch_mla_module = module
    peers.time_us = lambda call: (call(), 1.0)[1]
    g = torch.Generator().manual_seed(0)
    for b, h, s_q, lens, causal in ((2, 16, 1, (130, 300), False), (2, 128, 2, (200, 64), True),
                                    (3, 64, 1, (1, 64, 65), False)):
        pages = [(n + 63) // 64 for n in lens]
        kv_pages = (torch.randn(sum(pages) + 2, 64, 576, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
        perm, table = torch.randperm(sum(pages) + 2, generator=g).int(), torch.zeros(b, max(pages) + 1, dtype=torch.int32)
        for i, k in enumerate(pages):
            table[i, :k] = perm[sum(pages[:i]) : sum(pages[: i + 1])]
        q = torch.randn(b, s_q, h, 576, generator=g).to(torch.bfloat16)
        got = peers.flashinfer_us(q, kv_pages, table, torch.tensor(lens, dtype=torch.int32),
                                  cache=ref.quantize_kv_cache(kv_pages), causal=causal)
        print(f"rehearsal b{b} h{h} s_q{s_q} lens {lens} causal {causal}: {got}", file=sys.stderr)
        assert got == dict(fi_bf16=1.0, fi_fp8=1.0, note=None), got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", help="a folder holding the flashinfer/ package")
    ap.add_argument("--triton", action="store_true", help="stand in a permissive triton")
    ap.add_argument("--rehearse", action="store_true", help="run peers.flashinfer_us through the real wrapper")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.site))
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-trace-ws")
    if args.triton:
        sys.meta_path.insert(0, _TritonFinder())
    import torch

    props = _as_h200(torch)
    import flashinfer.mla  # noqa: F401

    if args.rehearse:
        _rehearse(torch, props)
    root = os.path.join(os.path.abspath(args.site), "flashinfer")
    files = {os.path.relpath(m.__file__, root) for name, m in list(sys.modules.items())
             if name.startswith("flashinfer") and getattr(m, "__file__", None)}
    print("\n".join(sorted(files)))


if __name__ == "__main__":
    main()
