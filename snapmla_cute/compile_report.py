"""Compile every kernel variant for a target arch (no GPU needed) and report what the SASS shows.

Per variant: registers per thread at launch (ELF), the highest register the code touches
(consumer warpgroups raise their budget with setmaxnreg), stack frame bytes, local-memory
loads/stores (spills), FP8 (QGMMA) and BF16 (HGMMA) warpgroup MMA counts, and a digest of
the SASS with the kernels' symbol names normalized (``sass_digest``): a change that only
moves code shows the same digest for every variant before and after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

from snapmla_cute.sass import kernel_resources, sass_counts


# (heads, s_q, page_size, causal): the quick set, and the shapes of the non-default layouts
QUICK_SHAPES = [(128, 1, 64, False), (16, 4, 16, True), (64, 2, 32, True), (32, 3, 128, False)]


def decode_variants(full: bool = True) -> list:
    from snapmla_cute.format import PAGE_SIZES
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.heads import HEADS, MAX_S_Q

    if not full:
        shapes = QUICK_SHAPES
    else:
        # every page size for s_q <= 4 and h >= 16; h = 8 and the longer windows at page 64
        # (their layouts differ only in the row count, which the s_q <= 4 set already spans)
        wide = [h for h in HEADS if h >= 16]
        shapes = list(itertools.product(wide, range(1, 5), PAGE_SIZES, (False, True)))
        shapes += [(8, s, 64, c) for s in range(1, MAX_S_Q + 1) for c in (False, True)]
        shapes += [(h, s, 64, c) for h in wide for s in range(5, MAX_S_Q + 1) for c in (False, True)]
    return [DecodeConfig(heads=h, s_q=s, page_size=p, causal=c) for h, s, p, c in shapes]


def fused_kernels() -> tuple:
    """The memory-bound kernel modules (one warp per row)."""
    from snapmla_cute.kernels import append_kv, dequant_kv, quant_q

    return (quant_q, append_kv, dequant_kv)


def all_variants(full: bool = True) -> list[tuple]:
    """(kernel name, its compile entry, config or None for the default) of every variant CI checks."""
    from snapmla_cute.kernels import decode_scheduler
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.step import DecodeStepConfig

    out = [(k.NAME, k.compile, None) for k in (*fused_kernels(), decode_scheduler)]
    # the calls the fused ops make (the same kernels behind views built at trace time)
    q, a, d = fused_kernels()
    out += [
        (q.CALL_NAME, q.compile_call, q.QuantQCallConfig(1, 128)),
        (a.CALL_NAME, a.compile_call, a.AppendKVCallConfig(64)),
        (d.CALL_NAME, d.compile_call, d.DequantKVCallConfig(64)),
    ]
    out += [(dc.NAME, dc.compile, c) for c in decode_variants(full)]
    # what mla_decode launches: the decode kernel (planning and merging itself), from a
    # quantized or a bf16 query
    steps = ((dc.STEP_NAME, dc.compile_step), (dc.STEP_Q_NAME, dc.compile_step_q))
    out += [(name, fn, DecodeStepConfig(c)) for c in decode_variants(False)[:1] for name, fn in steps]
    # the launches in clusters of two (decode_metadata's choice where the cluster plan pays)
    from snapmla_cute.kernels.decode import DecodeConfig

    out += [(dc.STEP_NAME, dc.compile_step, DecodeStepConfig(DecodeConfig(h, 1, 64, False, cluster=2))) for h in (64, 128)]
    # the head-group plan of small batches (128 or 64 heads as groups of 16, a cluster of k
    # each): every (g, k) default_head_groups picks, the bf16-query step, the accurate mode's
    from snapmla_cute.heads import head_group_steps

    out += [(dc.STEP_NAME, dc.compile_step, DecodeStepConfig(DecodeConfig(16, 1, 64, False, cluster=k), g))
            for g, k in head_group_steps()]
    out += [(dc.STEP_Q_NAME, dc.compile_step_q, DecodeStepConfig(DecodeConfig(16, 1, 64, False, cluster=8), 8))]
    # what mla_decode_sparse launches, at every head count (the call's s_q changes only views)
    out += [(dc.SPARSE_NAME, dc.compile_sparse, c) for c in sparse_variants()]
    out += [(dc.SPARSE_Q_NAME, dc.compile_sparse_q, sparse_variants()[-1])]
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig

    out += [(dc.SPARSE_NAME, dc.compile_sparse, DecodeSparseStepConfig(DecodeConfig(h, 1, 1, False, sparse=True, cluster=2), 1))
            for h in (8, 64)]
    # the context-parallel decode: a shard's step (causal by visible-key counts) and the merge
    out += [(dc.STEP_NAME, dc.compile_step, c) for c in visible_variants()]
    # the accurate mode (Q as hi + lo, three KV stages): its quantize call and the steps
    out += [(q.CALL_NAME, q.compile_call, q.QuantQCallConfig(1, 128, q.QuantQConfig(split=True)))]
    out += [(dc.STEP_NAME, dc.compile_step, DecodeStepConfig(c)) for c in split_variants()]
    out += [(dc.STEP_Q_NAME, dc.compile_step_q, DecodeStepConfig(split_variants()[0]))]
    from snapmla_cute.kernels.decode.config import Q_SPLIT_KV_STAGES as _stages
    from snapmla_cute.kernels.decode.config import Q_SPLIT_MAX_CLUSTER

    out += [(dc.STEP_NAME, dc.compile_step, DecodeStepConfig(
        DecodeConfig(16, 1, 64, False, cluster=Q_SPLIT_MAX_CLUSTER, q_split=True, kv_stages=_stages), 8))]

    out += [(dc.SPARSE_NAME, dc.compile_sparse, DecodeSparseStepConfig(
        DecodeConfig(128, 1, 1, False, sparse=True, q_split=True, kv_stages=_stages), 1))]
    from snapmla_cute.kernels import lse_merge

    out += [(lse_merge.NAME, lse_merge.compile, lse_merge.LseMergeConfig(s, h)) for s, h in ((1, 128), (8, 8), (4, 16))]
    # sparse context parallel: the global lists turned into a rank's compacted slot lists
    from snapmla_cute.kernels import topk_translate as tt

    out += [(tt.NAME, tt.compile, tt.TopkTranslateConfig(64, rr, gl)) for rr in (True, False) for gl in (False, True)]
    return out


def split_variants() -> list:
    """The accurate mode's decode configs at the quick shapes (``DecodeConfig.q_split``)."""
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode.config import Q_SPLIT_KV_STAGES

    return [DecodeConfig(heads=h, s_q=s, page_size=p, causal=c, q_split=True, kv_stages=Q_SPLIT_KV_STAGES)
            for h, s, p, c in QUICK_SHAPES]


