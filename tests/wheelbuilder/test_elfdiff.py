"""wheelbuilder.elfdiff on small ELF objects compiled here with the C compiler, loose and inside wheels."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from wheelbuilder.__main__ import main
from wheelbuilder.elfdiff import diff_elf, explain

SOURCE = """
static int counter;
const char banner[] = "built in %s";
int %s(int x) { counter += x; return counter * 3; }
int shared_helper(void) { return counter; }
"""


def compile_object(tmp_path: Path, name: str, directory: str, function: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / name).mkdir()
    src = tmp_path / name / "ext.c"  # one file name: it is a symbol (STT_FILE) of the object
    src.write_text(SOURCE % (directory, function))
    obj = tmp_path / name / "ext.o"
    subprocess.run([cc, "-c", "-O2", "-fPIC", str(src), "-o", str(obj)], check=True)
    return obj


@pytest.fixture()
def objects(tmp_path: Path) -> tuple[Path, Path, Path]:
    a = compile_object(tmp_path, "a", "/build/one", "kernel_62")
    a2 = compile_object(tmp_path, "a2", "/build/one", "kernel_62")
    b = compile_object(tmp_path, "b", "/build/two", "kernel_61")
    return a, a2, b


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(zipfile.ZipInfo(name, (2025, 1, 1, 0, 0, 0)), data)
    return path


def test_identical_objects_have_nothing_to_report(objects):
    a, a2, _ = objects
    assert a.read_bytes() == a2.read_bytes()  # one compiler, one source: the premise
    assert explain(a, a2) == []
    assert diff_elf(a.read_bytes(), a2.read_bytes()).identical


def test_differing_objects_name_their_sections_and_symbols(objects):
    a, _, b = objects
    d = diff_elf(a.read_bytes(), b.read_bytes())
    names = [s.name for s in d.sections]
    assert ".rodata" in names and ".strtab" in names and ".text" not in names  # same code, other string and name
    assert d.only_in_a == ["kernel_62"] and d.only_in_b == ["kernel_61"]
    assert "shared_helper" not in d.only_in_a + d.only_in_b
    rodata = next(s for s in d.sections if s.name == ".rodata")
    assert rodata.size_a == rodata.size_b and rodata.first_offset == len("built in /build/")
    assert "one" in rodata.context_a and "two" in rodata.context_b
    text = "\n".join(explain(a, b))
    assert "symbols only in A (1): kernel_62" in text and "symbols only in B (1): kernel_61" in text
    assert "sections differing: " in text and ".rodata" in text


def test_wheels_are_compared_member_by_member(objects, tmp_path: Path):
    a, _, b = objects
    record = b"pkg/ext.so,sha256=...,1\n"
    wa = make_wheel(tmp_path / "A.whl", {"pkg/__init__.py": b"", "pkg/ext.so": a.read_bytes(), "RECORD": record})
    wb = make_wheel(tmp_path / "B.whl", {"pkg/__init__.py": b"", "pkg/ext.so": b.read_bytes(),
                                         "RECORD": record.replace(b"1", b"2"), "extra.txt": b"x"})
    lines = explain(wa, wb)
    text = "\n".join(lines)
    assert "members only in B: extra.txt" in text
    assert "pkg/ext.so:" in text and "kernel_61" in text
    assert "RECORD:" in text and "first difference at byte" in text
    assert "pkg/__init__.py" not in text  # identical members are not reported
    # The same members in another order: the report says only the archive differs.
    wc = make_wheel(tmp_path / "C.whl", {"RECORD": record, "pkg/ext.so": a.read_bytes(), "pkg/__init__.py": b""})
    assert "archive itself differs" in "\n".join(explain(wa, wc))


def test_cli_exit_status(objects, capsys):
    a, a2, b = objects
    assert main(["diff", str(a), str(a2)]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 1
    assert "kernel_62" in capsys.readouterr().out
    assert main(["diff", str(a), str(a.with_name("missing.o"))]) == 1
    assert "no such file" in capsys.readouterr().err
