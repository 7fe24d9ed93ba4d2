"""common.cmd: the one subprocess wrapper stops every process a command started, on a real process tree.

The tree is what a compile looks like to `kill_group`: a leader (pip) that dies at once on SIGTERM, a
grandchild in its group that takes a moment to exit on SIGTERM, one that ignores SIGTERM (only SIGKILL
stops it), and one in a process group of its own (ninja's compile jobs) that also exits slowly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.cmd import kill_group, run

SLOW = ("import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(1)))\ntime.sleep(300)\n")
DEAF = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)\n"
LEADER = f"""
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-S", "-c", {SLOW!r}]),
        subprocess.Popen([sys.executable, "-S", "-c", {DEAF!r}]),
        subprocess.Popen([sys.executable, "-S", "-c", {SLOW!r}], process_group=0)]
time.sleep(0.3)  # the grandchildren's handlers are installed
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(300)
"""


def alive_in(sid: int) -> list[int]:
    """Live processes (zombies excluded) whose process group or session is `sid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if sid in (int(fields[2]), int(fields[3])) and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def start_tree() -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-S", "-c", LEADER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    kids = [int(p) for p in proc.stdout.readline().split()]
    assert len(kids) == 3, "the leader did not start its grandchildren"
    return proc, kids


def test_kill_group_returns_only_when_the_whole_tree_is_gone_20_times():
    for i in range(20):
        proc, kids = start_tree()
        try:
            assert set(kids) <= set(alive_in(proc.pid))
            t0 = time.monotonic()
            kill_group(proc, grace=0.5)
            took = time.monotonic() - t0
            left = alive_in(proc.pid)
        finally:
            proc.stdout.close()
            for pid in [proc.pid, *kids]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert not left, f"round {i}: {left} outlived kill_group (the tree was {proc.pid} {kids})"
        assert proc.returncode is not None
        assert took >= 0.5, "the one that ignores SIGTERM needs the SIGKILL after the grace"


def test_an_interrupted_run_leaves_no_process_behind():
    """`run` (what the build calls): an exception while it reads the output stops the whole tree first."""
    started: list[int] = []

    def on_line(line: str) -> None:
        started.extend(int(p) for p in line.split())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run([sys.executable, "-S", "-c", LEADER], on_line=on_line, quiet=True)
    assert len(started) == 3
    left = [p for p in started if _alive(p)]
    assert not left, f"{left} outlived the interrupted command"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
