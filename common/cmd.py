"""One subprocess wrapper: prints `+ cmd`, checks the executable exists, tees output to a log file,
and raises a typed error naming the log on failure.

The child runs in its own session, and whatever ends the wait early (Ctrl-C, SIGTERM via
common.cli.Terminated, any exception) stops every process of that session, pip and every compiler it
started included, before the exception goes on: no child outlives the command that started it.

The session, not the child's process group, is what holds them all: ninja puts each compile job in a
process group of its own (so that a terminal's Ctrl-C reaches only ninja), and stops its jobs only once
it has caught the signal itself. `kill_group` therefore signals every process of the session, waits until
none is left (pip, the leader, exits long before ninja's jobs do), and only then returns."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable, Sequence

from .errors import BuildError, FatalError, ToolchainError


def echo(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def require_tool(tool: str, why: str, error: type[FatalError] = ToolchainError) -> str:
    """The path of `tool` on PATH; raises `error` saying why it is needed and how to install it."""
    found = shutil.which(tool)
    if not found:
        raise error(f"'{tool}' is not installed; it is needed to {why}. Install it (apt install {tool}).")
    return found


def session_members(sid: int) -> list[int]:
    """The live processes (zombies excluded) of session `sid`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # it ended while we looked
            continue
        # fields: state, ppid, pgrp, session, ... (proc(5)); Z and X are dead, waiting to be reaped
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended since it was listed
            pass


def kill_group(proc: subprocess.Popen, grace: float = 5.0, poll: float = 0.05) -> None:
    """Stop `proc` (started with start_new_session=True) and every process of its session: SIGTERM to
    each (once; those started meanwhile get theirs when they appear), SIGKILL to whatever is left after
    `grace` seconds. Returns only once no process of the session is alive and the child is reaped.

    A second Ctrl-C or SIGTERM during the grace skips the rest of it; it is raised once the session is
    empty (a SIGKILLed process is gone within moments), so the caller's clean-up still runs after."""
    sid = proc.pid
    pending: BaseException | None = None
    termed: set[int] = set()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            left = session_members(sid)
            if not left:
                break
            _signal_all([p for p in left if p not in termed], signal.SIGTERM)
            termed.update(left)
            proc.poll()  # reap the leader once it exits (the others are reaped by their own parents)
            time.sleep(poll)
        except BaseException as e:  # impatience: straight to SIGKILL
            pending = e
            break
    while True:
        try:
            left = session_members(sid)
            if not left:
                break
            _signal_all(left, signal.SIGKILL)
            proc.poll()
            time.sleep(poll)
        except BaseException as e:  # finish the (short) wait first, then let the interruption go on
            pending = pending or e
    proc.wait()
    if pending is not None:
        raise pending


def run(
    cmd: Sequence[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    error: type[FatalError] = BuildError,
    quiet: bool = False,
) -> str:
    """Run `cmd`; return its stdout+stderr. With `log`, append every line to it; `on_line` sees each line
    (progress parsing). Raises `error` with the tail of the output on a non-zero exit."""
    cmd = [str(c) for c in cmd]
    if shutil.which(cmd[0], path=(env or os.environ).get("PATH")) is None and not Path(cmd[0]).exists():
        raise ToolchainError(f"'{cmd[0]}' was not found on PATH; it is needed to run: {shlex.join(cmd)}")
    if not quiet:
        echo(f"+ {shlex.join(cmd)}")
    lines: list[str] = []
    logf = open(log, "a", encoding="utf-8", buffering=1) if log else None  # line-buffered: tail -f works
    try:
        if logf:
            logf.write(f"+ {shlex.join(cmd)}\n")
            logf.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", start_new_session=True)
        except OSError as e:  # not executable, a directory, a bad interpreter line, ...
            raise ToolchainError(f"'{cmd[0]}' cannot be run ({e.strerror or e}); check that it is an executable "
                                 f"file (chmod +x) for a toolkit that fits this machine. Command: {shlex.join(cmd)}"
                                 ) from None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line)
                if logf:
                    logf.write(line)
                if on_line:
                    on_line(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:  # Ctrl-C, SIGTERM, an error in on_line: take the whole group down first
            kill_group(proc)
            raise
        finally:
            proc.stdout.close()
    finally:
        if logf:
            logf.close()
    out = "".join(lines)
    if rc != 0:
        tail = "".join(lines[-25:])
        where = f" Full log: {log}." if log else ""
        raise error(f"command failed with exit code {rc}: {shlex.join(cmd)}{where}\n--- last lines ---\n{tail}", ) \
            if rc > 0 else error(f"command was killed by signal {-rc}: {shlex.join(cmd)}{where}\n{tail}")
    return out
