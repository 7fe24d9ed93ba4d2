"""Explain why two wheels (or two ELF files) differ: which members, which ELF sections, which symbols.

    python -m wheelbuilder diff A.whl B.whl      (exit 0: identical bytes, 1: they differ,
                                                  6: a wheel is damaged and cannot be read whole)

Two builds of one target should give identical wheels (README "Reproducibility"); when they do not,
a sha256 alone says nothing about why. This names the differing ELF sections with the offset of their
first differing byte and the readable text around it, and the first symbols that are in one file and
not the other (nvcc's `_INTERNAL_<module id>` names are where a process id showed).
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from .errors import AuditError

ELF_MAGIC = b"\x7fELF"
ZIP_MAGIC = b"PK\x03\x04"  # a zip's first local file header
SHOW = 5  # symbols (and members) listed per direction before "... and N more"


@dataclass
class SectionDiff:
    name: str
    size_a: int | None  # None: the section is missing from that file
    size_b: int | None
    first_offset: int | None = None  # first differing byte inside the section (None: one side missing)
    context_a: str = ""
    context_b: str = ""

    def describe(self) -> str:
        if self.size_a is None or self.size_b is None:
            side = "A" if self.size_a is None else "B"
            return f"{self.name}: missing from {side}"
        text = f"{self.name}: {self.size_a} vs {self.size_b} bytes"
        if self.first_offset is not None:
            text += f", first difference at +{self.first_offset:#x}"
            if self.context_a or self.context_b:
                text += f" (A {self.context_a!r}, B {self.context_b!r})"
        return text


@dataclass
class ElfDiff:
    sections: list[SectionDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)  # symbol names, in symbol-table order
    only_in_b: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # same name, other value or size

    @property
    def identical(self) -> bool:
        return not (self.sections or self.only_in_a or self.only_in_b or self.changed)

    def describe(self, indent: str = "  ") -> list[str]:
        lines = [f"{indent}sections differing: {', '.join(s.name for s in self.sections) or 'none'}"]
        lines += [f"{indent}  {s.describe()}" for s in self.sections]
        for label, names in (("symbols only in A", self.only_in_a), ("symbols only in B", self.only_in_b),
                             ("symbols with another value or size", self.changed)):
            if names:
                more = f" ... and {len(names) - SHOW} more" if len(names) > SHOW else ""
                lines.append(f"{indent}{label} ({len(names)}): {', '.join(names[:SHOW])}{more}")
        return lines


def _readable(data: bytes, offset: int, span: int = 24) -> str:
    """The printable text around `offset` (names, paths), with other bytes as '.'."""
    chunk = data[max(0, offset - span):offset + span]
    return re.sub(rb"[^\x20-\x7e]", b".", chunk).decode("ascii")


def _first_difference(a: bytes, b: bytes) -> int | None:
    n = min(len(a), len(b))
    for start in range(0, n, 4096):  # compare blocks first: sections run to tens of MB
        if a[start:start + 4096] != b[start:start + 4096]:
            return next(i for i in range(start, min(start + 4096, n)) if a[i] != b[i])
    return None if len(a) == len(b) else n


def _symbols(elf: ELFFile) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for sec in elf.iter_sections():
        if isinstance(sec, SymbolTableSection):
            for sym in sec.iter_symbols():
                if sym.name:
                    out.setdefault(sym.name, (sym["st_value"], sym["st_size"]))
    return out


def diff_elf(a: bytes, b: bytes) -> ElfDiff:
    """Sections (by name) whose bytes differ, and the symbols that differ, of two ELF images."""
    ea, eb = ELFFile(io.BytesIO(a)), ELFFile(io.BytesIO(b))
    secs_a = {s.name: s for s in ea.iter_sections() if s.name}
    secs_b = {s.name: s for s in eb.iter_sections() if s.name}
    result = ElfDiff()
    for name in [*secs_a, *(n for n in secs_b if n not in secs_a)]:
        sa, sb = secs_a.get(name), secs_b.get(name)
        if sa is None or sb is None:
            result.sections.append(SectionDiff(name, sa and sa.data_size, sb and sb.data_size))
            continue
        da, db = sa.data(), sb.data()
        if da == db:
            continue
        at = _first_difference(da, db)
        result.sections.append(SectionDiff(name, len(da), len(db), at, _readable(da, at), _readable(db, at)))
    syms_a, syms_b = _symbols(ea), _symbols(eb)
    result.only_in_a = [n for n in syms_a if n not in syms_b]
    result.only_in_b = [n for n in syms_b if n not in syms_a]
    result.changed = [n for n in syms_a if n in syms_b and syms_a[n] != syms_b[n]]
    return result


def _is_elf(data: bytes) -> bool:
    return data[:4] == ELF_MAGIC


def _members(path: Path) -> dict[str, bytes]:
    """A wheel's (zip's) members by name, or {name: bytes} of a loose file. A wheel that cannot be read
    whole is an AuditError: comparing what could be read of it would report made-up differences."""
    fix = ("The file was cut short or altered after the build (a copy that did not finish, a bad disk): copy it "
           "again or rebuild it, and compare its sha256 with manifest.json "
           "(`python -m wheelbuilder verify --dir DIR`).")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}
        # a bad CRC, a damaged deflate stream, a member cut short, an unknown compression method
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
            raise AuditError(f"{path} is damaged: a member cannot be read ({type(e).__name__}: {e}). {fix}") from None
    with open(path, "rb") as f:
        head = f.read(4)
    if path.suffix in (".whl", ".zip") or head == ZIP_MAGIC:
        why = ("it starts as a zip archive but its central directory (the end of the file) is missing"
               if head == ZIP_MAGIC else "it is not a zip archive, which every wheel is")
        raise AuditError(f"{path} is damaged: {why}. {fix}")
    return {path.name: path.read_bytes()}


def explain(a: Path, b: Path) -> list[str]:
    """Report lines on how `a` and `b` differ (wheels: member by member, ELF members section by
    section); [] when their bytes are identical."""
    if a.read_bytes() == b.read_bytes():
        return []
    lines = [f"{a} and {b} differ:"]
    ma, mb = _members(a), _members(b)
    if not zipfile.is_zipfile(a) and not zipfile.is_zipfile(b):
        ma, mb = {"file": ma[a.name]}, {"file": mb[b.name]}  # two loose files: compare them whatever their names
    for label, names in (("only in A", [n for n in ma if n not in mb]), ("only in B", [n for n in mb if n not in ma])):
        if names:
            lines.append(f"members {label}: {', '.join(names)}")
    same_names = [n for n in ma if n in mb]
    differing = [n for n in same_names if ma[n] != mb[n]]
    if not differing and len(same_names) == len(ma) == len(mb):
        lines.append("every member has the same bytes: the archive itself differs (order, timestamps, compression)")
    for name in differing:
        da, db = ma[name], mb[name]
        lines.append(f"{name}: {len(da)} vs {len(db)} bytes, sha256 {hashlib.sha256(da).hexdigest()[:12]} vs "
                     f"{hashlib.sha256(db).hexdigest()[:12]}")
        if _is_elf(da) and _is_elf(db):
            try:
                lines += diff_elf(da, db).describe()
            except (ELFError, ValueError, KeyError) as e:  # a damaged ELF: say so, keep the rest of the report
                lines.append(f"  not readable as ELF ({e})")
        else:
            at = _first_difference(da, db)
            if at is not None:
                lines.append(f"  first difference at byte {at} (A {_readable(da, at)!r}, B {_readable(db, at)!r})")
    return lines
