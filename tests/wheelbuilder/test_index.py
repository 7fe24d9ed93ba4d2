"""`wheelbuilder index`: a PEP 503 simple index from dist/wheels/, served by `python -m http.server` on
127.0.0.1 and installed from by a real pip into a fresh venv.

The wheels here are small real wheels of the same project and version as the built ones, one per torch
line, each carrying a module that says which line it is: the index decides which one pip installs, and
that is what these tests check in seconds; a folder whose wheels do not verify is refused by name, as the
user wrote its path. The real causal-conv1d wheel of a new torch line, installed
from the index beside its torch and imported, is tests/wheelbuilder/test_torch_line_docker.py.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from common.errors import ConfigurationError
from wheelbuilder.index import write_index
from wheelbuilder.manifest import ToolchainRecord, entry_for, write_manifest

REPO = Path(__file__).resolve().parents[2]
LINES = {"cu130-sm120": "cu130torch2.11sm120", "cu130-sm120-torch2.14": "cu130torch2.14sm120",
         "cu132-sm120-torch2.15": "cu132torch2.15sm120"}
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def make_wheel(folder: Path, label: str) -> Path:
    """causal_conv1d-1.7.0+<label>-cpXY-cpXY-linux_x86_64.whl holding causal_conv1d_line.py (LINE = label)."""
    version = f"1.7.0+{label}"
    dist = f"causal_conv1d-{version}.dist-info"
    files = {
        "causal_conv1d_line.py": f"LINE = {label!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: causal-conv1d\nVersion: {version}\n",
        f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {TAG}-{TAG}-linux_x86_64\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"causal_conv1d-{version}-{TAG}-{TAG}-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(zipfile.ZipInfo(name, (2025, 1, 1, 0, 0, 0)), text)
    return wheel


def dist_wheels(root: Path) -> Path:
    for target, label in LINES.items():
        wheel = make_wheel(root / target, label)
        write_manifest(root / target, [entry_for(
            wheel, recipe="causal-conv1d", recipe_version="1.7.0", source_url="https://example.invalid/sdist",
            source_sha256="0" * 64, target=target, arches={"sass": [120], "ptx": []},
            toolchain=ToolchainRecord(nvcc="13.0.88", torch="2.14.1", python="3.11", host_compiler="gcc"),
            build_seconds=1.0, source_date_epoch=1735689600)])
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(directory: Path):
    """`python -m http.server` on 127.0.0.1, serving `directory`; yields its base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def pip_env() -> dict[str, str]:
    """No proxy for loopback, no configuration file (a site constraint must not decide the test)."""
    env = dict(os.environ, PIP_CONFIG_FILE="/dev/null", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.pop("PIP_CONSTRAINT", None)
    return env


def fresh_venv(path: Path) -> Path:
    """An empty venv (no pip of its own: pip_install drives it from outside, which saves ensurepip's seconds)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str) -> subprocess.CompletedProcess:
    """`pip install` into the venv of `python`, by this interpreter's pip (`pip --python`)."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-cache-dir", *args],
                          capture_output=True, text=True, env=pip_env(), timeout=300)


def test_index_layout_links_every_wheel_with_its_sha256_and_is_deterministic(tmp_path):
    wheels = dist_wheels(tmp_path / "wheels")
    record = write_index(wheels, tmp_path / "index")
    assert [w["target"] for w in record["wheels"]] == sorted(LINES)
    root = (tmp_path / "index" / "simple" / "index.html").read_text()
    assert re.findall(r'href="([^"]+)"', root) == ["causal-conv1d/"]
    page = (tmp_path / "index" / "simple" / "causal-conv1d" / "index.html").read_text()
    links = re.findall(r'href="\.\./\.\./files/([^"#]+)#sha256=([0-9a-f]{64})"', page)
    assert len(links) == 3
    for name, sha in links:
        assert hashlib.sha256((tmp_path / "index" / "files" / name).read_bytes()).hexdigest() == sha
    one = (tmp_path / "index" / "cu130-sm120-torch2.14" / "simple" / "causal-conv1d" / "index.html").read_text()
    assert re.findall(r'href="\.\./\.\./\.\./files/([^"#]+)#', one) == [
        f"causal_conv1d-1.7.0+cu130torch2.14sm120-{TAG}-{TAG}-linux_x86_64.whl"]
    # the same dist/ writes the same bytes
    first = {p.relative_to(tmp_path / "index"): p.read_bytes() for p in (tmp_path / "index").rglob("*") if p.is_file()}
    write_index(wheels, tmp_path / "index")
    again = {p.relative_to(tmp_path / "index"): p.read_bytes() for p in (tmp_path / "index").rglob("*") if p.is_file()}
    assert first == again and json.loads(first[Path("index.json")])["format"] == 1


