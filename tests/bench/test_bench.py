"""The benchmarks that prepare runs this machine cannot make stay runnable: each runs here at toy size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three torchrun launches with torch + transformers: ~60 s on 2 cores
def test_scaling_benchmark_on_two_gloo_processes(tmp_path):
    """bench_scaling.py (the multi-GPU run's script) on CPU processes: it reports throughput for 1 and 2
    processes and the 2-process losses equal one process's on the same global batch."""
    out = tmp_path / "scaling.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_scaling.py"), "--nprocs", "1,2", "--device", "cpu",
                          "--json", str(out), "--steps", "2", "--warmup", "1", "--hidden", "64", "--layers", "2",
                          "--vocab", "512", "--seq-len", "64", "--anchors", "8", "--drafter-layers", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["nprocs"] for r in result["runs"]] == [1, 2]
    assert all(r["tokens_per_s"] > 0 for r in result["runs"])
    assert result["loss_check"]["max_rel_loss_diff"] < 1e-5
    assert "efficiency" in run.stdout and "loss check: 2 processes vs one" in run.stdout


@pytest.mark.slow  # a tokenizer, a tiny target and two one-step training runs: ~30 s on 2 cores
def test_data_benchmark_at_toy_size(tmp_path):
    """bench_data.py on 300 conversations: rates for 1 and 2 processes, and the second start reads the cache
    (its time to first step below the cold one)."""
    out = tmp_path / "data.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_data.py"), "--conversations", "300",
                          "--procs", "1,2", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["procs"] for r in result["tokenise"]] == [1, 2]
    assert all(r["kept"] == 300 and r["conversations_per_s"] > 0 for r in result["tokenise"])
    assert result["first_step_s"]["second_start"] < result["first_step_s"]["cold_cache"]


def test_drafter_step_benchmark_at_toy_size(tmp_path):
    """bench_drafter.py (the H200 run's script for the drafter step) on the CPU: both head variants time,
    and --numerics puts their fp32 gradients on the reference's (cosine 1 to rounding)."""
    out = tmp_path / "drafter.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_drafter.py"), "--shape", "tiny", "--device", "cpu",
                          "--variants", "before,fused-head", "--reps", "1", "--warmup", "1", "--numerics",
                          "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [v["variant"] for v in result["variants"]] == ["before", "fused-head"]
    assert all(v["step_s"] > 0 for v in result["variants"])
    for name in ("before", "fused-head"):
        assert result["numerics"][name]["all"]["cosine"] > 1 - 1e-9
    assert result["numerics"]["reference_vs_float64_small_shape"]["rel_l2"] < 1e-4
    assert "fused-head: " in run.stdout and "x the step of 'before'" in run.stdout


def test_multi_drafter_benchmark_at_toy_size(tmp_path):
    """bench_multi.py (the H200 run's script for several drafters on one target pass) on the CPU: a step time
    for K = 1, 2, 3 drafters, the table of drafter-steps/s against K separate runs, and the forward's profile."""
    out, profile = tmp_path / "multi.json", tmp_path / "profile.txt"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_multi.py"), "--preset", "small", "--steps", "1",
                          "--warmup", "1", "--seq-len", "128", "--layers", "1", "--json", str(out),
                          "--profile-out", str(profile)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["k"], r["drafter_layers"]) for r in result["rows"]] == [(1, 1), (2, 1), (3, 1)]
    assert all(r["step_s"] > 0 for r in result["rows"])
    assert result["profile"]["forward_ms"] > 0 and result["profile"]["top_kernels"]
    assert "aten::mm" in profile.read_text() and "vs K separate runs" in run.stdout


