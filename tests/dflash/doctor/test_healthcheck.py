"""`dflash healthcheck`: the saved doctor verdict plus the trainer heartbeat decide the exit code; the
trainer's side of the heartbeat."""

from __future__ import annotations

import json
import time

import pytest

from dflash.doctor import healthcheck
from dflash.train.records import heartbeat
from dflash.doctor import doctor
from dflash.doctor.verdict import FAIL, PASS, SKIP, CheckResult, Report


@pytest.fixture
def paths(tmp_path, monkeypatch):
    report, beat = tmp_path / "doctor.json", tmp_path / "heartbeat"
    monkeypatch.setenv(healthcheck.REPORT_ENV, str(report))
    monkeypatch.setenv(heartbeat.HEARTBEAT_ENV, str(beat))
    monkeypatch.delenv(healthcheck.MAX_AGE_ENV, raising=False)
    return report, beat


def save_verdict(path, *failing: str) -> None:
    checks = [CheckResult("versions", PASS, "torch 2.11.0"), CheckResult("numerics", SKIP, "no GPU")]
    checks += [CheckResult(name, FAIL, f"{name} is broken: fix it") for name in failing]
    Report(checks).save(path)


def run(capsys, *argv) -> tuple[int, str]:
    code = healthcheck.main(list(argv))
    return code, capsys.readouterr().out


def test_no_verdict_yet(paths, capsys):
    code, out = run(capsys)
    assert code == 1 and "doctor has not finished" in out and str(paths[0]) in out


def test_failing_verdict_names_each_failed_check(paths, capsys):
    save_verdict(paths[0], "import", "dispatch")
    code, out = run(capsys)
    assert code == 1 and out.startswith("unhealthy:")
    assert "failed checks: import, dispatch" in out and "dispatch is broken: fix it" in out


def test_passing_verdict_without_trainer(paths, capsys):
    save_verdict(paths[0])
    code, out = run(capsys)
    assert code == 0 and "no heartbeat" in out


def test_fresh_heartbeat(paths, capsys):
    save_verdict(paths[0])
    heartbeat.write_heartbeat(42)  # path from DFLASH_HEARTBEAT
    code, out = run(capsys)
    assert code == 0 and "step 42" in out


def test_stale_heartbeat(paths, capsys):
    save_verdict(paths[0])
    heartbeat.write_heartbeat(7, paths[1], now=time.time() - 900)
    code, out = run(capsys)
    assert code == 1 and "trainer stalled" in out and "step 7" in out
    code, _ = run(capsys, "--max-age", "3600")
    assert code == 0


def test_max_age_from_env(paths, capsys, monkeypatch):
    save_verdict(paths[0])
    heartbeat.write_heartbeat(3, paths[1], now=time.time() - 120)
    monkeypatch.setenv(healthcheck.MAX_AGE_ENV, "60")
    assert run(capsys)[0] == 1
    monkeypatch.setenv(healthcheck.MAX_AGE_ENV, "soon")
    with pytest.raises(SystemExit) as e:
        healthcheck.main([])
    assert e.value.code == 2 and healthcheck.MAX_AGE_ENV in capsys.readouterr().err


def test_finished_trainer_is_not_stale(paths, capsys):
    save_verdict(paths[0])
    heartbeat.write_heartbeat(1000, paths[1], finished=True, now=time.time() - 10 ** 6)
    code, out = run(capsys)
    assert code == 0 and "finished at step 1000" in out


def test_stale_heartbeat_of_an_ended_trainer(paths, capsys):
    """A heartbeat whose writer process is gone means no trainer runs: nothing to be stale."""
    import subprocess
    import sys

    save_verdict(paths[0])
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    paths[1].write_text(json.dumps({"time": time.time() - 10 ** 5, "step": 9, "pid": int(ended.stdout)}))
    code, out = run(capsys)
    assert code == 0 and "not running" in out and "step 9" in out


def test_broken_verdict_beats_a_fresh_heartbeat(paths, capsys):
    save_verdict(paths[0], "arch")
    heartbeat.write_heartbeat(5, paths[1])
    assert run(capsys)[0] == 1


@pytest.mark.parametrize("text,expect", [("{not json", "unreadable"), ("[1, 2]", "not a JSON object"),
                                         ('{"ok": true}', "schema")])
def test_corrupt_verdict(paths, capsys, text, expect):
    paths[0].write_text(text)
    code, out = run(capsys)
    assert code == 1 and expect in out


def test_corrupt_heartbeat(paths, capsys):
    save_verdict(paths[0])
    paths[1].write_text('{"step": 3}')
    code, out = run(capsys)
    assert code == 1 and "no numeric 'time'" in out


def test_heartbeat_write_is_atomic(paths):
    heartbeat.write_heartbeat(1, paths[1])
    heartbeat.write_heartbeat(2, paths[1])
    assert json.loads(paths[1].read_text())["step"] == 2
    assert sorted(p.name for p in paths[1].parent.iterdir()) == ["heartbeat"]


def test_real_doctor_verdict_round_trip(paths, capsys):
    """The doctor's own saved verdict (the cheap subset, on this machine) drives the health check."""
    code = doctor.run_and_save(opts=doctor.Options(quick=True))  # path from DFLASH_DOCTOR_REPORT
    data = json.loads(paths[0].read_text())
    assert code == (0 if data["ok"] else 1)
    hc, out = run(capsys)
    assert hc == code
    for name in data["failed"]:
        assert name in out


def test_trainer_heartbeat_is_rate_limited_and_marks_the_end(tmp_path):
    hb = heartbeat.Heartbeat(tmp_path / "hb" / "heartbeat", every=3600)
    hb.beat(1)
    hb.beat(2)  # within the interval: not written
    data = json.loads(hb.path.read_text())
    assert data["step"] == 1 and "time" in data and "finished" not in data
    hb.beat(3, force=True)
    assert json.loads(hb.path.read_text())["step"] == 3
    hb.finish(4)
    assert json.loads(hb.path.read_text()) | {"time": 0, "pid": 0} == {"step": 4, "finished": True, "time": 0, "pid": 0}
