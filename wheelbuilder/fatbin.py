"""Read the CUDA fatbins embedded in an ELF file (.so or .o) without `cuobjdump`.

A CUDA host object carries its device code in ELF sections that hold one or more *fatbin containers*
back to back (checked on nvcc 13.0 output):

    .nv_fatbin       the loadable device code (normal objects, and every linked .so); a linked .so
                     holds one container per object file plus one from nvcc's device-link step
    __nv_relfatbin   relocatable device code (`-rdc=true` objects, and the copy a -rdc .so keeps
                     for later device links; the CUDA runtime never loads it)
    .nvFatBinSegment no code: 24-byte `__fatBinC_Wrapper_t` records (magic 0x466243B1, version,
                     pointer into .nv_fatbin, ...) that the runtime registers at load time

Container and entry layout (little endian; offsets verified on sm_90/sm_120, PTX, `-G`,
`--compress-mode`, `-Xfatbin -compress-all`, `sm_120a`/`sm_120f` output of nvcc 13.0):

    container header (16 bytes)          entry header (64 bytes, or longer: 72 / 80 / 96 / 112)
    +0  u32 magic 0xBA55ED50             +0  u16 kind (1 = PTX, 2 = SASS as a cubin ELF)
    +4  u16 version (1)                  +2  u16 version (0x0101)
    +6  u16 header size (16)             +4  u32 header size (payload starts here)
    +8  u64 payload size (all entries)   +8  u64 payload size (8-byte aligned, as stored)
                                         +16 u32 compressed size (0 when stored plain)
                                         +24 u16 code version minor, +26 u16 major
                                             (ELF: 1.8; PTX: the PTX ISA, 9.0 on CUDA 13.0)
                                         +28 u32 SM number (90, 120, ...)
                                         +40 u64 flags
                                         +56 u64 uncompressed size (when compressed)

Flags seen: 0x1 64-bit, 0x2 debug (-G), 0x10 Linux, 0x2000 LZ4-compressed (CUDA <= 12.x),
0x8000 ZSTD-compressed (CUDA >= 12.8 compresses PTX by default, SASS with `--compress-mode=size`),
0x100000 arch-specific code (sm_120a), 0x200000 family-specific code (sm_120f).

Compatibility rules (CUDA C Programming Guide, "Binary Compatibility" and "Application Compatibility";
CUDA 12.9 release notes for the `a`/`f` suffixes):
  * SASS for X.y runs on devices X.z with z >= y (same major only); `sm_XYa` SASS runs on X.Y only;
    `sm_XYf` SASS runs within its family (same major, z >= y), like plain SASS.
  * PTX for X.y JIT-compiles for any device of compute capability >= X.y (any major), when the
    driver is at least as new as the toolkit that wrote the PTX; `compute_XYa` PTX only for X.Y.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from .errors import AuditError

FATBIN_MAGIC = 0xBA55ED50
CONTAINER_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, payload size
ENTRY_HEADER = struct.Struct("<HHIQIIHHI")  # kind, version, header size, payload size, compressed size,
#                                           unknown, code minor, code major, SM number
ENTRY_MIN_HEADER = 64
FLAGS_OFFSET = 40
UNCOMPRESSED_SIZE_OFFSET = 56

KINDS = {1: "ptx", 2: "sass"}
FLAG_COMPRESSED_LZ4 = 0x2000
FLAG_COMPRESSED_ZSTD = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY_SPECIFIC = 0x200000

# Loadable sections first: arch_summary() only falls back to relocatable code when nothing else exists.
LOADABLE_SECTION = ".nv_fatbin"
RELOCATABLE_SECTION = "__nv_relfatbin"
FATBIN_SECTIONS = (LOADABLE_SECTION, RELOCATABLE_SECTION)


@dataclass(frozen=True)
class FatbinEntry:
    """One piece of device code in a fatbin.

    kind: "sass" (a cubin for one SM) or "ptx" (virtual ISA, JIT-compiled by the driver).
    sm: the SM number (120 for compute capability 12.0).
    size: bytes of the code itself (uncompressed size when the entry is compressed).
    compressed: the payload is LZ4/ZSTD compressed (flags 0x2000 / 0x8000).
    variant: "" for plain code, "a" for arch-specific (sm_120a), "f" for family-specific (sm_120f).
    section: the ELF section it came from (".nv_fatbin" or "__nv_relfatbin").
    """

    kind: str
    sm: int
    size: int
    compressed: bool
    variant: str = ""
    section: str = LOADABLE_SECTION

    @property
    def name(self) -> str:
        """nvcc's spelling: sm_120, sm_90a, compute_90."""
        return ("sm_" if self.kind == "sass" else "compute_") + f"{self.sm}{self.variant}"


