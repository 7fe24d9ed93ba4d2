"""`python -m images`: the image lifecycle from the command line (the Makefile's targets call this).

    python -m images engine                     make sure a Docker engine with BuildKit runs
    python -m images base                       bootstrap dflash-base:bookworm from a Debian mirror
    python -m images wheels --target T          builder stage -> dist/wheels/T/ (wheels + manifest.json)
    python -m images wheels-matrix              every target that builds here, then dist/index (PEP 503)
    python -m images image --target T           runtime image dflash-train:T from those wheels
    python -m images export ... / push ...      OCI archive or LXC template; ship to a Proxmox host
    python -m images publish --registry R       push the image and its SBOM to an OCI registry
    python -m images push-docker --host H       stream the image to a Docker host over SSH, run its doctor

Exit codes: images/errors.py (8-16, and wheelbuilder's 1-7 for what it raises from there).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from common.cli import DefaultsOnceHelpFormatter, add_version
from common.cli import run_cli

# Modules that add their own subcommands through `register(subparsers)`.
SUBCOMMAND_MODULES = ("images.build", "images.matrix", "images.pins", "images.export", "images.push", "images.publish",
                      "images.push_docker")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m images", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(p, "dflash-images")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engine", help="make sure a Docker engine with BuildKit runs (starts one as root)")
    e.set_defaults(func=_engine)
    b = sub.add_parser("base", help="bootstrap the offline Debian base image", formatter_class=DefaultsOnceHelpFormatter)
    b.add_argument("--tag", default="dflash-base:bookworm", help="image tag to create")
    b.add_argument("--suite", default="bookworm", help="Debian suite")
    b.add_argument("--mirror", default=None, help="Debian mirror (default: $DEBIAN_MIRROR or deb.debian.org)")
    b.add_argument("--force", action="store_true", help="rebuild even if the tag exists")
    b.set_defaults(func=_base)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.register(sub)
    return p


def _engine(args) -> int:
    from .engine import docker_cli, ensure_engine

    ensure_engine()
    print(f"engine running; builds use {docker_cli()}")
    return 0


def _base(args) -> int:
    from .base import DEFAULT_MIRROR, bootstrap

    print(bootstrap(args.tag, args.suite, args.mirror or DEFAULT_MIRROR, force=args.force))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # run_cli catches FatalError: ImagesError and wheelbuilder's errors alike (see images/errors.py).
    return run_cli("images", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