@pytest.mark.slow  # three short training runs of a tiny random hybrid: ~50 s on 2 cores
@pytest.mark.parametrize("processes, target", [("one", "fp8"), ("each", "bf16")])
def test_length_mix_benchmark_runs_fixed_padded_and_packed_side_by_side(tmp_path, processes, target):
    """bench_train.py --lengths FILE (bench_length_mix.py) on lengths read from a file: the fixed shape, then the
    file's lengths padded and packed, in one run, in one process or each variant in a child process of its own
    (the GPU default), against a bf16 or an FP8 target; each reports useful tokens/s, recompiles and step times,
    and the ratios to the fixed shape are printed."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (40, 120, 90, 33, 128, 64, 77, 100, 25, 110, 58, 128)) + "\n")
    out, system_tmp = tmp_path / "mix.json", tmp_path / "tmp"
    system_tmp.mkdir()
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_train.py"), "--lengths", str(lengths),
                          "--json", str(out), "--hidden", "64", "--layers", "2", "--vocab", "512",
                          "--drafter-layers", "1", "--block-size", "4", "--steps", "2", "--warmup", "1",
                          "--max-length", "128", "--max-tokens", "256", "--anchors", "8", "--pack-tokens", "256",
                          "--pack-anchors", "16", "--variants", "fixed,padded,packed", "--processes", processes]
                         + (["--fp8-target"] if target == "fp8" else []),
                         cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(system_tmp)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["lengths"]["n"] == 12
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["fixed", "padded", "packed"]
    assert rows["fixed"]["tokens_per_step"] == [2 * 128] * 3  # two sequences of --max-length each step
    assert rows["packed"]["recompiles_after_first_step"] == 0
    assert all(r["steps"] == 3 and r["useful_tokens_per_s"] > 0 for r in rows.values())
    assert all(t <= 256 for t in rows["packed"]["tokens_per_step"])
    assert "packed / padded useful tokens/s" in run.stdout
    assert "packed / the fixed-shape figure" in run.stdout and "padded / the fixed-shape figure" in run.stdout
    assert f'"target": "{target}", "processes": "{processes}"' in run.stdout
    fp8 = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"fp8_layers"')]
    assert [f["fp8_layers"] > 0 for f in fp8] == ([True] if target == "fp8" else [])
    leftovers = [p.name for p in system_tmp.iterdir() if p.name.startswith("bench-mix")]
    assert not leftovers, leftovers  # children stopped after their rows leave no run directory behind


@pytest.mark.slow  # one short training run of a tiny random hybrid: ~15 s on 2 cores
def test_length_mix_writes_a_variants_row_before_the_end_of_run_checkpoint(tmp_path, monkeypatch):
    """The row of a variant is in --json when its last step ends, before the trainer's end-of-run checkpoint
    (about 45 s at the 27B shape, not measured): a parent stops its child there, and a run cut off later
    keeps the row."""
    from dflash.train.lane import Lane

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import bench_length_mix

    out, seen = tmp_path / "mix.json", []
    save = Lane.save

    def save_after_looking(lane):
        seen.append([r["variant"] for r in json.loads(out.read_text())["rows"]] if out.exists() else None)
        return save(lane)

    monkeypatch.setattr(Lane, "save", save_after_looking)
    code = bench_length_mix.main(["--json", str(out), "--hidden", "64", "--layers", "2", "--vocab", "512",
                                  "--drafter-layers", "1", "--block-size", "4", "--steps", "2", "--warmup", "1",
                                  "--sequences", "12", "--max-length", "128", "--pack-tokens", "256",
                                  "--pack-anchors", "16", "--variants", "packed", "--work-dir", str(tmp_path)])
    assert code == 0
    assert seen == [["packed"]]
    assert [r["steps"] for r in json.loads(out.read_text())["rows"]] == [3]


@pytest.mark.slow  # two random targets and two short training loops: ~40 s on 2 cores
def test_fp8_benchmark_at_toy_size(tmp_path):
    """bench_fp8.py (the H200 run's script) on the CPU at toy size: both targets time, the FP8 weights are
    smaller, the tapped states diverge measurably, and the ratios are printed."""
    out = tmp_path / "fp8.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_fp8.py"), "--device", "cpu", "--shape", "toy",
                          "--steps", "2", "--warmup", "1", "--reps", "1", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    row = result["fp8"]["dequant"]
    assert result["bf16"]["ok"] and row["ok"] and row["tokens_per_s"] > 0
    assert row["weight_gb"] < result["bf16"]["weight_gb"]
    assert all(0 < v < 0.5 for v in row["tapped_rel_l2"].values())
    assert "FP8 (dequant) vs bf16: target forward" in run.stdout and "tapped-state divergence" in run.stdout
    assert result["bf16"]["whole_decoder_s"] > 0 and "vs the whole decoder" in run.stdout