def _entries_in_container(data: bytes, start: int, section: str, where: str) -> tuple[list[FatbinEntry], int]:
    """Parse the container at `start`; return its entries and the offset just past it."""
    magic, _version, header_size, payload_size = CONTAINER_HEADER.unpack_from(data, start)
    end = start + header_size + payload_size
    if magic != FATBIN_MAGIC or header_size < CONTAINER_HEADER.size or end > len(data):
        raise AuditError(
            f"{where}: section {section} holds a damaged fatbin at offset {start} (magic {magic:#x}, "
            f"header {header_size} bytes, payload {payload_size} bytes, section {len(data)} bytes). "
            "The file is truncated or not written by nvcc; rebuild it."
        )
    entries, pos = [], start + header_size
    while pos < end:
        if pos + ENTRY_MIN_HEADER > end:
            raise AuditError(f"{where}: fatbin entry at offset {pos} of {section} is cut short; rebuild the file.")
        kind, _v, ehead, esize, csize, _u, _minor, _major, sm = ENTRY_HEADER.unpack_from(data, pos)
        if ehead < ENTRY_MIN_HEADER or pos + ehead + esize > end:
            raise AuditError(
                f"{where}: fatbin entry at offset {pos} of {section} claims header {ehead} and payload "
                f"{esize} bytes, past its container's end ({end}); the file is damaged, rebuild it."
            )
        (flags,) = struct.unpack_from("<Q", data, pos + FLAGS_OFFSET)
        compressed = bool(flags & (FLAG_COMPRESSED_LZ4 | FLAG_COMPRESSED_ZSTD))
        size = esize
        if compressed:
            (size,) = struct.unpack_from("<Q", data, pos + UNCOMPRESSED_SIZE_OFFSET)
        variant = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY_SPECIFIC else ""
        if kind in KINDS:  # other kinds (e.g. 0x40, seen in vendor libraries) carry no arch coverage
            entries.append(FatbinEntry(KINDS[kind], sm, size, compressed, variant, section))
        pos += ehead + esize
    return entries, end


def parse_fatbin_section(data: bytes, section: str = LOADABLE_SECTION, where: str = "<bytes>") -> list[FatbinEntry]:
    """All entries of every container in one section's bytes.

    Containers follow each other, each padded to 8 bytes; zero padding between them is skipped and
    any other byte is an error (a format change must be loud, never a silently missed arch).
    """
    entries: list[FatbinEntry] = []
    pos = 0
    while pos + CONTAINER_HEADER.size <= len(data):
        if struct.unpack_from("<I", data, pos)[0] == FATBIN_MAGIC:
            found, pos = _entries_in_container(data, pos, section, where)
            entries += found
        elif not any(data[pos:pos + 8]):
            pos += 8
        else:
            raise AuditError(
                f"{where}: section {section} has unrecognised bytes at offset {pos} "
                f"({data[pos:pos + 8].hex()}); expected a fatbin (magic {FATBIN_MAGIC:#x}). "
                "This nvcc may write a newer fatbin format; check the file with `cuobjdump --list-elf`."
            )
    return entries


def _open_elf(source: Path | str | BinaryIO, where: str) -> ELFFile:
    stream = source if hasattr(source, "read") else open(source, "rb")
    try:
        return ELFFile(stream)
    except ELFError as e:
        raise AuditError(f"{where} is not an ELF file ({e}); point this at a compiled .so or .o.") from None


def _with_elf(source: Path | str | BinaryIO, fn):
    """Run fn(elf) on a path or an open binary stream, closing only what we opened."""
    where = getattr(source, "name", None) or str(source)

    def guarded(stream):
        try:
            return fn(_open_elf(stream, where), where)
        except (ELFError, struct.error, EOFError, ValueError) as e:  # a header pointing past the end, ...
            raise AuditError(f"{where} is a damaged ELF file ({type(e).__name__}: {e}); it was truncated or "
                             "altered after the build: rebuild or copy it again.") from None

    if hasattr(source, "read"):
        return guarded(source)
    if not Path(source).is_file():
        raise AuditError(f"{source} does not exist or is not a file; give the path of a compiled .so or .o.")
    with open(source, "rb") as f:
        return guarded(f)


def read_fatbin(path: Path | str | BinaryIO) -> list[FatbinEntry]:
    """Every PTX and SASS entry of every fatbin in the ELF file, in file order (loadable first)."""

    def read(elf: ELFFile, where: str) -> list[FatbinEntry]:
        entries = []
        for name in FATBIN_SECTIONS:
            section = elf.get_section_by_name(name)
            if section is not None and section["sh_type"] != "SHT_NOBITS":
                entries += parse_fatbin_section(section.data(), name, where)
        return entries

    return _with_elf(path, read)


