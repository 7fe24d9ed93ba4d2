"""The dflash-train image's entrypoint (`dflash entrypoint`, run under tini).

    docker run dflash-train                 the built-in demo (dflash-train with no arguments)
    docker run dflash-train --target ...    dflash-train with those options
    docker run dflash-train doctor --json   the kernel report (any dflash subcommand works)
    docker run dflash-train bash            any other command runs as is

Before a training run starts, the full doctor is started once in the background; its verdict lands in
$DFLASH_STATE_DIR/doctor.json, which the image's HEALTHCHECK (`dflash healthcheck`) reads together with
the trainer's heartbeat. The doctor is double-forked so that tini, not the trainer, reaps it.

When the entrypoint is the container's init (a Proxmox OCI container runs it instead of the template's
/sbin/init), it first mounts /dev/shm and brings lo up where they are missing, as root (pid1.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DFLASH_SUBCOMMANDS = ("train", "eval", "regenerate", "doctor", "healthcheck")


def state_dir() -> Path:
    return Path(os.environ.get("DFLASH_STATE_DIR", "/tmp/dflash"))


def command_for(argv: list[str]) -> tuple[list[str], bool]:
    """(command to exec, whether the background doctor should run first)."""
    if not argv or argv[0].startswith("-"):
        return ["dflash-train", *argv], True
    if argv[0] in DFLASH_SUBCOMMANDS:
        return ["dflash", *argv], argv[0] in ("train", "eval", "regenerate")
    return argv, True


def start_background_doctor() -> None:
    """Run `dflash doctor --save <state>/doctor.json` detached from this process."""
    state = state_dir()
    state.mkdir(parents=True, exist_ok=True)
    report = state / "doctor.json"
    os.environ.setdefault("DFLASH_DOCTOR_REPORT", str(report))
    if os.fork() == 0:  # child: new session, fork again, exit -> grandchild is reparented to PID 1
        os.setsid()
        if os.fork() == 0:
            with open(state / "doctor.log", "ab", buffering=0) as log, open(os.devnull, "rb") as null:
                os.dup2(null.fileno(), 0)
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
            os.execvp("dflash", ["dflash", "doctor", "--save", str(report)])
        os._exit(0)
    os.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from dflash.doctor.pid1 import prepare_as_init

    prepare_as_init()
    command, doctor_first = command_for(argv)
    if doctor_first:
        start_background_doctor()
    sys.stdout.flush()
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(f"dflash entrypoint: '{command[0]}' is not a command in this image. "
              f"Run a dflash subcommand ({', '.join(DFLASH_SUBCOMMANDS)}), dflash-train options, or a program "
              "such as bash.", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
