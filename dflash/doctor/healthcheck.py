"""`dflash healthcheck`: the image's cheap HEALTHCHECK (docs/architecture.md, "The doctor's checks").

The full doctor runs once, at container start (`dflash doctor --save /tmp/dflash/doctor.json`, or
`dflash.doctor.doctor.run_and_save`), and its verdict is kept. This command only reads things back:

    verdict  (DFLASH_DOCTOR_REPORT, default /tmp/dflash/doctor.json)
        missing                  -> exit 1 "doctor has not finished"   (the start period covers this)
        unreadable / bad schema  -> exit 1, naming the file
        ok = false               -> exit 1, naming each failing check   (shows in `docker inspect` health logs)
    heartbeat (DFLASH_HEARTBEAT, default /tmp/dflash/heartbeat; JSON {"time": unix s, "step": n})
        missing                  -> no trainer running: nothing to check
        {"finished": true}       -> the trainer ended on purpose: nothing to check
        {"pid": n}, n gone       -> the trainer is no longer running: nothing to check
        older than DFLASH_HEARTBEAT_MAX_AGE s (default 600) -> exit 1 "trainer stalled"
    otherwise                    -> exit 0

The trainer writes the heartbeat every few steps (dflash/doctor/heartbeat.py); both writers replace
files atomically, so this never reads half a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.train.records.heartbeat import HEARTBEAT_ENV, heartbeat_path
from dflash.doctor.verdict import DEFAULT_REPORT, REPORT_ENV, SCHEMA_VERSION

MAX_AGE_ENV, DEFAULT_MAX_AGE = "DFLASH_HEARTBEAT_MAX_AGE", 600.0


@dataclass(frozen=True)
class Health:
    ok: bool
    message: str

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def _read_json(path: Path, what: str) -> tuple[dict | None, str | None]:
    """(data, None), (None, None) when the file is missing, or (None, error message)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{what} {path} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(data, dict):
        return None, f"{what} {path} holds {type(data).__name__}, not a JSON object"
    return data, None


def check_verdict(path: Path) -> Health:
    data, err = _read_json(path, "doctor verdict")
    if err:
        return Health(False, err + "; rerun `dflash doctor --save " + str(path) + "`")
    if data is None:
        return Health(False, f"doctor has not finished: no verdict at {path} yet")
    if data.get("schema") != SCHEMA_VERSION or "ok" not in data:
        return Health(False, f"doctor verdict {path} has schema {data.get('schema')!r}, this check reads "
                             f"{SCHEMA_VERSION}; rerun `dflash doctor --save {path}` with this image's dflash")
    checks, names = data.get("checks", []), data.get("failed") or []
    if (not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks) or not isinstance(names, list)
            or not isinstance(data["ok"], bool)):
        return Health(False, f"doctor verdict {path} is damaged (ok, checks or failed has the wrong type); "
                             f"rerun `dflash doctor --save {path}`")
    if data["ok"]:
        return Health(True, "doctor: healthy")
    names = [str(n) for n in names] or ["(unnamed)"]
    failed = {str(c.get("name")): c.get("reason", "") for c in checks if str(c.get("name")) in names}
    lines = [f"doctor: failed checks: {', '.join(names)}"] + [f"  {n}: {failed.get(n, '')}" for n in names]
    return Health(False, "\n".join(lines))


def check_heartbeat(path: Path, max_age: float, now: float | None = None) -> Health:
    data, err = _read_json(path, "trainer heartbeat")
    if err:
        return Health(False, err)
    if data is None:
        return Health(True, "trainer: none running (no heartbeat)")
    if data.get("finished"):
        return Health(True, f"trainer: finished at step {data.get('step')}")
    if isinstance(data.get("pid"), int) and not _alive(data["pid"]):
        return Health(True, f"trainer: not running (pid {data['pid']} ended at step {data.get('step')})")
    beat = data.get("time")
    if not isinstance(beat, (int, float)):
        return Health(False, f"trainer heartbeat {path} has no numeric 'time' (got {beat!r})")
    age = (time.time() if now is None else now) - beat
    if age > max_age:
        return Health(False, f"trainer stalled: last heartbeat {age:.0f} s ago at step {data.get('step')} "
                             f"(limit {max_age:.0f} s, {MAX_AGE_ENV})")
    return Health(True, f"trainer: step {data.get('step')}, heartbeat {max(age, 0):.0f} s ago")


def _alive(pid: int) -> bool:
    """Does process `pid` exist? (`docker exec` shares the container's PID namespace with the trainer.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def check(report: Path, heartbeat: Path, max_age: float, now: float | None = None) -> Health:
    """The whole health check: the saved verdict first (a broken image is unhealthy whatever the
    trainer does), then the trainer's heartbeat."""
    verdict = check_verdict(report)
    if not verdict.ok:
        return verdict
    beat = check_heartbeat(heartbeat, max_age, now)
    return Health(beat.ok, f"{verdict.message}; {beat.message}")


def _max_age_from_env() -> float:
    text = os.environ.get(MAX_AGE_ENV, "")
    if not text:
        return DEFAULT_MAX_AGE
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"{MAX_AGE_ENV}={text!r} is not a positive number of seconds; set e.g. {MAX_AGE_ENV}=600.")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash healthcheck", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--report", default=os.environ.get(REPORT_ENV) or DEFAULT_REPORT,
                   help=f"the doctor's saved verdict (env {REPORT_ENV})")
    p.add_argument("--heartbeat", default=str(heartbeat_path()), help=f"the trainer's heartbeat file (env {HEARTBEAT_ENV})")
    p.add_argument("--max-age", type=float, default=None,
                   help=f"seconds a heartbeat stays fresh (env {MAX_AGE_ENV}, default {DEFAULT_MAX_AGE:.0f})")
    args = p.parse_args(argv)
    try:
        max_age = args.max_age if args.max_age is not None else _max_age_from_env()
    except ValueError as e:
        p.error(str(e))
    if max_age <= 0:
        p.error(f"--max-age {max_age} is not a positive number of seconds.")
    health = check(Path(args.report), Path(args.heartbeat), max_age)
    print(("healthy: " if health.ok else "unhealthy: ") + health.message)
    return health.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