def needed_libraries(path: Path | str | BinaryIO) -> list[str]:
    """The DT_NEEDED entries of a shared object (what the dynamic loader must find), in file order."""

    def read(elf: ELFFile, where: str) -> list[str]:
        dynamic = elf.get_section_by_name(".dynamic")
        if dynamic is None:
            return []
        return [tag.needed for tag in dynamic.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]

    return _with_elf(path, read)


def summarize(entries: list[FatbinEntry]) -> dict[str, list[int]]:
    """{"sass": sorted SMs, "ptx": sorted SMs, "arch_specific": SMs whose code is only for that exact
    SM (`a` suffix)} from a list of entries; relocatable code counts only when nothing loadable exists."""
    loadable = [e for e in entries if e.section == LOADABLE_SECTION] or entries
    return {
        "sass": sorted({e.sm for e in loadable if e.kind == "sass"}),
        "ptx": sorted({e.sm for e in loadable if e.kind == "ptx"}),
        # an SM counts as arch-specific only when all of its code is (a plain copy beside it runs wider)
        "arch_specific": sorted({e.sm for e in loadable if e.variant == "a"}
                                - {e.sm for e in loadable if e.variant != "a"}),
    }


def arch_summary(path: Path | str | BinaryIO) -> dict[str, list[int]]:
    """{"sass": [120], "ptx": [90], "arch_specific": []}: which SMs the file's device code covers."""
    return summarize(read_fatbin(path))


def covers(summary: dict[str, list[int]], sm: int) -> tuple[bool, str]:
    """Can a GPU of compute capability `sm` (120 for 12.0) run code with this arch summary?

    Returns (ok, reason); the reason names the code that serves the GPU, or what is missing and why.
    """
    major, minor = divmod(sm, 10)
    specific = set(summary.get("arch_specific", ()))
    sass, ptx = summary.get("sass", []), summary.get("ptx", [])
    if sm in sass:
        return True, f"SASS sm_{sm} runs natively on compute capability {major}.{minor}."
    native = [s for s in sass if s // 10 == major and s % 10 <= minor and s not in specific]
    if native:
        best = max(native)
        return True, (f"SASS sm_{best} runs on compute capability {major}.{minor} "
                      f"(SASS runs on the same major version at an equal or higher minor).")
    jit = [p for p in ptx if p <= sm and (p not in specific or p == sm)]
    if jit:
        best = max(jit)
        return True, (f"no SASS for {major}.{minor}; PTX compute_{best} JIT-compiles to it at first load "
                      "(slower start; needs a driver at least as new as the CUDA that built it).")
    suffix = {s: "a" for s in specific}
    have = ", ".join([f"sm_{s}{suffix.get(s, '')}" for s in sass] + [f"compute_{p}{suffix.get(p, '')}" for p in ptx])
    have = have or "no device code at all"
    return False, (f"nothing runs on compute capability {major}.{minor}: the file holds {have}. "
                   f"SASS only runs within one major version at an equal or higher minor, PTX only "
                   f"JIT-compiles upward. Rebuild for arch {major}.{minor} "
                   f"(targets.toml `arches`, or `--arch {major}.{minor}`).")


def main(argv: list[str] | None = None) -> int:
    """`python -m wheelbuilder.fatbin FILE...`: list each file's fatbin entries (or --json summary)."""
    parser = argparse.ArgumentParser(prog="python -m wheelbuilder.fatbin", description=main.__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="compiled .so or .o files")
    parser.add_argument("--json", action="store_true", help="print the arch summary of each file as JSON")
    parser.add_argument("--sm", type=int, help="also say whether a GPU of this SM (e.g. 120) is covered")
    args = parser.parse_args(argv)
    try:
        report = {}
        for f in args.files:
            entries = read_fatbin(f)
            summary = summarize(entries)
            report[str(f)] = {"summary": summary, "entries": [asdict(e) for e in entries]}
            if args.sm is not None:
                report[str(f)]["covers"] = dict(zip(("ok", "reason"), covers(summary, args.sm)))
    except AuditError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for f, r in report.items():
            print(f"{f}: SASS {r['summary']['sass']}, PTX {r['summary']['ptx']}")
            for e in r["entries"]:
                print(f"  {e['kind']:4} {e['sm']:>4}{e['variant']:1} {e['size']:>10} bytes"
                      f"{'  compressed' if e['compressed'] else ''}  [{e['section']}]")
            if "covers" in r:
                print(f"  sm_{args.sm}: {'ok' if r['covers']['ok'] else 'NOT COVERED'}: {r['covers']['reason']}")
    return 1 if any(not r.get("covers", {"ok": True})["ok"] for r in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