def visible_variants() -> list:
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode.step import DecodeStepConfig

    return [DecodeStepConfig(DecodeConfig(heads=h, s_q=s, page_size=64, causal=True, visible=True))
            for h, s in ((128, 2), (16, 4), (8, 8))]


def sparse_variants() -> list:
    from snapmla_cute.kernels.decode import DecodeConfig
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig
    from snapmla_cute.heads import SPARSE_HEADS

    return [DecodeSparseStepConfig(DecodeConfig(heads=h, s_q=1, page_size=1, causal=False, sparse=True), s)
            for h in SPARSE_HEADS for s in ((1, 2) if h == 128 else (1, 8) if h == 8 else (1,))]


# the DSL names a kernel after its module, class and argument types; a move renames it
_SYMBOL = re.compile(r"\bkernel_cutlass_\w+")


def sass_digest(sass: str) -> str:
    """sha256 of a SASS listing with every kernel symbol replaced by its order of appearance."""
    names: dict[str, str] = {}
    text = _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"KERNEL{len(names)}"), sass)
    return hashlib.sha256(text.encode()).hexdigest()


def variant_key(name: str, config) -> str:
    """A variant's name for digests: the kernel and its config fields that differ from their
    defaults (fields without a default, the shape, always), so adding or deleting a field
    with its shipped value keeps every key."""
    return f"{name} [{_short(config)}]"


