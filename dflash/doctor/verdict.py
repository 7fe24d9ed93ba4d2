"""The doctor's verdict: one result per check, rendered as an aligned table or as JSON, saved atomically.

The JSON document (schema version 1) is what `dflash healthcheck` reads back (`Report.save` writes it):

    {
      "schema": 1,
      "ok": false,                       # no required check failed
      "created": 1767312000.0,           # unix time the run finished
      "quick": false,                    # true when only the cheap subset ran
      "failed": ["dispatch"],            # names of the required checks that failed
      "checks": [
        {"name": "versions", "status": "pass", "required": true, "reason": "...",
         "details": {...}, "seconds": 0.01},
        ...
      ]
    }
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.fsutil import atomic_write

SCHEMA_VERSION = 1
# Where the doctor keeps its verdict and the health check reads it (both honour the env variable).
REPORT_ENV, DEFAULT_REPORT = "DFLASH_DOCTOR_REPORT", "/tmp/dflash/doctor.json"
PASS, FAIL, SKIP = "pass", "fail", "skip"
STATUSES = (PASS, FAIL, SKIP)


@dataclass
class CheckResult:
    """The outcome of one check. `reason` is one line a person can act on; `details` is for machines."""

    name: str
    status: str
    reason: str
    required: bool = True
    details: dict = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check '{self.name}': status '{self.status}' is not one of {', '.join(STATUSES)}.")

    @property
    def blocks(self) -> bool:
        """True when this result makes the whole verdict fail."""
        return self.required and self.status == FAIL


@dataclass
class Report:
    checks: list[CheckResult]
    quick: bool = False
    created: float = field(default_factory=time.time)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.blocks]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "ok": self.ok,
            "created": self.created,
            "quick": self.quick,
            "failed": self.failed,
            "checks": [asdict(c) for c in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str)

    def save(self, path: Path | str) -> Path:
        """Write the JSON to `path` atomically: the health check may read it at any moment and must
        never see half a file. Raises OSError when `path` cannot be written."""
        return atomic_write(path, self.to_json() + "\n")


def render_table(report: Report) -> str:
    """An aligned text table, one row per check; the last line is the verdict.

    CHECK     STATUS  REASON
    versions  pass    torch 2.11.0+cu130 (CUDA 13.0), ...
    dispatch  FAIL    2 of 4 functions fall back to PyTorch: causal_conv1d_fn, ...
    """
    rows = [("CHECK", "STATUS", "REASON")]
    for c in report.checks:
        status = c.status.upper() if c.blocks else c.status
        if c.status == FAIL and not c.required:
            status += " (not required)"
        rows.append((c.name, status, c.reason))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    if report.ok:
        lines.append("verdict: healthy (no required check failed)")
    else:
        lines.append(f"verdict: UNHEALTHY, failed: {', '.join(report.failed)}")
    return "\n".join(lines)

