"""Bad input and faults for `python -m wheelbuilder`: each case runs the real command line and checks the
exit code (wheelbuilder/errors.py), the key words of the message, that no traceback is printed and that
the output directories hold nothing new. SIGTERM/SIGINT mid-compile run the build double
(tests/support/wheelbuilder_double.py) in a subprocess, so signals reach a real process with real children.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import pytest

from tests.support.bad_input import assert_clear_failure, snapshot
from wheelbuilder.__main__ import main
from common.fsutil import exclusive
from wheelbuilder.targets import load
from wheelbuilder.wheelfile import BUILD_INFO, build_info, repack_deterministic

REPO = Path(__file__).resolve().parents[2]
DOUBLE = REPO / "tests" / "support" / "wheelbuilder_double.py"
TARGET = "cu130-sm120"
EPOCH = 1735689600


def make_wheel(dest: Path) -> Path:
    """A causal-conv1d wheel of the CI target as the build repacks it (no module: audit would fail it)."""
    target = load().target(TARGET)
    recipe = target.recipes[0]
    version = f"{recipe.version}+{target.local_version()}"
    raw = dest / "raw" / f"causal_conv1d-{version}-cp311-cp311-linux_x86_64.whl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    dist_info = f"causal_conv1d-{version}.dist-info"
    with zipfile.ZipFile(raw, "w") as zf:
        zf.writestr("causal_conv1d/__init__.py", "x = 1\n" * 200)
        zf.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: causal_conv1d\nVersion: {version}\n")
        zf.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n")
    wheel = repack_deterministic(raw, dest, extra_files={BUILD_INFO: build_info(target, recipe)},
                                 source_date_epoch=EPOCH)
    for p in sorted(raw.parent.rglob("*"), reverse=True):
        p.unlink()
    raw.parent.rmdir()
    return wheel


def _member(wheel: Path, suffix: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(wheel) as zf:
        return next(i for i in zf.infolist() if i.filename.endswith(suffix))


def damage_deflate(wheel: Path) -> None:
    """BTYPE 11 (reserved) in the first deflate block of METADATA: zlib cannot decode it."""
    info = _member(wheel, "/METADATA")
    data = bytearray(wheel.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len] = 0xFF
    wheel.write_bytes(bytes(data))


def damage_crc(wheel: Path) -> None:
    """The central directory's CRC-32 of METADATA no longer matches its (intact) data."""
    data = bytearray(wheel.read_bytes())
    name = _member(wheel, "/METADATA").filename.encode()
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        name_len = struct.unpack_from("<H", data, pos + 28)[0]
        if bytes(data[pos + 46:pos + 46 + name_len]) == name:
            data[pos + 16] ^= 0xFF
            break
        pos = data.find(b"PK\x01\x02", pos + 4)
    wheel.write_bytes(bytes(data))


def manifest(tmp: Path, text: str) -> Path:
    d = tmp / "wheels"
    d.mkdir()
    (d / "manifest.json").write_text(text)
    return d


def fake_cuda(tmp: Path, executable: bool) -> Path:
    home = tmp / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755 if executable else 0o644)
    return home


def targets_file(tmp: Path, edit: Callable[[str], str], name: str = "targets.toml") -> Path:
    path = tmp / name
    path.write_text(edit((REPO / "targets.toml").read_text()))
    return path


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]]  # tmp -> arguments
    code: int
    words: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], dict[str, str]] | None = None  # tmp -> more environment


def build(*extra: str) -> Callable[[Path], list[str]]:
    return lambda t: ["build", "--target", TARGET, "--out", str(t / "out"), "--build-dir", str(t / "bd"), *extra]


def dry(*extra: str) -> Callable[[Path], list[str]]:
    return build("--dry-run", *extra)


def audit(make: Callable[[Path], Path]) -> Callable[[Path], list[str]]:
    return lambda t: ["audit", "--target", TARGET, str(make(t))]


def wheel_with(damage) -> Callable[[Path], Path]:
    def make(t: Path) -> Path:
        w = make_wheel(t / "wheels")
        damage(w)
        return w
    return make


