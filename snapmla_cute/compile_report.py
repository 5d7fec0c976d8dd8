"""Compile every kernel for a target arch (no GPU needed) and report what the SASS shows."""

from __future__ import annotations

from snapmla_cute import jit_cache
from snapmla_cute.sass import kernel_resources, sass_counts


def compile_report(arch: str = "sm_90a", names=jit_cache.KERNEL_NAMES) -> list[dict]:
    rows = []
    for name in names:
        compiled = jit_cache.compile_kernel(name, arch=arch, keep_sass=True)
        art = compiled.artifacts
        counts = sass_counts(str(art.SASS or ""))
        for res in kernel_resources(art.CUBIN):
            rows.append(
                dict(
                    kernel=name,
                    config=repr(compiled.config),
                    arch=arch,
                    registers=res.registers,
                    frame_bytes=res.frame_bytes,
                    local_ld=counts.local_ld,
                    local_st=counts.local_st,
                    qgmma=counts.qgmma,
                    hgmma=counts.hgmma,
                    sass_instructions=counts.instructions,
                )
            )
    return rows


def print_report(rows):
    from tabulate import tabulate

    print(tabulate(rows, headers="keys"))