def test_pip_installs_the_target_s_wheel_from_the_served_index_into_a_fresh_venv(tmp_path):
    wheels = dist_wheels(tmp_path / "wheels")
    run = subprocess.run([sys.executable, "-m", "wheelbuilder", "index", "--wheels", str(wheels), "--out",
                          str(tmp_path / "index")], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert re.search(r"^cu130-sm120-torch2.14 +pip install causal-conv1d --index-url <server>/cu130-sm120-torch2.14/simple$",
                     run.stdout, re.M), run.stdout
    with http_server(tmp_path / "index") as url:
        for target, label in LINES.items():
            python = fresh_venv(tmp_path / f"venv-{target}")
            got = pip_install(python, "causal-conv1d", "--index-url", f"{url}/{target}/simple")
            assert got.returncode == 0, got.stdout + got.stderr
            line = subprocess.run([str(python), "-c", "import causal_conv1d_line as m; print(m.LINE)"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            assert line == label, (target, got.stdout)
        # the combined index serves an exact pin, and pip checks the #sha256 of what it downloads
        python = fresh_venv(tmp_path / "venv-pinned")
        got = pip_install(python, "causal-conv1d==1.7.0+cu130torch2.14sm120", "--index-url", f"{url}/simple")
        assert got.returncode == 0, got.stderr
        wheel = next((tmp_path / "index" / "files").glob("*cu132torch2.15*"))
        wheel.write_bytes(wheel.read_bytes() + b"\0")  # a file changed on the server after indexing
        python = fresh_venv(tmp_path / "venv-tampered")
        got = pip_install(python, "causal-conv1d", "--index-url", f"{url}/cu132-sm120-torch2.15/simple")
        assert got.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in got.stderr.upper()


def test_a_wheel_folder_that_does_not_match_its_manifest_is_refused_by_name(tmp_path):
    wheels = dist_wheels(tmp_path / "wheels")
    (wheels / "cu130-sm120" / next(p.name for p in (wheels / "cu130-sm120").glob("*.whl"))).write_bytes(b"x")
    with pytest.raises(ConfigurationError, match=r"cu130-sm120 cannot go into the index: .*changed after the build; "
                       r"rebuild it \(make wheels\)\. For this folder that build is `make wheels TARGET=cu130-sm120`"):
        write_index(wheels, tmp_path / "index")
    assert not (tmp_path / "index").exists()
    with pytest.raises(ConfigurationError, match="does not exist: no wheels to index"):
        write_index(tmp_path / "nothing", tmp_path / "index")


def test_a_damaged_manifest_is_named_as_given_with_its_advice_once(tmp_path, monkeypatch, capsys):
    """`wheelbuilder index --wheels dist/wheels` (relative) on a manifest.json that is not JSON: exit 2, the
    folder named as the user wrote it, each problem a sentence of its own (no advice nested in another's
    parentheses), and no index written."""
    from wheelbuilder.__main__ import main

    wheels = dist_wheels(tmp_path / "dist" / "wheels")
    (wheels / "cu130-sm120" / "manifest.json").write_text("{not json")
    monkeypatch.chdir(tmp_path)
    code = main(["index", "--wheels", "dist/wheels", "--out", "dist/index"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("wheelbuilder: error: dist/wheels/cu130-sm120 cannot go into the index: "
                          "dist/wheels/cu130-sm120/manifest.json is not valid JSON (")
    assert err.rstrip().endswith("delete it and rebuild the wheels (make wheels). For this folder that build is "
                                 "`make wheels TARGET=cu130-sm120`; or remove the folder to index the others.")
    assert ".)." not in err and str(tmp_path) not in err and "Traceback" not in err
    assert not (tmp_path / "dist" / "index").exists()
