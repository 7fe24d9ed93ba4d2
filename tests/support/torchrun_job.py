"""A dflash-train job of real gloo processes on CPU, started as a scheduler starts one, for the fault tests.

    job = TorchrunJob.start(tmp_path, argv)            torchrun --standalone --nproc-per-node 2 running
                                                        tests.support.dflash_rank (each rank's output in
                                                        logs/.../<rank>/stderr.log, torchrun's in torchrun.txt)
    job = TorchrunJob.start(tmp_path, argv, launcher=True)   dflash-train --nproc-per-node 2 (its output in
                                                        launcher.txt)

The launcher runs in a session of its own, as under a scheduler, so that a test can signal its process
group; torchrun starts every rank in a session of its own too. `ranks()` finds the ranks' pids among the
launcher's children, `exits()` reads what torchrun's summary says each rank exited with.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wait_for(condition, what: str, seconds: float = 300, every: float = 0.1) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {seconds:.0f} s")
        time.sleep(every)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class TorchrunJob:
    process: subprocess.Popen
    folder: Path
    launcher: bool
    seen: dict = field(default_factory=dict)  # {rank: pid} of every rank ranks() found

    @classmethod
    def start(cls, tmp_path: Path, argv: list[str], *, launcher: bool = False, env: dict | None = None,
              nproc: int = 2) -> "TorchrunJob":
        folder = tmp_path / "job"
        folder.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat"), **(env or {})}
        if launcher:
            cmd = [sys.executable, "-c", "import sys; from dflash.cli import train_main; sys.exit(train_main())",
                   "--nproc-per-node", str(nproc), *argv]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "--log-dir", str(folder / "logs"), "--redirects", "3", "-m", "tests.support.dflash_rank",
                   "train", *argv]
        with open(folder / ("launcher.txt" if launcher else "torchrun.txt"), "w") as own:
            process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=own, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        return cls(process, folder, launcher)

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the launcher's children that run a rank (RANK in their environment)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        found = {}
        for pid in children.read_text().split() if children.exists() else []:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
        self.seen.update(found)
        return found

    def wait(self, seconds: float = 240) -> int:
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """What a test leaves behind: nothing (the launcher's group, then every rank it was seen to start)."""
        self.ranks()
        for pid in [self.process.pid, *self.seen.values()]:
            try:
                os.killpg(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait(timeout=30)

    def output(self) -> str:
        return (self.folder / ("launcher.txt" if self.launcher else "torchrun.txt")).read_text()

    def rank_log(self, rank: int) -> str:
        return next((self.folder / "logs").rglob(f"{rank}/stderr.log")).read_text()

    def exits(self) -> dict[int, int]:
        """{rank: exit code} of the ranks torchrun's summary lists (those that did not exit 0)."""
        found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", self.output())
        return {int(rank): int(code) for rank, code in found}