def renamed(t: Path) -> Path:
    """A sound wheel whose file name says another version than its metadata."""
    w = make_wheel(t / "wheels")
    return w.rename(w.with_name(w.name.replace("1.7.0+", "1.7.1+")))


def diff(damage) -> Callable[[Path], list[str]]:
    return lambda t: ["diff", str(make_wheel(t / "good")), str(wheel_with(damage)(t))]


def file_with(name: str, data: bytes) -> Callable[[Path], Path]:
    def make(t: Path) -> Path:
        (t / "wheels").mkdir(exist_ok=True)
        (t / "wheels" / name).write_bytes(data)
        return t / "wheels" / name
    return make


WHEEL_NAME = "causal_conv1d-1.7.0+cu130torch2.11sm120-cp311-cp311-linux_x86_64.whl"
ENTRY = ('{"filename": "a.whl", "size": 1, "sha256": "%s", "recipe": "r", "recipe_version": "1", "source_url": "u", '
         '"source_sha256": "s", "target": "t", "arches": {}, "toolchain": %s, "build_seconds": 1, '
         '"source_date_epoch": 0}')

CASES = [
    Case("unknown-target", lambda t: ["build", "--target", "cu130-sm12", "--out", str(t / "out")], 2,
         ("unknown target", "Did you mean")),
    Case("arch-twice", build("--arch", "12.0,12.0"), 2, ("named twice", "12.0+PTX")),
    Case("arch-twice-ptx", build("--arch", "12.0,12.0+PTX"), 2, ("named twice",)),
    Case("arch-empty", build("--arch", ""), 2, ("--arch", "names no arch")),
    Case("arch-commas", build("--arch", ",,"), 2, ("names no arch",)),
    Case("arch-unknown", build("--arch", "13.7"), 2, ("13.7", "not a GPU arch")),
    Case("arch-malformed", build("--arch", "sm_120"), 2, ("MAJOR.MINOR",)),
    Case("arch-too-new-for-toolkit", lambda t: ["build", "--target", "cu128-sm120", "--arch", "12.1",
                                                "--out", str(t / "out")], 2, ("12.1", "needs CUDA")),
    Case("python-malformed", build("--python", "three"), 2, ("--python", "major.minor")),
    Case("python-too-old", build("--python", "3.8"), 2, ("3.8", "Python >= 3.10")),
    Case("max-jobs-banana", dry(), 2, ("MAX_JOBS='banana'", "positive whole number"), {"MAX_JOBS": "banana"}),
    Case("max-jobs-zero", dry(), 2, ("MAX_JOBS='0'",), {"MAX_JOBS": "0"}),
    Case("max-jobs-negative", dry(), 2, ("MAX_JOBS='-3'",), {"MAX_JOBS": "-3"}),
    Case("nvcc-threads-fraction", dry(), 2, ("NVCC_THREADS='2.5'", "unset it"), {"NVCC_THREADS": "2.5"}),
    Case("source-date-epoch-garbage", dry(), 2, ("SOURCE_DATE_EPOCH", "git log"), {"SOURCE_DATE_EPOCH": "yesterday"}),
    Case("nvcc-not-executable", dry(), 3, ("cannot be run", "chmod +x"),
         setup=lambda t: {"CUDA_HOME": str(fake_cuda(t, executable=False))}),
    Case("targets-file-missing", lambda t: ["--targets-file", str(t / "nope.toml"), "list"], 2, ("does not exist",)),
    Case("targets-file-not-toml", lambda t: ["--targets-file", str(file_with("t.toml", b"[targets\n")(t)), "list"], 2,
         ("not valid TOML",)),
    Case("targets-file-typo", lambda t: ["--targets-file", str(targets_file(t, lambda s: s.replace(
        "default_target", "defualt_target", 1))), "list"], 2, ("unknown key 'defualt_target'", "Did you mean")),
    Case("targets-file-arch-twice", lambda t: ["--targets-file", str(targets_file(t, lambda s: s.replace(
        'arches = ["12.0"]', 'arches = ["12.0", "12.0"]', 1))), "list"], 2, ("named twice",)),
    Case("targets-file-bad-sha", lambda t: ["--targets-file", str(targets_file(t, lambda s: s.replace(
        'sha256 = "', 'sha256 = "X', 1))), "list"], 2, ("sha256", "64 lowercase hex")),
    Case("targets-file-directory", lambda t: ["--targets-file", str(t), "list"], 2, ("is a directory", "TOML file")),
    Case("targets-file-named-in-load-errors", lambda t: ["--targets-file", str(targets_file(t, lambda s: s.replace(
        'arches = ["12.0"]', 'arches = ["12.0", "12.0"]', 1), "pins.toml")), "list"], 2, ("pins.toml", "named twice")),
    Case("targets-file-named-in-audit-fixes", lambda t: ["--targets-file", str(targets_file(t, str, "pins.toml")),
                                                         *audit(wheel_with(lambda w: None))(t)], 6,
         ("pins.toml names the wrong module",)),
    Case("out-is-a-file", lambda t: build()(t)[:4] + [str(file_with("out", b"x")(t))] + build()(t)[5:], 2,
         ("--out", "is a file", "must be a directory")),
    Case("out-is-a-file-dry-run", lambda t: dry()(t)[:4] + [str(file_with("out", b"x")(t))] + dry()(t)[5:], 2,
         ("--out", "is a file")),
    Case("out-below-a-file", lambda t: build()(t)[:4] + [str(file_with("out", b"x")(t) / "sub")] + build()(t)[5:], 2,
         ("lies below", "which is a file")),
    Case("build-dir-is-a-file", lambda t: build()(t)[:6] + [str(file_with("bd", b"x")(t))], 2,
         ("--build-dir", "is a file")),
    Case("out-empty", lambda t: ["build", "--target", TARGET, "--out", "", "--dry-run"], 2,
         ("--out is empty", "unset shell variable", "drop --out for its default")),
    Case("build-dir-empty", lambda t: ["build", "--target", TARGET, "--build-dir", " ", "--dry-run"], 2,
         ("--build-dir is empty",)),
    Case("audit-renamed-wheel", audit(renamed), 6, ("file name does not match the wheel's metadata", "renamed",
                                                    "causal_conv1d-1.7.0+cu130torch2.11sm120-")),
    Case("diff-bad-deflate", diff(damage_deflate), 6, ("is damaged", "cannot be read", "verify --dir")),
    Case("diff-bad-crc", diff(damage_crc), 6, ("is damaged", "CRC")),
    Case("diff-truncated", diff(lambda w: w.write_bytes(w.read_bytes()[:600])), 6,
         ("is damaged", "central directory", "cut short")),
    Case("diff-not-a-zip", lambda t: ["diff", str(make_wheel(t / "good")), str(file_with(WHEEL_NAME, b"html")(t))],
         6, ("is damaged", "not a zip archive")),
    Case("audit-missing-wheel", audit(lambda t: t / "wheels" / WHEEL_NAME), 6, ("does not exist",)),
    Case("audit-not-a-zip", audit(file_with(WHEEL_NAME, b"not a zip at all")), 6, ("not a zip archive", "damaged")),
    Case("audit-truncated", audit(wheel_with(lambda w: w.write_bytes(w.read_bytes()[:200]))), 6, ("damaged",)),
    Case("audit-bad-deflate", audit(wheel_with(damage_deflate)), 6, ("damaged", "cannot be decompressed", "verify")),
    Case("audit-bad-crc", audit(wheel_with(damage_crc)), 6, ("damaged", "CRC")),
    Case("audit-bad-name", audit(file_with("causal_conv1d-1.7.0.whl", b"PK")), 6, ("not a wheel file name",)),
    Case("audit-foreign-wheel", audit(file_with("numpy-2.0-cp311-cp311-linux_x86_64.whl", b"PK")), 1,
         ("not a wheel of any recipe", "causal_conv1d-")),
    Case("verify-no-manifest", lambda t: ["verify", "--dir", str(t)], 1, ("manifest.json does not exist", "make wheels")),
    Case("verify-not-json", lambda t: ["verify", "--dir", str(manifest(t, "{"))], 1, ("not valid JSON",)),
    Case("verify-wheels-int", lambda t: ["verify", "--dir", str(manifest(t, '{"format": 1, "wheels": [1]}'))], 1,
         ("wheel entry is int", "rebuild")),
    Case("verify-wheels-not-list", lambda t: ["verify", "--dir", str(manifest(t, '{"format": 1, "wheels": {}}'))], 1,
         ("expected",)),
    Case("verify-format-2", lambda t: ["verify", "--dir", str(manifest(t, '{"format": 2, "wheels": []}'))], 1,
         ("found format 2",)),
    Case("verify-entry-wrong-type", lambda t: ["verify", "--dir", str(manifest(
        t, '{"format": 1, "wheels": [%s]}' % ENTRY % ("0" * 64, "[]")))], 1, ("toolchain record is list",)),
    Case("verify-entry-bad-sha", lambda t: ["verify", "--dir", str(manifest(
        t, '{"format": 1, "wheels": [%s]}' % ENTRY % ("zz", "{}")))], 1, ("64 hex digits",)),
    Case("verify-listed-wheel-missing", lambda t: ["verify", "--dir", str(manifest(t, '{"format": 1, "wheels": [%s]}' % (
        ENTRY % ("0" * 64, '{"nvcc": "1", "torch": "2", "python": "3", "host_compiler": "c"}'))))], 1,
         ("a.whl is listed", "missing")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, monkeypatch, capsys):
    for name in ("MAX_JOBS", "NVCC_THREADS", "SOURCE_DATE_EPOCH", "CUDA_HOME"):
        monkeypatch.delenv(name, raising=False)
    env = dict(case.env)
    if case.setup:
        env.update(case.setup(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = case.argv(tmp_path)
    before = snapshot(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert_clear_failure(code, case.code, err, case.words)
    assert snapshot(tmp_path) == before, "the command left files behind"


def test_max_jobs_beyond_the_cores_warns(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MAX_JOBS", "64")
    monkeypatch.setenv("NVCC_THREADS", "1")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    from wheelbuilder.toolkit import plan_jobs

    assert plan_jobs(files=4) == (64, 1)
    err = capsys.readouterr().err
    assert "warning: MAX_JOBS=64" in err and "2 CPU cores" in err


def _double(monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLE.parent))
    from tests.support import wheelbuilder_double

    wheelbuilder_double.install(monkeypatch.setattr)


@pytest.mark.parametrize("locked", ["bd", "out"])
def test_a_directory_in_use_is_refused(locked, tmp_path, monkeypatch, capsys):
    """Two builds with one --build-dir (or one --out): the second stops before touching either tree."""
    _double(monkeypatch)
    lock_dir = tmp_path / "bd" / TARGET if locked == "bd" else tmp_path / "out"
    with exclusive(lock_dir):
        before = snapshot(tmp_path)
        code = main(["build", "--target", TARGET, "--out", str(tmp_path / "out"), "--build-dir", str(tmp_path / "bd")])
        err = capsys.readouterr().err
        assert code == 7, err
        assert f"pid {os.getpid()}" in err and "another build" in err
        new = {p for p in snapshot(tmp_path) - before if not (p.endswith(".build.lock") or Path(p).is_dir())}
        assert new == set() and not list(tmp_path.rglob("setup.py"))
        assert (lock_dir / ".build.lock").read_text().strip() == str(os.getpid())


@pytest.mark.parametrize("bd", ["bd", "{tmp}/bd"], ids=["all-relative", "out-and-log-dir-relative"])
def test_relative_directories_are_resolved_before_the_build(bd, tmp_path, monkeypatch, capsys):
    """`build --out out --build-dir bd --log-dir logs` run in tmp: pip, which runs in the unpacked source, gets
    absolute paths, and the wheel lands in tmp/out (relative ones named places under the source tree: the
    wheel went there and the build failed with "expected one wheel, found []", or pip read a relative
    --build-dir's source path as an "Invalid requirement")."""
    from types import SimpleNamespace

    from wheelbuilder import audit, build as build_module
    from wheelbuilder.errors import BuildError

    _double(monkeypatch)
    calls = []

    def pip_wheel(cmd, *, cwd, **_):
        """pip wheel -w DIR SRC as far as paths go: each relative to pip's own working directory."""
        calls.append((cwd, cmd[cmd.index("-w") + 1], cmd[-1]))
        if not (Path(cwd) / cmd[-1] / "setup.py").is_file():
            raise BuildError(f"ERROR: Invalid requirement: '{cmd[-1]}'")
        # what torch's BuildExtension leaves in the source tree, read by the C++ standard check
        ninja = Path(cwd) / cmd[-1] / "build" / "temp.linux-x86_64-cpython-311" / "build.ninja"
        ninja.parent.mkdir(parents=True, exist_ok=True)
        ninja.write_text("post_cflags = -O3 -std=c++17\ncuda_post_cflags = -O3 -std=c++17\n")
        make_wheel(Path(cwd) / cmd[cmd.index("-w") + 1])

    monkeypatch.setattr(build_module, "run", pip_wheel)
    monkeypatch.setattr(audit, "audit_wheel", lambda *_: SimpleNamespace(arches={}))  # make_wheel has no module
    monkeypatch.chdir(tmp_path)
    code = main(["build", "--target", TARGET, "--out", "out", "--build-dir", bd.format(tmp=tmp_path), "--log-dir", "logs"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert calls and all(Path(p).is_absolute() for p in calls[0]), calls
    wheels = sorted(tmp_path.rglob("*.whl"))
    assert [w.parent for w in wheels] == [tmp_path / "out"], wheels
    assert (tmp_path / "out" / "manifest.json").is_file() and (tmp_path / "logs" / "causal-conv1d.log").is_file()


def test_a_relative_cuda_home_is_made_absolute(tmp_path, monkeypatch):
    """CUDA_HOME=cuda: nvcc is found from here, so the compile (in the unpacked source) must get the full path."""
    from wheelbuilder.toolkit import find_cuda_home

    fake_cuda(tmp_path, executable=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_HOME", "cuda")
    assert find_cuda_home() == tmp_path / "cuda"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent has not reaped it yet)
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError):
        return None


def _live_in_session(sid: int) -> list[int]:
    """Live processes (not zombies) of session `sid`, read from /proc: the build's pip and all it started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def _signalled_build(tmp: Path, sig: int) -> tuple[int, str, list[int], int]:
    """Run the build double, send `sig` once its fake compilers run; return (exit code, stderr, the pids of
    compilers, ninja and setup.py, the session id of the build's pip) once the build has exited."""
    out, pids = tmp / "out", tmp / "pids"
    env = {**os.environ, "WHEELBUILDER_DOUBLE_PIDS": str(pids)}
    for name in ("MAX_JOBS", "NVCC_THREADS", "SOURCE_DATE_EPOCH"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(DOUBLE), "build", "--target", TARGET, "--out", str(out),
                             "--build-dir", str(tmp / "bd")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().endswith("\n")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        children = [int(p) for p in pids.read_text().split()]
        sid = _session_of(children[0])
        assert sid is not None and sid != os.getsid(0), "the compilers should run in the build's own session"
        assert list(out.glob(".staging-*")), "the compile should be under way in a staging folder"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, children, sid


@pytest.mark.parametrize("sig, code, words", [(signal.SIGTERM, 143, "SIGTERM received"),
                                              (signal.SIGINT, 130, "interrupted")])
def test_a_signal_mid_compile_stops_the_compilers_and_leaves_no_staging(sig, code, words, tmp_path):
    rc, err, children, _ = _signalled_build(tmp_path, sig)
    out = tmp_path / "out"
    assert rc == code, err
    assert words in err and "Traceback" not in err
    assert not list(out.glob(".staging-*")) and not list(out.glob("*.whl")) and not (out / "manifest.json").exists()
    assert not [p for p in children if _alive(p)], f"compiler processes outlived the build: {children}"


def test_no_compiler_outlives_20_signalled_builds(tmp_path):
    """The orphan race: pip exits at once on SIGTERM, while ninja stops its jobs (each in a process group
    of its own) only after it has caught the signal. Twenty builds, SIGTERM and SIGINT in turn: when the
    build has exited, no process it started is alive, at once (no grace period for stragglers)."""
    survivors = {}
    for i in range(20):
        sig, code = (signal.SIGTERM, 143) if i % 2 == 0 else (signal.SIGINT, 130)
        rc, err, children, sid = _signalled_build(tmp_path / str(i), sig)
        left = sorted(set(_live_in_session(sid)) | {p for p in children if _alive(p)})
        if left:
            survivors[i] = left
            for pid in left:  # do not leave them running for the rest of the test run
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert rc == code and "Traceback" not in err, err
        assert not list((tmp_path / str(i) / "out").glob(".staging-*"))
    assert not survivors, f"processes outlived their build (run: pids): {survivors}"


def test_a_pin_mismatch_names_the_targets_file_given(tmp_path, monkeypatch, capsys):
    """`--targets-file pins.toml`: the sdist's sha256 check says to fix the pin in pins.toml, not in the
    repository's targets.toml (the real fetch_sdist, reading a cache that holds a different file)."""
    from wheelbuilder import recipes

    fetch_sdist = recipes.fetch_sdist  # the real one, before the double replaces it
    _double(monkeypatch)
    cache = tmp_path / "cache"
    monkeypatch.setattr(recipes, "fetch_sdist", lambda recipe: fetch_sdist(recipe, cache))
    pins = targets_file(tmp_path, str, "pins.toml")
    recipe = load(pins).target(TARGET).recipes[0]
    (cache / recipe.sha256).mkdir(parents=True)
    (cache / recipe.sha256 / recipe.sdist).write_bytes(b"not the pinned sdist")
    code = main(["--targets-file", str(pins), "build", "--target", TARGET, "--out", str(tmp_path / "out"),
                 "--build-dir", str(tmp_path / "bd")])
    err = capsys.readouterr().err
    assert_clear_failure(code, 4, err, (f"does not match the pin {recipe.sha256} in {pins}", "moved aside"))
    assert "targets.toml" not in err


@pytest.mark.parametrize("shared", ["build-dir", "out"])
def test_two_builds_into_one_directory_the_second_is_refused(shared, tmp_path):
    """Two real build processes, one --build-dir (or one --out): the second stops with BusyError (7) naming
    the first's pid, and the first's compile goes on untouched until it is stopped."""
    first_pids = tmp_path / "first.pids"
    env = {**os.environ, "WHEELBUILDER_DOUBLE_PIDS": str(first_pids)}
    for name in ("MAX_JOBS", "NVCC_THREADS", "SOURCE_DATE_EPOCH"):
        env.pop(name, None)

    def build_cmd(name: str) -> list[str]:
        out = tmp_path / ("out" if shared == "out" else f"out-{name}")
        bd = tmp_path / ("bd" if shared == "build-dir" else f"bd-{name}")
        return [sys.executable, str(DOUBLE), "build", "--target", TARGET, "--out", str(out), "--build-dir", str(bd)]

    first = subprocess.Popen(build_cmd("first"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (first_pids.exists() and first_pids.read_text().endswith("\n")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        compilers = [int(p) for p in first_pids.read_text().split()]
        sources = sorted(str(p) for p in tmp_path.rglob("setup.py"))
        second = subprocess.run(build_cmd("second"), env={**env, "WHEELBUILDER_DOUBLE_PIDS": str(tmp_path / "x")},
                                capture_output=True, text=True, timeout=120)
        assert_clear_failure(second.returncode, 7, second.stderr, ("another build is using", f"pid {first.pid}"))
        assert first.poll() is None and all(map(_alive, compilers)), "the first build must go on"
        assert sorted(str(p) for p in tmp_path.rglob("setup.py")) == sources  # its tree was not unpacked over
        assert not (tmp_path / "x").exists()  # the second compiled nothing
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143, err
