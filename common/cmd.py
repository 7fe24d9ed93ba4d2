"""One subprocess wrapper: prints `+ cmd`, checks the executable exists, tees output to a log file,
and raises a typed error naming the log on failure.

The child runs in its own process group (its own session), and whatever ends the wait early
(Ctrl-C, SIGTERM via common.cli.Terminated, any exception) kills that whole group, pip and every compiler
it started included, before the exception goes on: no child outlives the command that started it."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from .errors import BuildError, FatalError, ToolchainError


def echo(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def require_tool(tool: str, why: str, error: type[FatalError] = ToolchainError) -> str:
    """The path of `tool` on PATH; raises `error` saying why it is needed and how to install it."""
    found = shutil.which(tool)
    if not found:
        raise error(f"'{tool}' is not installed; it is needed to {why}. Install it (apt install {tool}).")
    return found


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the child's process group, SIGKILL to it after `grace` seconds; reaps the child."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader has exited; its children (compilers started by pip) may still run in the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    proc.wait()


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
