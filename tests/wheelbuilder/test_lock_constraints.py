"""`make lock` says which torch it resolved and refuses loudly when a pip or uv constraint on the machine
hides the requested torch (real constraints files, real pip configuration, the real CLI and uv)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from wheelbuilder import targets as tg
from wheelbuilder.constraints import constraint_files, hiding_constraints
from wheelbuilder.lock import LOCKS, resolved_version

REPO = Path(__file__).resolve().parents[2]
LINE = "cu130-torch2.14"  # the engines' torch line


def lock_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wheelbuilder", "lock", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture()
def clean_env(monkeypatch, tmp_path) -> dict[str, str]:
    """The process environment without any constraint source of the machine running the tests."""
    for var in ("PIP_CONSTRAINT", "UV_CONSTRAINT", "PIP_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    # pip's own switch for "no configuration file at all", site files (/etc/xdg/pip, /etc/pip.conf) included
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    import os

    return dict(os.environ)


def test_every_pypi_lock_pins_the_torch_targets_toml_asks_for():
    catalog = tg.load()
    for torch in {t.torch.lock: t.torch for t in catalog.targets.values() if t.torch.from_pypi}.values():
        for name in ("builder.txt", "runtime.txt", "common.txt"):
            assert resolved_version((LOCKS / torch.lock / name).read_text(), "torch") == torch.version, (torch, name)


def test_pip_constraint_capping_torch_stops_the_lock_naming_file_and_line(tmp_path, clean_env):
    caps = tmp_path / "site-constraints.txt"
    caps.write_text("# the site's pins\nnumpy<3 --hash=sha256:" + "0" * 64 + "\ntorch<2.13  # tested line\n"
                    "torch<=2.12.1 --hash=sha256:" + "1" * 64 + "\n")
    before = digest(LOCKS / LINE)
    run = lock_cli("--only", LINE, env=dict(clean_env, PIP_CONSTRAINT=str(caps)))
    assert run.returncode == 2, run.stderr
    assert "torch 2.14.1 ([torch.cu130-2_14] in targets.toml) is hidden" in run.stderr
    assert f"'torch<2.13' at {caps}:3 (from PIP_CONSTRAINT); 'torch<=2.12.1' at {caps}:4" in run.stderr
    assert "unset PIP_CONSTRAINT" in run.stderr
    assert digest(LOCKS / LINE) == before  # nothing was rewritten


def test_a_constraint_in_pip_conf_is_found_as_pip_reads_it(tmp_path, clean_env):
    caps = tmp_path / "caps.txt"
    caps.write_text("torch==2.11.0\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[install]\nconstraint = {caps}\n")
    env = dict(clean_env, PIP_CONFIG_FILE=str(conf))
    # PIP_CONFIG_FILE is read beside the site and user files, as pip does
    assert ("pip config install.constraint", caps) in constraint_files(env)
    run = lock_cli("--only", LINE, env=env)
    assert run.returncode == 2 and f"'torch==2.11.0' at {caps}:1 (from pip config install.constraint)" in run.stderr
    # PIP_CONFIG_FILE=/dev/null, the way out the message names, reads no configuration at all.
    assert constraint_files(dict(clean_env, PIP_CONFIG_FILE="/dev/null")) == []


def test_included_and_uv_constraints_are_followed_and_compatible_caps_pass(tmp_path, clean_env):
    (tmp_path / "inner.txt").write_text("torch>=2.10,<2.14\n")
    outer = tmp_path / "outer.txt"
    outer.write_text("-c inner.txt\n")
    hits = hiding_constraints("torch", "2.14.1", dict(clean_env, UV_CONSTRAINT=str(outer)))
    assert [(str(h.requirement), h.lineno, h.path.name) for h in hits] == [("torch<2.14,>=2.10", 1, "inner.txt")]
    (tmp_path / "inner.txt").write_text("torch>=2.14\n")
    assert hiding_constraints("torch", "2.14.1", dict(clean_env, UV_CONSTRAINT=str(outer))) == []


def test_a_missing_constraints_file_is_named(tmp_path, clean_env):
    run = lock_cli("--only", LINE, env=dict(clean_env, PIP_CONSTRAINT=str(tmp_path / "gone.txt")))
    assert run.returncode == 2 and "gone.txt, which cannot be read" in run.stderr


def test_lock_prints_the_torch_it_resolved_and_refuses_a_pin_the_resolver_changed(tmp_path, clean_env):
    """A pin without its patch release (`2.14`) resolves, by PEP 440's zero padding, to 2.14.0: the lock
    says so and keeps nothing instead of writing a lock whose torch differs from targets.toml."""
    lock = f"test-{tmp_path.name}"[:40]
    text = (REPO / "targets.toml").read_text().replace('version = "2.14.1"\ncuda = "13.0"', 'version = "2.14"\ncuda = "13.0"')
    text = text.replace('lock = "cu130-torch2.14"', f'lock = "{lock}"')
    targets = tmp_path / "targets.toml"
    targets.write_text(text)
    run = subprocess.run([sys.executable, "-m", "wheelbuilder", "--targets-file", str(targets), "lock", "--only", lock],
                         cwd=REPO, env=clean_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert f"locks/{lock}/runtime.txt: the resolver chose torch 2.14.0, but [torch.cu130-2_14]" in run.stderr
    assert not (LOCKS / lock).exists()
    ok = lock_cli("--only", LINE, env=clean_env)
    assert ok.returncode == 0, ok.stderr
    assert f"locks/{LINE}/builder.txt: resolved torch 2.14.1 from https://pypi.org/simple (requested 2.14.1)" in ok.stderr
