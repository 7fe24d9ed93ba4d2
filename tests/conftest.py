"""Shared fixtures and the tier rules.

Tiers are pytest markers (pyproject.toml): docker, nvcc, lxc, ssh, registry, gpu, serving, slow. A test
of a tier whose tool is missing skips with the reason and the command that installs it, except where
DFLASH_REQUIRE names the tier (CI sets DFLASH_REQUIRE=docker,nvcc,lxc,ssh,registry,serving): there a
missing tool fails the run instead of hiding it. The tools some tests need beyond their tier's own
(skopeo, umoci, zstd, ...) follow the same rule through `need_tools`.

The heavy artifacts (the cu130-sm120 wheel and the dflash-train image) are built once per run by the
session fixtures below and shared by every test that needs them.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A test run started in the background of a non-interactive shell (nohup, `cmd &`, some CI runners)
# inherits SIGINT as ignored, and so would every command the tests start, so the tests that send
# SIGINT to a build, an upload or a training run would find it ignored. Ctrl-C on a terminal reaches
# a process whose SIGINT is not ignored: give the children that disposition (a handled signal is reset
# to the default at exec, and Python then installs its KeyboardInterrupt handler).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
CI_TARGET = "cu130-sm120"
REQUIRED = {t.strip() for t in os.environ.get("DFLASH_REQUIRE", "").split(",") if t.strip()}


def _available(tier: str) -> tuple[bool, str]:
    if tier == "docker":
        from images.engine import engine_running

        return engine_running(), "no Docker engine answers (start one with `make engine`)"
    if tier == "nvcc":
        return bool(shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()), "nvcc not found"
    if tier == "lxc":
        return bool(shutil.which("lxc-start")) and os.geteuid() == 0, \
            "needs Debian's lxc and root (apt-get install lxc)"
    if tier == "ssh":
        return bool(shutil.which("sshd") or Path("/usr/sbin/sshd").exists()), \
            "needs OpenSSH's sshd (apt-get install openssh-server)"
    if tier == "registry":
        return Path("/usr/bin/docker-registry").exists(), "needs Debian's docker-registry (apt install docker-registry)"
    if tier == "serving":
        from tests.support import serving_wheels

        try:
            serving_wheels.all_wheels()
        except (RuntimeError, OSError) as exc:
            return False, (f"the pinned engine wheels cannot be fetched ({exc}); fetch them with "
                           f"`{serving_wheels.FETCH_COMMAND}` (PyPI access needed once)")
        return True, ""
    if tier == "gpu":
        try:
            import torch

            return torch.cuda.is_available(), "no CUDA GPU"
        except ImportError:
            return False, "torch is not installed"
    return True, ""


_cache: dict[str, tuple[bool, str]] = {}

# The Debian package of each tool a test may need beyond its tier's own.
PACKAGES = {"skopeo": "skopeo", "umoci": "umoci", "zstd": "zstd", "debootstrap": "debootstrap",
            "busybox": "busybox-static", "dockerd": "docker.io", "ssh-keygen": "openssh-client"}


def need_tools(*tools: str) -> None:
    """Skip the calling test or fixture when one of `tools` is not on PATH, naming the command that
    installs them. Where DFLASH_REQUIRE names the test's tier, pytest_runtest_makereport turns the skip
    into a failure, as for a tier's own tool."""
    missing = [t for t in tools if not shutil.which(t)]  # PATH, as the code under test looks them up
    if missing:
        packages = " ".join(dict.fromkeys(PACKAGES.get(t, t) for t in missing))
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install {packages})")


# `make test` runs two pytest-xdist workers (-n 2 --dist loadgroup --no-loadscope-reorder). The tests of
# the system tiers share one Docker engine, its layer cache, dist/wheels/ and LXC, and their session
# fixtures (the wheels, the images, the LXC template) build once per worker: they are one group, so one
# worker runs them in order while the other runs the rest, a module at a time (its module fixtures built
# once). The system group goes first, then modules with slow tests, so the short ones even out the end.
SYSTEM_TIERS = ("docker", "lxc")
# Inside the system group the compiles come first, in the order they build on each other: the session's wheel
# and image, the second torch line's, then its cold rebuild, a compile on one core for 6 minutes that thus
# runs beside the other worker's tests, not alone at the end as it did once (the last 342 s of a run). The
# wall time stayed about the same (docs/performance.md): the CPU bounds it, not this order.
SYSTEM_FIRST = ("tests/images/test_image_docker.py", "tests/images/test_image_torch_line.py",
                "tests/wheelbuilder/test_torch_line_docker.py", "tests/wheelbuilder/test_wheels_docker.py")


def _group(item) -> str:
    if any(item.get_closest_marker(t) for t in SYSTEM_TIERS):
        return "system"
    return item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def order(item) -> tuple[int, int]:
        group, module = _group(item), item.nodeid.split("::")[0]
        if group == "system":
            return 0, SYSTEM_FIRST.index(module) if module in SYSTEM_FIRST else len(SYSTEM_FIRST)
        return (1 if group in slow_modules else 2), 0

    items.sort(key=order)  # stable: each module's tests stay together and in their order
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        _name_groups(items)


def _name_groups(items) -> None:
    """--dist loadgroup schedules by a '@group' suffix of each test's node id. pytest-xdist 3.8 writes that
    suffix to Node._nodeid, which pytest 9 no longer reads (its id is Node._id), so every test would be a
    group of its own and both workers would build the session's wheels at once: the suffix is written here,
    where pytest 9 reads it."""
    from _pytest.nodeid import NodeId

    for item in items:
        group = _group(item)
        item._id = NodeId.parse(f"{item.nodeid}@{group}")
        assert item.nodeid.endswith(f"@{group}"), "pytest no longer reads Node._id: see _name_groups"


def pytest_runtest_setup(item):
    for tier in ("docker", "nvcc", "lxc", "ssh", "registry", "gpu", "serving"):
        if item.get_closest_marker(tier) is None:
            continue
        if tier not in _cache:
            _cache[tier] = _available(tier)
        ok, why = _cache[tier]
        if not ok:
            if tier in REQUIRED:
                pytest.fail(f"tier '{tier}' is required here (DFLASH_REQUIRE) but unavailable: {why}")
            pytest.skip(f"{tier}: {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test of a required tier that skips from inside (a fixture's own skip) fails too: CI must not
    pass on tests that never ran."""
    outcome = yield
    report = outcome.get_result()
    tiers = sorted(t for t in REQUIRED if item.get_closest_marker(t))
    if report.skipped and tiers and not item.get_closest_marker("gpu"):
        report.outcome = "failed"
        report.longrepr = f"skipped although tier(s) {tiers} are required here (DFLASH_REQUIRE): {report.longrepr}"


@pytest.fixture(scope="session")
def ci_target():
    from wheelbuilder import targets

    return targets.load().target(CI_TARGET)


@pytest.fixture(scope="session")
def built_wheels(ci_target) -> Path:
    """dist/wheels/cu130-sm120/ built by the real builder stage (the layer cache makes a repeat cheap)."""
    from images.build import DIST_WHEELS, build_wheels

    if os.environ.get("DFLASH_REUSE_WHEELS") == "1":  # iterate on image tests without recompiling
        from wheelbuilder.manifest import verify_wheels

        out = DIST_WHEELS / ci_target.name
        if (out / "manifest.json").exists() and not verify_wheels(out):
            return out
    return build_wheels(ci_target)


@pytest.fixture(scope="session")
def runtime_image(built_wheels, ci_target) -> str:
    """The dflash-train:cu130-sm120 image, built once per run from the wheels above."""
    from images.build import build_image

    return build_image(ci_target)
