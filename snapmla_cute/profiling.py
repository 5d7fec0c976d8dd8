"""Nsight Compute profiles of the decode step (`snapmla-cute profile`).

Three pieces, so each can run alone:

* ``run_target(shape)`` — what runs under ncu: builds one decode case (dense, or sparse
  for a shape with ``topk``), compiles and runs it once outside the profiled range, then one
  ``mla_decode`` / ``mla_decode_sparse`` call (one decode kernel) between
  ``cudaProfilerStart``/``Stop``.
* ``ncu_command(...)`` — the ncu command line: ``--clock-control none`` (the clocks stay as
  in serving), ``--profile-from-start off``, and the sections that matter for this kernel.
* ``summarize(report)`` — reads a ``.ncu-rep`` back through ``ncu --import`` and prints per
  kernel the few lines worth keeping in git (duration, DRAM/memory/SM throughput, tensor
  pipe, registers, occupancy, the top warp stall reasons).
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

SECTIONS = (
    "SpeedOfLight",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
    "WarpStateStats",
    "SourceCounters",
    "LaunchStats",
    "Occupancy",
)


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    s_q: int
    seqlen: int
    causal: bool
    page_size: int = 64
    varlen: bool = False  # lengths drawn as the bench's varlen row does (around seqlen)
    topk: int = 0  # > 0: the sparse decode, each query token with topk indices into its request's seqlen tokens


SHAPES = {
    # memory-bound: one query token, 4096 keys
    "s1": Shape("b128 h128 s_q1 s_k4096", 128, 128, 1, 4096, False),
    # compute-bound: two causal query tokens
    "s2": Shape("b128 h128 s_q2 s_k8192 causal", 128, 128, 2, 8192, True),
    # the sparse decode (the gather of 640-byte rows by cp.async): the bench's rows
    "sp128": Shape("sparse b128 h128 s_q1 topk2048 of 8192", 128, 128, 1, 8192, False, topk=2048),
    "sp64": Shape("sparse b64 h64 s_q1 topk2048 of 8192", 64, 64, 1, 8192, False, topk=2048),
    "sp8": Shape("sparse b64 h8 s_q1 topk2048 of 8192", 64, 8, 1, 8192, False, topk=2048),
}


def make_case(shape: Shape) -> dict:
    """A decode step of ``shape`` on synthetic data (finite e4m3 codes, small bf16 RoPE,
    shuffled pages): ``q_bf16``, the quantized ``q``, ``cache``, ``block_table``, ``seqlens``,
    ``metadata``, ``out``, ``lse`` and ``step`` (one ``mla_decode(check=False)`` call).
    Shared by the profile target and the timing experiments in ``profiles/experiments``."""
    import torch

    from snapmla_cute import FP8KVCache, decode_metadata, mla_decode, quantize_q

    from snapmla_cute.bench import decode_lengths

    b, h, s_q, ps = shape.batch, shape.heads, shape.s_q, shape.page_size
    lens = decode_lengths(b, shape.seqlen, shape.varlen)
    L = max(lens)
    n = (L + ps - 1) // ps
    c = dict(cache=FP8KVCache.allocate(b * n, ps, device="cuda"))
    c["cache"].kv.random_(0, 100)  # finite e4m3 codes (bytes < 0x7f: |x| < 448, no NaN)
    # small bf16 RoPE (random bytes would make the high byte an exponent near 2^73)
    rope = (torch.randn(b * n, ps, 64, device="cuda") / 10).to(torch.bfloat16)
    c["cache"].kv[:, :, 512:] = rope.view(torch.uint8).view(b * n, ps, 128)
    c["cache"].kv_scale.fill_(1e-2)
    c["block_table"] = torch.randperm(b * n, device="cuda", dtype=torch.int32).view(b, n)
    c["seqlens"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
    c["q_bf16"] = torch.randn(b, s_q, h, 576, device="cuda", dtype=torch.bfloat16)
    c["q"] = quantize_q(c["q_bf16"])
    c["metadata"] = decode_metadata(c["seqlens"], s_q=s_q, heads=h)
    c["out"] = torch.empty(b, s_q, h, 512, device="cuda", dtype=torch.bfloat16)
    c["lse"] = torch.empty(b, h, s_q, device="cuda", dtype=torch.float32)
    c["step"] = lambda: mla_decode(
        c["q"], c["cache"], c["block_table"], c["seqlens"], causal=shape.causal,
        metadata=c["metadata"], out=c["out"], lse=c["lse"], check=False,
    )
    return c


def make_sparse_case(shape: Shape) -> dict:
    """A sparse decode step of ``shape`` (``bench_sparse.sparse_case``: distinct random
    indices into each request's tokens): ``cache``, ``q_bf16``, ``q``, ``indices``,
    ``metadata``, ``out``, ``lse`` and ``step`` (one ``mla_decode_sparse(check=False)``)."""
    from snapmla_cute import mla_decode_sparse
    from snapmla_cute.bench_sparse import sparse_case

    cache, q, qq, idx, md = sparse_case(shape.batch, shape.heads, shape.s_q, shape.topk, shape.seqlen, shape.page_size)
    out, lse = mla_decode_sparse(qq, cache, idx, metadata=md)
    c = dict(cache=cache, q_bf16=q, q=qq, indices=idx, metadata=md, out=out, lse=lse)
    c["step"] = lambda: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse, check=False)
    return c


def run_target(shape: Shape) -> None:
    import torch

    step = (make_sparse_case(shape) if shape.topk else make_case(shape))["step"]
    step()  # compile / load and run once outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_binary() -> str | None:
    return shutil.which("ncu") or next(
        (p for p in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu") if shutil.which(p)), None
    )


def ncu_command(shape_key: str, report: str, ncu: str = "ncu") -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--force-overwrite", "-o", report]
    for s in SECTIONS:
        cmd += ["--section", s]
    return cmd + [sys.executable, "-m", "snapmla_cute.profiling", shape_key]


# (printed label, section name, metric name) from the report's details page
_DETAILS = [
    ("duration", "GPU Speed Of Light Throughput", "Duration"),
    ("DRAM throughput", "GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("memory throughput", "GPU Speed Of Light Throughput", "Memory Throughput"),
    ("SM (compute) throughput", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("L2 hit rate", "Memory Workload Analysis", "L2 Hit Rate"),
    ("registers/thread", "Launch Statistics", "Registers Per Thread"),
    ("grid", "Launch Statistics", "Grid Size"),
    ("achieved occupancy", "Occupancy", "Achieved Occupancy"),
    ("issue slots busy", "Compute Workload Analysis", "Issue Slots Busy"),
    ("warp cycles/issued inst", "Warp State Statistics", "Warp Cycles Per Issued Instruction"),
]


def _csv(ncu: str, report: str, page: str) -> list[dict]:
    text = subprocess.run(
        [ncu, "--import", report, "--page", page, "--csv"], check=True, capture_output=True, text=True
    ).stdout
    start = text.find('"ID"')
    return list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []


def source_csv(report: str, ncu: str = "ncu") -> str:
    """The report's source page at SASS level as CSV: one row per instruction with its
    executed count and warp-stall samples."""
    return subprocess.run(
        [ncu, "--import", report, "--page", "source", "--csv", "--print-source", "sass"],
        check=True, capture_output=True, text=True,
    ).stdout


def read_source_csv(path: str) -> tuple[dict, list[list[str]]]:
    """A saved ``source_csv`` (``decode_<shape>_sass.csv``, or ``.gz``): (column index by
    name, the instruction rows, each as long as the header)."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[head]
    return {h: i for i, h in enumerate(hdr)}, [r for r in rows[head + 1 :] if len(r) == len(hdr)]


def sass_opcode(source: str) -> str:
    """The opcode of a SASS line of the source page (its predicate left off)."""
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split()[0]


def csv_number(x: str) -> float:
    """A source-page counter ("1,234"); 0 for an empty or non-numeric cell."""
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def _short(name: str) -> str:
    for key in ("DecodeKernel", "Combine", "Scheduler"):
        if key.lower() in name.lower():
            return key
    return name[:40]


def summarize(report: str, ncu: str = "ncu") -> str:
    """Text summary of an ncu report (one block per profiled kernel)."""
    lines = []
    details = _csv(ncu, report, "details")
    raw = _csv(ncu, report, "raw")
    kernels: dict[str, dict] = {}
    for row in details:
        k = kernels.setdefault(row["ID"], {"name": _short(row.get("Kernel Name", "")), "m": {}})
        k["m"][(row.get("Section Name"), row.get("Metric Name"))] = (row.get("Metric Value"), row.get("Metric Unit"))
    raw_by_id = {r["ID"]: r for r in raw if r.get("ID", "").isdigit()}
    for kid, k in kernels.items():
        lines.append(f"[{kid}] {k['name']}")
        for label, sec, met in _DETAILS:
            v = k["m"].get((sec, met))
            if v:
                lines.append(f"  {label:26s} {v[0]} {v[1] or ''}".rstrip())
        r = raw_by_id.get(kid, {})
        for label, m in (("tensor pipe active", "sm__pipe_tensor_cycles_active"), ("GMMA inst issued", "sm__inst_executed_pipe_tensor_op_gmma")):
            v = r.get(m + ".avg.pct_of_peak_sustained_active")
            if v:
                lines.append(f"  {label:26s} {v} % of peak")
        stalls = []
        for m, v in r.items():
            if m.startswith("smsp__average_warps_issue_stalled_") and m.endswith("_per_issue_active.ratio"):
                try:
                    stalls.append((float(v.replace(",", "")), m[len("smsp__average_warps_issue_stalled_") : -len("_per_issue_active.ratio")]))
                except ValueError:
                    pass
        if stalls:
            top = ", ".join(f"{n} {x:.2f}" for x, n in sorted(stalls, reverse=True)[:5])
            lines.append(f"  {'top stalls (cyc/issue)':26s} {top}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_target(SHAPES[sys.argv[1]])
