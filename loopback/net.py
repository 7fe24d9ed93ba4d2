"""Ports and processes on 127.0.0.1: a free port, waiting until a server listens, stopping it."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (free when asked; bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    """Return once 127.0.0.1:PORT accepts connections; raise RuntimeError with the end of `log` when `proc`
    exits first or `timeout` seconds pass (then `proc` is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen, timeout: float = 5) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
