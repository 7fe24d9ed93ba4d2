"""bench/run_all.py (`make bench`) knows every bench-* target of the Makefile and says, for each one, that it
would run here or why it is skipped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_names_every_benchmark_once():
    targets = re.findall(r"^(bench-[a-z-]+):", (REPO / "Makefile").read_text(), re.M)
    assert len(targets) >= 14
    run = subprocess.run([sys.executable, str(REPO / "bench" / "run_all.py"), "--dry-run", "--preset", "tiny",
                          "--drafter", "no/such/drafter"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = run.stdout.split("\nbenchmarks:\n", 1)[1]
    rows = dict(re.findall(r"^  (bench-[a-z-]+) +(.+)$", summary, re.M))
    assert list(rows) == targets
    assert all(o == "would run" or o.startswith("skipped: needs ") for o in rows.values()), rows
    assert rows["bench-train"] == "would run" and rows["bench-spec-step"] == "would run"  # CPU ones (tiny preset)
    assert rows["bench-eval"].startswith("skipped: needs a trained drafter at DRAFTER=no/such/drafter")


def test_makefile_lists_every_benchmark_as_phony_and_in_help():
    makefile = (REPO / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, re.M)[1].split())
    documented = set(re.findall(r"^([a-z-]+):.*##", makefile, re.M))
    for target in re.findall(r"^(bench(?:-[a-z-]+)?):", makefile, re.M):
        assert target in phony and target in documented, target
