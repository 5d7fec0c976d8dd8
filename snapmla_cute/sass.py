"""What CI can see of the GPU code without a GPU: registers, local memory, MMA instructions.

``kernel_resources(cubin)`` reads the ELF of a cubin (register count from each kernel's
``.text`` section header, frame size from ``.nv.info``); ``sass_counts(sass)`` counts the
instructions that matter in an nvdisasm listing.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

_EIATTR_FRAME_SIZE = 0x11


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    frame_bytes: int  # per-thread stack frame (local memory) the compiler reserved


@dataclass(frozen=True)
class SassCounts:
    qgmma: int  # FP8 warpgroup MMAs (e4m3/e5m2)
    hgmma: int  # 16-bit warpgroup MMAs (bf16/fp16)
    local_ld: int  # LDL: local-memory loads (spills, stack arrays)
    local_st: int  # STL
    instructions: int
    # longest run of GMMAs with no WARPGROUP.DEPBAR between them: 1 when ptxas serialized the
    # warpgroup MMAs (C7511 "insufficient register resources for the wgmma pipeline": every
    # GMMA then waits for the previous one), the QK chain's length (20) when it did not
    gmma_run: int = 0

    @property
    def local_traffic(self) -> int:
        return self.local_ld + self.local_st


def _sections(elf: bytes):
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = []
    for i in range(shnum):
        off = shoff + i * shentsize
        name, _type, _flags, _addr, offset, size, _link, info = struct.unpack_from(
            "<IIQQQQII", elf, off
        )
        headers.append((name, offset, size, info))
    str_off = headers[shstrndx][1]

    def sec_name(idx: int) -> str:
        end = elf.index(b"\x00", str_off + idx)
        return elf[str_off + idx : end].decode()

    return [(sec_name(n), off, size, info) for n, off, size, info in headers]


_EIATTR_REGCOUNT = 0x2F


def _per_symbol_attrs(blob: bytes) -> dict[int, dict[int, int]]:
    """``.nv.info`` entries of the form (symbol index, value), grouped by symbol."""
    attrs: dict[int, dict[int, int]] = {}
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr, size = blob[pos], blob[pos + 1], struct.unpack_from("<H", blob, pos + 2)[0]
        if fmt == 0x04:  # EIFMT_SVAL: `size` payload bytes follow
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
                sym, value = struct.unpack_from("<II", blob, pos + 4)
                attrs.setdefault(sym, {})[attr] = value
            pos += 4 + size
        else:  # EIFMT_NVAL / BVAL / HVAL: the value sits in the 4-byte header
            pos += 4
    return attrs


def _symbol_names(elf: bytes, secs) -> list[str]:
    by_name = {name: (off, size) for name, off, size, _ in secs}
    sym_off, sym_size = by_name[".symtab"]
    str_off, _ = by_name[".strtab"]
    names = []
    for i in range(sym_size // 24):
        (name_idx,) = struct.unpack_from("<I", elf, sym_off + 24 * i)
        end = elf.index(b"\x00", str_off + name_idx)
        names.append(elf[str_off + name_idx : end].decode())
    return names


def kernel_resources(cubin: bytes) -> list[KernelResources]:
    """Registers and stack-frame bytes of every kernel in a cubin."""
    secs = _sections(cubin)
    names = _symbol_names(cubin, secs)
    attrs: dict[str, dict[int, int]] = {}
    for name, off, size, _ in secs:
        if name == ".nv.info":
            for sym, vals in _per_symbol_attrs(cubin[off : off + size]).items():
                attrs.setdefault(names[sym], {}).update(vals)
    out = []
    for name, *_ in secs:
        if name.startswith(".text."):
            func = name[len(".text.") :]
            vals = attrs.get(func, {})
            out.append(
                KernelResources(
                    func,
                    registers=vals.get(_EIATTR_REGCOUNT, 0),
                    frame_bytes=vals.get(_EIATTR_FRAME_SIZE, 0),
                )
            )
    return out


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_counts(sass: str) -> SassCounts:
    opcodes = [m.group(2) for m in _INSTR.finditer(sass)]
    base = [op.split(".")[0] for op in opcodes]
    run = best = 0
    for op, full in zip(base, opcodes):
        if op in ("QGMMA", "HGMMA"):
            run += 1
            best = max(best, run)
        elif full.startswith("WARPGROUP.DEPBAR"):
            run = 0
    return SassCounts(
        qgmma=base.count("QGMMA"),
        hgmma=base.count("HGMMA"),
        local_ld=base.count("LDL"),
        local_st=base.count("STL"),
        instructions=len(opcodes),
        gmma_run=best,
    )