def write_digests(rows, path: str) -> None:
    with open(path, "w") as f:
        json.dump({variant_key(r["kernel"], r["config"]): r["sass_digest"] for r in rows}, f, indent=1, sort_keys=True)


def _report_one(args) -> dict:
    name, compile_fn, config, arch = args
    if config is None:
        compiled = compile_fn(arch=arch, keep_sass=True)
    else:
        compiled = compile_fn(config, arch=arch, keep_sass=True)
    art = compiled.artifacts
    sass = str(art.SASS or "")
    counts = sass_counts(sass)
    regs_used = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1) + 1
    kernels = kernel_resources(art.CUBIN)  # a step may hold two kernels (Q-quant, decode): report the largest
    res = max(kernels, key=lambda k: (k.registers, k.frame_bytes))
    frame = max(k.frame_bytes for k in kernels)
    return dict(
        kernel=name,
        variant=_short(compiled.config),
        registers=res.registers,
        max_reg_used=regs_used,
        frame_bytes=frame,
        local_ld=counts.local_ld,
        local_st=counts.local_st,
        qgmma=counts.qgmma,
        hgmma=counts.hgmma,
        gmma_run=counts.gmma_run,
        sass_instructions=counts.instructions,
        sass_digest=sass_digest(sass),
        config=compiled.config,
    )


def _short(config) -> str:
    if config is None:
        return "-"
    if hasattr(config, "decode"):
        # a step's own fields (the sparse step's s_q) follow its kernel's: two sparse steps
        # differing only by s_q are two variants
        rest = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
                if f.name != "decode" and (f.default is dataclasses.MISSING or getattr(config, f.name) != f.default)]
        return " ".join(["step: " + _short(config.decode), *rest])
    shown = []
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.default is dataclasses.MISSING or v != f.default:
            shown.append(f"{f.name}={v}")
    return " ".join(shown)


def compile_report(arch: str = "sm_90a", variants=None, jobs: int = 1) -> list[dict]:
    variants = all_variants() if variants is None else variants
    work = [(name, fn, cfg, arch) for name, fn, cfg in variants]
    if jobs > 1:
        # spawn, not fork: a process that already traced a kernel holds DSL locks a forked
        # child would inherit locked
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            return list(pool.map(_report_one, work))
    return [_report_one(w) for w in work]


_DECODES = ("decode", "decode_step", "decode_step_q", "decode_sparse", "decode_sparse_q")


def violations(rows) -> list[str]:
    """What CI rejects: local-memory traffic anywhere; a decode variant without QGMMA or HGMMA,
    or with its warpgroup MMAs serialized by ptxas (each waiting for the previous one)."""
    bad = []
    for r in rows:
        where = f"{r['kernel']} [{r['variant']}]"
        if r["local_ld"] or r["local_st"] or r["frame_bytes"]:
            bad.append(f"{where}: local memory ({r['local_ld']} LDL, {r['local_st']} STL, {r['frame_bytes']} B frame)")
        if r["kernel"] in _DECODES and (r["qgmma"] == 0 or r["hgmma"] == 0):
            bad.append(f"{where}: QGMMA {r['qgmma']}, HGMMA {r['hgmma']}")
        if r["kernel"] in _DECODES and r["gmma_run"] < 2:
            bad.append(f"{where}: warpgroup MMAs serialized (longest GMMA run without a wait: {r['gmma_run']})")
    return bad


def print_report(rows):
    from tabulate import tabulate

    print(tabulate([{k: v for k, v in r.items() if k not in ("config", "sass_digest")} for r in rows], headers="keys"))
