"""Drive the Dockerfile's stages for a target: `wheels` (builder -> dist/wheels/<target>/) and
`runtime` (the dflash-train image).

Build args come from targets.toml, so the builder and the runtime read the same pins. The host's CA
bundle travels as the BuildKit secret `ca` (never a layer). Output lands in a staging directory and is
moved into dist/ only after the build succeeded and its manifest verifies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from wheelbuilder import targets as tg
from common.cmd import echo, run
from wheelbuilder.errors import BuildError, ConfigurationError
from common.fsutil import DIST_WHEELS, LOGS, REPO_ROOT, exclusive, source_date_epoch

from .engine import ca_bundle, docker_cli, ensure_engine, ensure_free_space, image_exists

IMAGE_REPO = "dflash-train"


@dataclass(frozen=True)
class BuildSpec:
    """One `docker build` invocation, printable as a plan (`--dry-run`)."""

    stage: str
    build_args: dict[str, str]
    tag: str | None = None
    output: Path | None = None

    def command(self, context: Path = REPO_ROOT) -> list[str]:
        cmd = [docker_cli(), "build", "--network=host", "--progress=plain", "--target", self.stage]
        for k, v in sorted(self.build_args.items()):
            cmd += ["--build-arg", f"{k}={v}"]
        if ca := ca_bundle():
            cmd += ["--secret", f"id=ca,src={ca}"]
        if self.tag:
            cmd += ["-t", self.tag]
        if self.output:
            cmd += ["--output", f"type=local,dest={self.output}"]
        return cmd + [str(context)]


def git_revision() -> str:
    out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    rev = out.stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout
    return rev + ("-dirty" if dirty.strip() else "")


def base_args(target: tg.Target, torch_env_from: str) -> dict[str, str]:
    """Build args shared by every stage; `torch_env_from` is the OS stage python-torch starts from
    (builder-os or runtime-os: the same image for every target now, so the torch layer is shared)."""
    from wheelbuilder.lock import require_locks

    from .pin_file import image_pin

    require_locks(target)
    args = {
        "TARGET": target.name,
        "TORCH_LOCK": target.torch.lock,
        "BUILDER_BASE": target.toolkit.builder_base,
        "RUNTIME_BASE": target.toolkit.runtime_base,
        "TORCH_ENV_FROM": torch_env_from,
        "TOOLKIT_KIND": target.toolkit.kind,
    }
    if target.toolkit.kind == "image":
        # By digest once locks/images.toml holds one (images.pins records it at the first pull).
        pin = image_pin(target)
        args |= {"CUDA_IMAGE": pin.by_digest if pin.digest else pin.ref,
                 "CUDA_IMAGE_HOME": target.toolkit.image_cuda_home}
    return args


def ensure_base(target: tg.Target) -> None:
    """The offline Debian base is made here when the target uses it (every target does); a devel image
    nvcc is copied from is pulled and checked by images.pins before a builder stage."""
    from .base import DEFAULT_TAG, bootstrap

    if DEFAULT_TAG in (target.toolkit.builder_base, target.toolkit.runtime_base) and not image_exists(DEFAULT_TAG):
        bootstrap()


def _prepare(target: tg.Target, what: str, log_name: str, *, builder: bool = False) -> Path:
    """Before any build: an engine, room on its disk, the target's base image (and for a builder stage
    the devel image nvcc is copied from, checked against its pin); the log file's path."""
    ensure_engine()
    ensure_free_space(target.torch.lock, what)
    ensure_base(target)
    if builder and target.toolkit.kind == "image":
        from .pins import ensure_toolkit_image

        ensure_toolkit_image(target)
    LOGS.mkdir(exist_ok=True)
    return LOGS / log_name


def wheels_spec(target: tg.Target, output: Path, rebuild: str = "0") -> BuildSpec:
    args = base_args(target, "builder-os") | {"SOURCE_DATE_EPOCH": str(source_date_epoch()), "REBUILD": rebuild}
    for var in ("MAX_JOBS", "NVCC_THREADS", "CCACHE_DISABLE"):
        if var in os.environ:
            args[var] = os.environ[var]
    return BuildSpec(stage="wheels", build_args=args, output=output)


