"""The exported artifacts boot under real LXC, lxc-attach (what `pct exec` runs) sees the image's
environment through the carried files, and multi-process work runs inside.

The template's /sbin/init (images/scripts/init.sh) mounts a sized /dev/shm and brings the loopback up,
so inside the container a `dflash-train --num-proc 2` tokenisation, a 2-process gloo `torchrun` and the
doctor's shm and loopback checks pass; in a container whose init sets up neither (the issue as reported),
the same tokenisation fails and the doctor names both fixes.

Those run in a template exported from `python_image()` (tests/support/demo_image.py): Debian's minimal
base with Debian's python3, no iproute2, a non-root user, like the runtime image. Its site-packages is this
machine's venv (torch, datasets, transformers) and the source tree is this checkout, both bind-mounted
read-only, so no multi-GB copy is made; everything else (init, /dev, the network namespace, the user) is
the container's own.
"""

import json
import re
import sysconfig
import time
from pathlib import Path

import pytest

from images import export, lxc
from tests.conftest import need_tools
from images.errors import LxcError
from images.template import INIT_SHIM
from tests.support.dflash_train_fixtures import train_args
from tests.support.demo_image import demo_image_or_skip

pytestmark = [pytest.mark.lxc, pytest.mark.docker]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    why = lxc.available()
    if why:
        pytest.skip(why)
    need_tools("skopeo", "zstd")  # both formats are exported
    image = demo_image_or_skip()
    out = tmp_path_factory.mktemp("artifacts")
    oci, template = export.export(image, "both", out, progress=False).artifacts
    return {"oci": oci, "template": template}


@pytest.fixture
def container(tmp_path):
    c = lxc.Container("dflash-t", tmp_path / "lxc")
    yield c
    c.destroy()


def wait_for_init(container, timeout: float = 30) -> None:
    """Until the carried /sbin/init has set up /dev/shm and lo: then it runs the `sleep` of its wait loop
    (lxc-start returns as soon as init runs; its other children are the setup commands)."""
    deadline = time.monotonic() + timeout
    children = "for p in $(cat /proc/1/task/1/children); do cat /proc/$p/comm; done"
    while "sleep" not in container.attach(["sh", "-c", children]).stdout.split():
        assert time.monotonic() < deadline, f"/sbin/init did not reach its wait loop in {timeout:.0f} s"
        time.sleep(0.2)


def shm_kib(container) -> int | None:
    """Size of the tmpfs on /dev/shm inside, in KiB; None when none is mounted there."""
    mounts = container.attach(["cat", "/proc/self/mounts"]).stdout.splitlines()
    if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts):
        return None
    return int(container.attach(["df", "-k", "/dev/shm"]).stdout.splitlines()[1].split()[1])


def mem_total_kib(container) -> int:
    meminfo = container.attach(["cat", "/proc/meminfo"]).stdout
    return int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:")))


