"""The JSON record beside each exported artifact: NAME.json holds its name, format, size, sha256 and
the config of the image it came from (plus, for a template, its SOURCE_DATE_EPOCH, zstd level and the
libcuda files the image ships). `push` reads it to reuse an export and to check the driver libraries.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from common.fsutil import atomic_write, sha256_file

from .errors import ExportError
from .imageinfo import ImageInfo


def record_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def write_record(artifact: Path, info: ImageInfo, fmt: str, **extra) -> dict:
    """NAME.json beside the artifact: what it is, how big, its sha256 and the image it came from."""
    record = {"name": artifact.name, "format": fmt, "size": artifact.stat().st_size,
              "sha256": sha256_file(artifact), "image": asdict(info), **extra}
    atomic_write(record_path(artifact), json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def read_record(artifact: Path) -> dict:
    path = record_path(artifact)
    if not path.exists():
        raise ExportError(f"{artifact} has no record {path.name} beside it; export it again with `export`.")
    return json.loads(path.read_text())


def shadowing_libcuda(record: dict) -> list[str]:
    """libcuda files of the image that the loader would pick before the host driver's bind-mounted one:
    those in a directory of the image's LD_LIBRARY_PATH (e.g. a CUDA forward-compat package)."""
    env = dict(e.split("=", 1) for e in record.get("image", {}).get("env", []) if "=" in e)
    dirs = {d.rstrip("/") for d in env.get("LD_LIBRARY_PATH", "").split(":") if d}
    return [p for p in record.get("libcuda_in_image", []) if os.path.dirname(p) in dirs]
