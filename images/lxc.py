"""Run an exported image under plain LXC (Debian's lxc), the layer `pct` drives underneath.

Used to prove an export really boots and that `lxc-attach` (what `pct exec` runs) sees the carried
environment, and by the `pct` test double. A container lives in LXCPATH/NAME/{config,rootfs}:

    template .tar.zst  -> tar --numeric-owner -xpf, ./dev/* skipped (as pct restores it)
    OCI archive .tar   -> unpack the layout, `umoci raw unpack` applies the layers (whiteouts included);
                          the image's Env becomes lxc.environment lines (PVE 9.1: lxc.environment.runtime)

Containers here are privileged with no network (`lxc.net.0.type = empty`): that is what runs on a
build machine without a bridge or subuid ranges; GPU nodes and driver libraries are bind mounts either way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from common.fsutil import atomic_write

from .errors import LxcError

COMMON_CONF = "/usr/share/lxc/config/common.conf"


def available() -> str | None:
    """None when LXC containers can run here, else why not."""
    for tool in ("lxc-start", "lxc-attach", "lxc-stop", "lxc-info"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt install lxc)"
    if os.geteuid() != 0:
        return "LXC containers need root here (no subuid ranges for unprivileged ones)"
    return None


def render_config(name: str, rootfs: Path, *, init_cmd: str | None = None, env: dict[str, str] | None = None,
                  extra: list[str] = ()) -> str:
    """An LXC config for a rootfs directory. `extra`: more `lxc.*` lines in `key: value` or `key = value`."""
    lines = [
        f"lxc.include = {COMMON_CONF}",
        f"lxc.uts.name = {name}",
        f"lxc.rootfs.path = dir:{rootfs}",
        "lxc.net.0.type = empty",
        # No AppArmor profile can be loaded inside a build container; pve ships its own profiles.
        "lxc.apparmor.profile = unconfined",
    ]
    if init_cmd:
        lines.append(f"lxc.init.cmd = {init_cmd}")
    # PVE 9.1 writes lxc.environment.runtime (LXC >= 6: init only); Debian 12's LXC 5 knows only
    # lxc.environment, which also reaches lxc-attach. Same effect on init either way.
    lines += [f"lxc.environment = {k}={v}" for k, v in (env or {}).items()]
    lines += [line.replace(": ", " = ", 1) if line.startswith("lxc.") and ": " in line else line for line in extra]
    return "\n".join(lines) + "\n"


def unpack_template(template: Path, rootfs: Path) -> None:
    """Unpack a rootfs template like pct does (`tar xpf --numeric-owner ... --exclude ./dev/*`)."""
    rootfs.mkdir(parents=True, exist_ok=True)
    cmd = ["tar", "--numeric-owner", "--xattrs", "-xpf", str(template), "-C", str(rootfs), "--exclude=./dev/*"]
    if template.name.endswith(".zst"):
        cmd.insert(1, "--zstd")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LxcError(f"unpacking {template.name} failed: {proc.stderr.strip()[-600:]}")


def unpack_oci(archive: Path, rootfs: Path) -> dict:
    """Apply an OCI archive's layers into `rootfs` with umoci; return the image config (`config` object)."""
    if not shutil.which("umoci"):
        raise LxcError("umoci is not installed; it is needed to unpack OCI archives (apt install umoci).")
    with tempfile.TemporaryDirectory(dir=rootfs.parent) as layout:
        with tarfile.open(archive) as tar:
            # The "data" filter refuses absolute and escaping paths (Python >= 3.11.4 has it).
            tar.extractall(layout, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        index = json.loads(Path(layout, "index.json").read_text())
        tag = index["manifests"][0].get("annotations", {}).get("org.opencontainers.image.ref.name")
        if tag is None:  # `skopeo copy ... oci-archive:PATH` (PVE's registry pull) names no tag: give it one
            tag = "latest"
            index["manifests"][0].setdefault("annotations", {})["org.opencontainers.image.ref.name"] = tag
            Path(layout, "index.json").write_text(json.dumps(index))
        if rootfs.exists():
            rootfs.rmdir()
        proc = subprocess.run(["umoci", "raw", "unpack", "--image", f"{layout}:{tag}", str(rootfs)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise LxcError(f"umoci could not unpack {archive.name}: {proc.stderr.strip()[-600:]}")
        manifest = _blob(layout, index["manifests"][0]["digest"])
        return _blob(layout, manifest["config"]["digest"]).get("config", {})


def _blob(layout: str, digest: str) -> dict:
    algo, hexd = digest.split(":", 1)
    return json.loads(Path(layout, "blobs", algo, hexd).read_text())


class Container:
    """One LXC container under `lxcpath` (a private LXC path, so tests never touch /var/lib/lxc)."""

    def __init__(self, name: str, lxcpath: Path):
        self.name = name
        self.lxcpath = Path(lxcpath)
        self.dir = self.lxcpath / name
        self.rootfs = self.dir / "rootfs"

    def _lxc(self, tool: str, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([tool, "-P", str(self.lxcpath), "-n", self.name, *args],
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise LxcError(f"{tool} {' '.join(args)} failed for {self.name} (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-800:]}")
        return proc

    def create(self, artifact: Path, *, extra: list[str] = (), init_cmd: str | None = None) -> None:
        """Unpack a template or OCI archive and write the config."""
        if self.dir.exists():
            raise LxcError(f"container {self.name} already exists in {self.lxcpath}; destroy it first.")
        self.dir.mkdir(parents=True)
        env = None
        if artifact.name.endswith(".oci.tar"):
            self.rootfs.mkdir()
            cfg = unpack_oci(artifact, self.rootfs)
            env = dict(e.split("=", 1) for e in cfg.get("Env", []) if "=" in e)
            if not init_cmd:  # PVE would run the image's entrypoint; here: stay up for lxc-attach
                from .template import INIT_SHIM

                shim = self.rootfs / ".dflash-init"
                shim.write_text(INIT_SHIM)
                shim.chmod(0o755)
                init_cmd = "/.dflash-init"
        else:
            unpack_template(artifact, self.rootfs)
        self.write_config(render_config(self.name, self.rootfs, init_cmd=init_cmd, env=env, extra=list(extra)))

    def write_config(self, text: str) -> None:
        atomic_write(self.dir / "config", text)

    def state(self) -> str:
        if not self.dir.exists():
            return "ABSENT"
        out = self._lxc("lxc-info", "-s", check=False).stdout
        return out.split(":", 1)[1].strip() if ":" in out else "STOPPED"

    def start(self, timeout: float = 30) -> None:
        self._lxc("lxc-start", "-l", "INFO", "-o", str(self.dir / "start.log"), timeout=timeout)
        deadline = time.monotonic() + timeout
        while self.state() != "RUNNING":
            if time.monotonic() > deadline:
                raise LxcError(f"{self.name} did not reach RUNNING; see {self.dir / 'start.log'}.")
            time.sleep(0.1)

    def attach(self, argv: list[str], *, keep_env: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command inside, like `pct exec` (which is `lxc-attach --keep-env`)."""
        env_flag = "--keep-env" if keep_env else "--clear-env"
        return self._lxc("lxc-attach", env_flag, "--", *argv, timeout=timeout, check=False)

    def stop(self) -> None:
        if self.state() == "RUNNING":
            self._lxc("lxc-stop", "-k", check=False)

    def destroy(self) -> None:
        self.stop()
        if self.dir.exists():
            shutil.rmtree(self.dir)