def test_template_boots_and_attach_sees_the_image_environment(artifacts, container):
    container.create(artifacts["template"])
    container.start()
    wait_for_init(container)
    assert container.state() == "RUNNING"
    # The image has no init: the carried /sbin/init is PID 1 and keeps the container up.
    assert container.attach(["cat", "/proc/1/cmdline"]).stdout.split("\0")[:2] == ["/bin/sh", "/sbin/init"]
    assert container.attach(["cat", "/sbin/init"]).stdout == INIT_SHIM
    r = container.attach(["dflash-train", "--steps", "3"])  # /usr/local/bin wrapper, env cleared like a bare exec
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "demo-train VIRTUAL_ENV=/opt/venv PWD=/workspace ARGS=--steps 3"
    env = container.attach(["/usr/local/bin/dflash-env", "env"]).stdout
    assert "LD_LIBRARY_PATH=/opt/venv/lib" in env and "PATH=/opt/venv/bin:" in env
    doctor = container.attach(["dflash", "doctor"])
    assert doctor.returncode == 0 and doctor.stdout.startswith("doctor: all checks passed VIRTUAL_ENV=/opt/venv")
    assert container.attach(["/opt/venv/bin/dflash-hardlink"]).returncode == 0  # hard links survived the repack
    # /dev/shm: a tmpfs of half the memory the container sees (no size asked for)
    assert abs(shm_kib(container) - mem_total_kib(container) // 2) < 4
    assert container.attach(["sh", "-c", "touch /dev/shm/x && stat -c %a /dev/shm"]).stdout.strip() == "1777"
    container.stop()
    assert container.state() == "STOPPED"


@pytest.mark.parametrize("value, kib, message", [
    ("64m", 64 * 1024, ""),
    ("lots", 0, "DFLASH_SHM_SIZE='lots' is not a tmpfs size (examples: 16g, 512m, 50%); using half the memory"),
])
def test_init_sizes_dev_shm_from_the_environment(artifacts, container, value, kib, message):
    """kib 0: half the memory, the default a bad value falls back to after saying so on the console."""
    log = container.dir / "console.log"
    container.create(artifacts["template"], extra=[f"lxc.environment = DFLASH_SHM_SIZE={value}",
                                                   f"lxc.console.logfile = {log}"])
    container.start()
    wait_for_init(container)
    assert abs(shm_kib(container) - (kib or mem_total_kib(container) // 2)) < 4
    said = [line for line in log.read_text().replace("\r", "").splitlines() if "is not a tmpfs size" in line]
    assert said == ([f"dflash init: {message}"] if message else [])


def test_oci_archive_boots_with_env_only_for_init(artifacts, container):
    need_tools("umoci")  # unpacks the OCI archive, as pct does
    container.create(artifacts["oci"])
    container.start()
    wait_for_init(container)
    init_env = container.attach(["cat", "/proc/1/environ"]).stdout
    assert "VIRTUAL_ENV=/opt/venv" in init_env  # the image's Env reaches init (as PVE 9.1 maps it)
    # pct exec on PVE does not see it (lxc.environment.runtime): push passes the recorded environment.
    r = container.attach(["env", "-i", "VIRTUAL_ENV=/opt/venv", "/opt/venv/bin/dflash", "doctor"])
    assert r.returncode == 0 and "VIRTUAL_ENV=/opt/venv" in r.stdout
    assert shm_kib(container)  # the same init shim stands in for the entrypoint here


def test_existing_container_is_refused(artifacts, container):
    container.create(artifacts["template"])
    with pytest.raises(LxcError, match="already exists"):
        container.create(artifacts["template"])


# ----------------------------------------------------------------------------------------------------
# Multi-process work inside: the Python image's template, this venv's packages bind-mounted
# ----------------------------------------------------------------------------------------------------
def python_mounts(data: Path) -> list[str]:
    paths = sysconfig.get_paths()
    sites = dict.fromkeys([paths["purelib"], paths["platlib"]])
    lines = [f"lxc.mount.entry = {site} opt/venv/lib/python3.11/site-packages none ro,bind,create=dir 0 0"
             for site in sites]
    return lines + [f"lxc.mount.entry = {REPO} {str(REPO).lstrip('/')} none ro,bind,create=dir 0 0",
                    f"lxc.mount.entry = {data} data none ro,bind,create=dir 0 0"]


def run_as_user(container, argv: list[str], timeout: float = 300):
    """argv through the template's dflash-env wrapper: the image's ENV, WORKDIR and USER (dflash, uid 1000)."""
    return container.attach(["/usr/local/bin/dflash-env", *argv], timeout=timeout)


def doctor_json(container, *flags: str) -> tuple[int, dict]:
    r = run_as_user(container, ["dflash", "doctor", "--json", *flags])
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}


TRAIN = ["dflash-train", *train_args(Path("/data/target"), Path("/data/chat.jsonl"), Path("/home/dflash/run"),
                                     max_steps=1, num_proc=2)]


def test_template_container_runs_multiprocess_work(python_template, workload, container):
    container.create(python_template, extra=python_mounts(workload))
    container.start()
    wait_for_init(container)
    # What init had to work with: no ip, no ifconfig; python3 brought lo up (SIOCSIFFLAGS).
    tools = container.attach(["sh", "-c", "command -v ip ifconfig; cat /sys/class/net/lo/flags"]).stdout.split()
    assert len(tools) == 1 and int(tools[0], 16) & 1, tools
    assert abs(shm_kib(container) - mem_total_kib(container) // 2) < 4

    r = run_as_user(container, TRAIN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kept 24" in r.stderr and "step 1/1" in r.stderr

    # plain lxc-attach (what pct exec runs): the /usr/local/bin wrapper finds the venv's torchrun
    r = container.attach(["torchrun", "--nproc-per-node", "2", "/data/allreduce.py"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # both ranks print at once, so their lines may run together
    assert sorted(re.findall(r"rank (\d) of 2: all_reduce sum 3", r.stdout)) == ["0", "1"], r.stdout

    _, checks = doctor_json(container)
    assert checks["shm"]["status"] == "pass" and checks["loopback"]["status"] == "pass", checks
    assert checks["loopback"]["details"]["localhost"] == ["127.0.0.1", "::1"]  # the carried /etc/hosts


def test_container_without_the_init_fails_multiprocess_work_and_the_doctor_says_why(
        python_template, workload, container):
    """The issue as reported: an init that sets up nothing (as under `--ostype unmanaged` with another init)."""
    container.create(python_template, extra=python_mounts(workload), init_cmd="/bin/sleep infinity")
    container.start()
    assert shm_kib(container) is None
    r = run_as_user(container, TRAIN)
    assert r.returncode != 0 and "SemLock" in r.stderr and "FileNotFoundError" in r.stderr, r.stderr[-3000:]
    code, checks = doctor_json(container, "--quick")
    assert code == 1
    assert checks["shm"]["status"] == "fail" and "/dev/shm does not exist" in checks["shm"]["reason"]
    assert "lxc.mount.entry: tmpfs dev/shm tmpfs" in checks["shm"]["reason"]
    assert checks["loopback"]["status"] == "fail" and "Network is unreachable" in checks["loopback"]["reason"]
    assert "lo is DOWN" in checks["loopback"]["reason"] and "ip link set lo up" in checks["loopback"]["reason"]


# What each way in searches: lxc-attach --clear-env's own default; pct exec (lxc-attach --keep-env) from a
# root shell on the host; OpenSSH's compiled-in PATH for `ssh host cmd` (Debian); a login shell (/etc/profile).
WAYS_IN = {
    "lxc-attach": [],
    "pct exec": ["env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    "ssh command": ["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin:/usr/games"],
    "login shell": ["env", "-i", "sh", "-lc", 'exec "$0" "$@"'],
}
TOOLS = ("torchrun", "python", "python3", "dflash", "dflash-train")


def test_python_torchrun_and_the_console_scripts_are_on_path_for_every_way_in(python_template, workload, container):
    container.create(python_template, extra=python_mounts(workload))
    container.start()
    wait_for_init(container)
    for way, prefix in WAYS_IN.items():
        found = container.attach([*prefix, "sh", "-c", f"for t in {' '.join(TOOLS)}; do command -v $t; done"])
        assert len(found.stdout.split()) == len(TOOLS), (way, found.stdout, found.stderr)
        # the image's python: the wrapper runs it as the image's user; a login shell as whoever logged in
        r = container.attach([*prefix, "python", "-c", "import os, sys; print(sys.prefix, os.getuid())"])
        assert r.stdout.split() == ["/opt/venv", "0" if way == "login shell" else "1000"], (way, r.stdout, r.stderr)
    r = container.attach(["python", "-c", "import torch; print(torch.__version__)"])
    assert r.returncode == 0 and r.stdout.strip() == torch_version(), r.stderr[-2000:]


def torch_version() -> str:
    import torch

    return torch.__version__


@pytest.mark.parametrize("uid", [0, 1000])
def test_entrypoint_as_init_sets_up_shm_and_loopback_or_names_the_config_lines(python_template, workload,
                                                                               container, uid):
    """The OCI path: PVE >= 9.1 runs the image's entrypoint as init (lxc.init.uid: the image's USER), not
    the template's /sbin/init. As root it mounts /dev/shm and brings lo up; as the image's user it cannot,
    and says which config lines do (push writes them)."""
    log = container.dir / "console.log"
    env = ["PATH=/opt/venv/bin:/usr/bin:/bin", f"PYTHONPATH={REPO}", "HF_HUB_OFFLINE=1",
           "DFLASH_STATE_DIR=/tmp/dflash", "DFLASH_SHM_SIZE=96m"]
    container.create(python_template, init_cmd="/opt/venv/bin/python3 -m dflash.cli entrypoint sleep infinity",
                     extra=python_mounts(workload) + [f"lxc.environment = {e}" for e in env] +
                     [f"lxc.init.uid = {uid}", f"lxc.init.gid = {uid}", f"lxc.console.logfile = {log}"])
    container.start()
    deadline = time.monotonic() + 60
    while "sleep" not in container.attach(["cat", "/proc/1/comm"]).stdout:  # the entrypoint execs the command
        assert time.monotonic() < deadline, log.read_text()[-2000:] if log.exists() else "no console log"
        time.sleep(0.3)
    lo_up = int(container.attach(["cat", "/sys/class/net/lo/flags"]).stdout, 16) & 1
    if uid == 0:
        assert shm_kib(container) == 96 * 1024 and lo_up
        assert container.attach(["stat", "-c", "%a", "/dev/shm"]).stdout.strip() == "1777"
    else:
        assert shm_kib(container) is None and not lo_up
        said = log.read_text()
        assert "/dev/shm: no tmpfs is mounted and uid 1000 cannot mount one" in said, said[-2000:]
        assert "lxc.net.99.flags: up" in said and "lxc.mount.entry: tmpfs dev/shm tmpfs" in said
