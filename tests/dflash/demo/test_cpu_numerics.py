"""The demo writes the same drafter bytes and prints the same tau whatever CPU and core count run it.

Another machine is emulated on this one by what changes there: the kernel paths ATen and MKL would pick
(ATen's AVX2 kernels against its baseline ones, MKL held below its best instruction set) and the number of
threads torch starts with (OMP_NUM_THREADS 2 against 16). Each run is the real `dflash-train` demo, shrunk
(a briefly pre-trained target, a few training steps), in its own process: ATen and MKL fix their paths at
their first kernel. The control runs the same two machines with --cpu-kernels native and must differ, or
the emulation would prove nothing. A CPU with AVX-512 cannot be emulated on one without it; the held
paths do not use it (dflash.demo.cpu_numerics).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest

from dflash.demo import cpu_numerics

SHRUNK = ["--pretrain-steps", "8", "--max-steps", "6", "--demo-conversations", "12", "--eval-prompts", "1",
          "--eval-new-tokens", "12", "--regen-new-tokens", "24", "--no-progress"]
# two machines as ATen, MKL and OpenMP see them
MACHINES = {
    "avx2, 2 cores": {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"},
    "baseline, 16 cores": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                           "OMP_NUM_THREADS": "16"},
}


def _start(out, machine: dict, kernels: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in cpu_numerics.HELD_ENV and k != "MKL_ENABLE_INSTRUCTIONS"}
    env.update(machine)
    args = [sys.executable, "-m", "dflash.cli", "train", "--out", str(out / "run"), "--demo-dir", str(out / "cache"),
            "--cpu-kernels", kernels, *SHRUNK]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _outcome(out, proc: subprocess.Popen) -> tuple[str, str]:
    """(sha256 of the drafter's weights, the trained drafter's result line)."""
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    weights = (out / "run" / "drafter" / "model.safetensors").read_bytes()
    line = re.search(r"^trained drafter\s+(\S+).*$", log, re.M)
    assert line, log[-3000:]
    return hashlib.sha256(weights).hexdigest(), line.group(1)


def _runs(tmp_path, kernels: str) -> dict:
    outs = {name: tmp_path / f"{kernels}-{i}" for i, name in enumerate(MACHINES)}
    procs = {name: _start(outs[name], env, kernels) for name, env in MACHINES.items()}
    return {name: _outcome(outs[name], procs[name]) for name in MACHINES}


@pytest.mark.slow
def test_portable_kernels_give_the_same_drafter_and_tau_on_both_machines(tmp_path):
    held = _runs(tmp_path, "portable")
    assert len(set(held.values())) == 1, held
    native = _runs(tmp_path, "native")  # the control: left to choose, the two machines train other drafters
    assert native["avx2, 2 cores"][0] != native["baseline, 16 cores"][0], native


def test_hold_changes_nothing_in_a_process_whose_kernels_are_already_fixed(caplog):
    """In this process tensor ops have run: ATen has fixed its path, so hold() leaves ATen, MKL and oneDNN
    as they are (a half-held process would change the numerics of whatever runs next) and says so."""
    import torch

    torch.ones(4).sum()
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this process already runs ATen's baseline kernels")
    before = ({k: os.environ.get(k) for k in cpu_numerics.HELD_ENV}, torch.backends.mkldnn.enabled)
    assert cpu_numerics.hold() is False
    assert ({k: os.environ.get(k) for k in cpu_numerics.HELD_ENV}, torch.backends.mkldnn.enabled) == before
    assert "a tensor op ran earlier in this process" in caplog.text
    assert cpu_numerics.kernels() == "native"
