"""bench_spec_step.py (the per-step cost of speculative decoding) stays runnable: the tiny preset on a CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_spec_step_benchmark_tiny_on_cpu():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_spec_step.py"), "--preset", "tiny",
                          "--device", "cpu", "--prefill", "128", "--reps", "3", "--warmup", "1", "--threads", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert out.startswith("torch ") and "CPU" in out.splitlines()[0]
    times = {m[1]: float(m[2]) for m in re.finditer(r"^(greedy|verify, accept all|verify, reject half|draft) +([\d.]+)$",
                                                    out, re.M)}
    assert set(times) == {"greedy", "verify, accept all", "verify, reject half", "draft"}, out
    assert all(t > 0 for t in times.values()), times
    assert "speedup(tau) ≈ tau × t_greedy / (t_verify + t_draft)" in out
    bounds = re.findall(r"^ +(\d+) +([\d.]+)x +([\d.]+)x$", out, re.M)
    assert [b[0] for b in bounds] == ["3", "5", "7"], out
    for tau, reject_half, accept_all in bounds:  # the bound is tau x t_greedy / (t_verify + t_draft)
        expect = int(tau) * times["greedy"] / (times["verify, reject half"] + times["draft"])
        assert abs(float(reject_half) - expect) <= 0.006 + 0.01 * expect