def build_wheels(target: tg.Target, out_dir: Path | None = None, *, rebuild: str = "0", dry_run: bool = False) -> Path:
    """Run the builder stage; publish wheels + manifest.json into dist/wheels/<target>/."""
    from wheelbuilder.manifest import verify_wheels

    out_dir = out_dir or DIST_WHEELS / target.name
    if dry_run:
        print(" ".join(wheels_spec(target, out_dir / ".staging").command()))
        return out_dir
    log = _prepare(target, f"the wheels for {target.name}", f"wheels-{target.name}.log", builder=True)
    with exclusive(out_dir):
        staging = out_dir / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        try:
            echo(f"building wheels for {target.name} in the builder stage (log: {log})")
            log.write_text("")
            run(wheels_spec(target, staging, rebuild).command(), env=dict(os.environ, DOCKER_BUILDKIT="1"),
                log=log, on_line=_stage_progress)
            problems = verify_wheels(staging)
            if problems:
                raise BuildError(f"the builder's output does not match its manifest: {problems}")
            for f in sorted(staging.glob("*.whl")) + [staging / "manifest.json"]:
                os.replace(f, out_dir / f.name)
            if (staging / "logs").is_dir():
                for f in (staging / "logs").iterdir():
                    os.replace(f, LOGS / f"{target.name}-{f.name}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        echo(f"wheels for {target.name} in {out_dir} ({time.monotonic() - started:.0f} s)")
    return out_dir


def _stage_progress(line: str) -> None:
    """Echo BuildKit's step headers and the builder's own progress lines; the rest goes to the log."""
    if line.startswith("#") and (" [" in line[:12] and "]" in line) and "DONE" not in line:
        echo(line[:160])
    elif "wheelbuilder" in line or "compiled " in line or "wrote " in line or "error" in line.lower():
        echo(line[:200])


def toolkit_tag(target: tg.Target) -> str:
    """The builder's toolkit stage, tagged so its size can be compared with the runtime image's."""
    return f"dflash-builder:{target.name}"


def build_toolkit(target: tg.Target) -> str:
    tag = toolkit_tag(target)
    if target.toolkit.kind == "image":
        from .pins import ensure_toolkit_image

        ensure_toolkit_image(target)
    spec = BuildSpec(stage="toolkit", build_args=base_args(target, "builder-os"), tag=tag)
    run(spec.command(), env=dict(os.environ, DOCKER_BUILDKIT="1"), log=LOGS / f"toolkit-{target.name}.log",
        on_line=_stage_progress)
    return tag


def image_tag(target: tg.Target) -> str:
    return f"{IMAGE_REPO}:{target.name}"


def build_image(target: tg.Target, *, tag: str | None = None, extra_args: dict[str, str] | None = None,
                dry_run: bool = False) -> str:
    """Build the runtime image from dist/wheels/<target>/ (run `wheels` first)."""
    from wheelbuilder.manifest import read_manifest, verify_wheels

    tag = tag or image_tag(target)
    wheels_dir = DIST_WHEELS / target.name
    args = base_args(target, "runtime-os") | {"GIT_REVISION": git_revision()}
    if not dry_run:
        problems = verify_wheels(wheels_dir) if (wheels_dir / "manifest.json").exists() else ["no manifest.json"]
        if problems:
            raise ConfigurationError(
                f"{wheels_dir} holds no verified wheels for {target.name} ({'; '.join(map(str, problems))}). "
                f"Build them first: `make wheels TARGET={target.name}`."
            )
        manifest = read_manifest(wheels_dir)
        args["WHEEL_SHA256"] = ",".join(sorted(w.sha256 for w in manifest.wheels))
    args |= extra_args or {}
    spec = BuildSpec(stage="runtime", build_args=args, tag=tag)
    if dry_run:
        print(" ".join(spec.command()))
        return tag
    log = _prepare(target, f"image {tag}", f"image-{target.name}.log")
    log.write_text("")
    echo(f"building image {tag} (log: {log})")
    run(spec.command(), env=dict(os.environ, DOCKER_BUILDKIT="1"), log=log, on_line=_stage_progress)
    return tag


def gpu_requests() -> list:
    """--gpus all, where the engine has the NVIDIA runtime; [] elsewhere (the demo then runs on CPU)."""
    import docker

    from .engine import client

    runtimes = client().info().get("Runtimes", {})
    if "nvidia" in runtimes or shutil.which("nvidia-container-runtime-hook"):
        return [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return []


def run_demo(target: tg.Target, args: list[str] | None = None, tag: str | None = None) -> int:
    """`docker run dflash-train:<target>` through the engine API, streaming its output; returns its exit code."""
    from .engine import client

    tag = tag or image_tag(target)
    gpus = gpu_requests()
    echo(f"running {tag} {' '.join(args or [])} ({'GPUs: all' if gpus else 'no GPU: the demo runs on the CPU'})")
    container = client().containers.run(tag, args or [], detach=True, network_mode="none", device_requests=gpus or None)
    try:
        for chunk in container.logs(stream=True, follow=True):
            print(chunk.decode(errors="replace"), end="", flush=True)
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)


def register(sub) -> None:
    import argparse

    for name, helptext in (("wheels", "build the target's wheels in the builder stage -> dist/wheels/<target>/"),
                           ("image", "build the runtime image dflash-train:<target> from dist/wheels/<target>/")):
        p = sub.add_parser(name, help=helptext, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--target", default=None, help="target from targets.toml (default: its default_target)")
        p.add_argument("--dry-run", action="store_true", help="print the docker build command, run nothing")
        if name == "wheels":
            p.add_argument("--rebuild", default="0", help="any new value recompiles, bypassing the layer cache")
        else:
            p.add_argument("--tag", default=None, help="image tag (default: dflash-train:<target>)")
        p.set_defaults(func=_cmd_wheels if name == "wheels" else _cmd_image)
    d = sub.add_parser("demo", help="run dflash-train:<target> (no arguments: the built-in demo)")
    d.add_argument("--target", default=None, help="target from targets.toml (default: its default_target)")
    d.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the image's entrypoint")
    d.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    return run_demo(tg.load().target(args.target), args.args)


def _cmd_wheels(args) -> int:
    target = tg.load().target(args.target)
    print(build_wheels(target, rebuild=args.rebuild, dry_run=args.dry_run))
    return 0


def _cmd_image(args) -> int:
    target = tg.load().target(args.target)
    print(build_image(target, tag=args.tag, dry_run=args.dry_run))
    return 0
