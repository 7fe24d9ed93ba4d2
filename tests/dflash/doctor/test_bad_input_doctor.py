"""Bad input for the doctor (`dflash doctor`, `dflash healthcheck`) and its arch check: each case runs the
real command line (or the check the doctor runs) and asserts the exit code, the key words of the message,
no traceback, and that the directory it was pointed at holds nothing new.

Exit codes (dflash/doctor/doctor.py, healthcheck.py): 2 a bad option, found before any check runs;
1 unhealthy / a required check failed.
"""

from __future__ import annotations

import _ctypes
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import pytest

from tests.support.bad_input import assert_clear_failure, snapshot
from dflash.doctor import healthcheck
from dflash.doctor import doctor
from dflash.doctor.checks import check_arch
from dflash.doctor.verdict import FAIL, SCHEMA_VERSION


def write(name: str, text: str) -> Callable[[Path], Path]:
    def make(t: Path) -> Path:
        (t / name).write_text(text)
        return t / name
    return make


def verdict(**data) -> str:
    return json.dumps({"schema": SCHEMA_VERSION, **data})


@dataclass
class Case:
    id: str
    prog: Callable[[list[str]], int]
    argv: Callable[[Path], list[str]]
    code: int
    words: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def report_args(make_report, make_beat=None):
    """healthcheck --report R --heartbeat H (a heartbeat that is missing unless made)."""
    return lambda t: ["--report", str(make_report(t)), "--heartbeat", str(make_beat(t) if make_beat else t / "nobeat")]


HEALTHY = write("doctor.json", verdict(ok=True, checks=[], failed=[]))

CASES = [
    Case("expect-arch-unknown", doctor.main, lambda t: ["--expect-arch", "13.7"], 2, ("13.7", "not a GPU arch")),
    Case("expect-arch-env-unknown", doctor.main, lambda t: [], 2, ("DFLASH_EXPECT_ARCHES", "13.7", "not a GPU arch"),
         {"DFLASH_EXPECT_ARCHES": "13.7"}),
    Case("expect-arch-no-minor", doctor.main, lambda t: ["--expect-arch", "12"], 2, ("MAJOR.MINOR",)),
    Case("expect-arch-garbage", doctor.main, lambda t: ["--expect-arch", "blackwell"], 2, ("'blackwell'", "sm_120")),
    Case("expect-arch-commas", doctor.main, lambda t: ["--expect-arch", ",,"], 2, ("names no arch",)),
    Case("expect-arch-env-partly-bad", doctor.main, lambda t: [], 2, ("'banana'",), {"DFLASH_EXPECT_ARCHES": "9.0,banana"}),
    Case("save-to-directory", doctor.main, lambda t: ["--save", str(t)], 2, ("--save", "name a file")),
    Case("save-under-a-file", doctor.main, lambda t: ["--save", str(write("f", "x")(t) / "doctor.json")], 2,
         ("Not a directory",)),
    Case("save-unwritable", doctor.main, lambda t: ["--save", "/proc/doctor/doctor.json"], 2,
         ("cannot write the verdict", "writable directory")),
    Case("unknown-option", doctor.main, lambda t: ["--expect-gpu"], 2, ("unrecognized arguments",)),
    Case("max-age-negative", healthcheck.main, lambda t: ["--max-age", "-5"], 2, ("--max-age", "positive")),
    Case("max-age-env-garbage", healthcheck.main, report_args(HEALTHY), 2, ("DFLASH_HEARTBEAT_MAX_AGE='soon'",),
         {"DFLASH_HEARTBEAT_MAX_AGE": "soon"}),
    Case("verdict-missing", healthcheck.main, report_args(lambda t: t / "none.json"), 1, ("has not finished",)),
    Case("verdict-not-json", healthcheck.main, report_args(write("doctor.json", "{ok")), 1,
         ("unreadable", "rerun `dflash doctor --save")),
    Case("verdict-binary", healthcheck.main, report_args(lambda t: (t / "d.json").write_bytes(b"\xff\xfe\x00")
                                                         and t / "d.json"), 1, ("unreadable",)),
    Case("verdict-a-list", healthcheck.main, report_args(write("doctor.json", "[1]")), 1, ("not a JSON object",)),
    Case("verdict-old-schema", healthcheck.main, report_args(write("doctor.json", '{"schema": 0, "ok": true}')), 1,
         ("schema 0",)),
    Case("verdict-checks-damaged", healthcheck.main, report_args(write("doctor.json", verdict(
        ok=False, checks=[1], failed=["arch"]))), 1, ("damaged", "rerun")),
    Case("verdict-failed-damaged", healthcheck.main, report_args(write("doctor.json", verdict(
        ok=False, checks=[], failed=5))), 1, ("damaged",)),
    Case("verdict-failed", healthcheck.main, report_args(write("doctor.json", verdict(
        ok=False, checks=[{"name": "arch", "reason": "no sm_120"}], failed=["arch"]))), 1, ("arch: no sm_120",)),
    Case("heartbeat-garbage", healthcheck.main, report_args(HEALTHY, write("beat", "{")), 1, ("heartbeat", "unreadable")),
    Case("heartbeat-no-time", healthcheck.main, report_args(HEALTHY, write("beat", '{"step": 3}')), 1,
         ("no numeric 'time'",)),
    Case("heartbeat-stale", healthcheck.main, report_args(HEALTHY, write("beat", json.dumps(
        {"time": time.time() - 4000, "step": 7}))), 1, ("stalled", "step 7")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, monkeypatch, capsys):
    for name in ("DFLASH_EXPECT_ARCHES", "DFLASH_HEARTBEAT_MAX_AGE", "DFLASH_DOCTOR_REPORT"):
        monkeypatch.delenv(name, raising=False)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    argv = case.argv(tmp_path)
    before = snapshot(tmp_path)
    try:
        code = case.prog(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert_clear_failure(code, case.code, out + err, case.words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("expected", [None, [120]])
def test_arch_check_fails_an_extension_without_device_code(expected):
    """A .so with no fatbin runs on no GPU: FAIL, also when no expected arch is known."""
    result = check_arch(_ctypes.__file__, gpus=[], expected=expected)
    assert result.status == FAIL
    assert "no device code at all" in result.reason and "make wheels" in result.reason


def test_arch_check_fails_a_file_that_is_not_elf(tmp_path):
    so = write("causal_conv1d_cuda.so", "not an ELF")(tmp_path)
    result = check_arch(str(so), gpus=[], expected=[120])
    assert result.status == FAIL and "cannot read the fatbin" in result.reason
