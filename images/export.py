"""`export`: an image as the artifacts Proxmox restores, each with its JSON record.

    oci       IMAGE-ID.oci.tar   OCI layout archive for PVE >= 9.1                 (images/oci.py)
    template  IMAGE-ID.tar.zst   deterministic rootfs template for PVE < 9.1, LXC  (images/template.py)

Each artifact gets NAME.json beside it (name, size, sha256, image id, labels, config: images/records.py).
Files are written under a temporary name in the same directory and renamed when complete.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.fsutil import exclusive, source_date_epoch

from .errors import ExportError
from .imageinfo import inspect_image
from .oci import export_oci
from .records import write_record
from .template import export_template

DEFAULT_OUT = Path("dist/images")


@dataclass
class ExportResult:
    artifacts: list[Path] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def export(image: str, fmt: str, out_dir: Path, *, epoch: int | None = None, level: int = 10,
           progress: bool = True) -> ExportResult:
    """Export `image` as 'oci', 'template' or 'both'; each artifact gets its JSON record."""
    if fmt not in ("oci", "template", "both"):
        raise ExportError(f"--format '{fmt}' is not one of oci, template, both.")
    # One export per output directory at a time: two would write the same temporary names
    # (.NAME.tmp) and rename each other's half-written files into place. A second one is refused (7).
    with exclusive(Path(out_dir), "export"):
        info = inspect_image(image)
        result = ExportResult()
        for kind in (("oci", "template") if fmt == "both" else (fmt,)):
            t0 = time.monotonic()
            if kind == "oci":
                path = export_oci(info, out_dir)
                extra = {}
            else:
                e = source_date_epoch() if epoch is None else epoch
                path, libcuda = export_template(info, out_dir, epoch=e, level=level, progress=progress)
                extra = {"source_date_epoch": e, "zstd_level": level, "libcuda_in_image": libcuda}
            result.seconds[kind] = time.monotonic() - t0
            result.artifacts.append(path)
            result.records.append(write_record(path, info, kind, **extra))
    return result


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------

def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """--target and --image, shared by `export` and `push`: the image defaults to the one
    `make image` builds for the target."""
    parser.add_argument("--target", default=None, help="target from targets.toml (default: its default_target)")
    parser.add_argument("--image", default=None, help="image in the local engine (default: dflash-train:<target>)")


def image_from_args(args: argparse.Namespace) -> str:
    if args.image:
        return args.image
    from wheelbuilder import targets as tg

    from .build import image_tag

    return image_tag(tg.load().target(args.target))


def _cmd_export(args: argparse.Namespace) -> int:
    result = export(image_from_args(args), args.format, Path(args.out_dir), epoch=args.source_date_epoch,
                    level=args.zstd_level)
    for rec, path in zip(result.records, result.artifacts):
        print(f"{path}  {rec['size'] / 1e6:.1f} MB  sha256 {rec['sha256']}  ({result.seconds[rec['format']]:.1f}s)")
    return 0


def register(subparsers) -> None:
    """Add `export` to the images CLI."""
    p = subparsers.add_parser("export", help="export an image as an OCI archive (PVE >= 9.1) or a rootfs template",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_image_arguments(p)
    p.add_argument("--format", choices=("oci", "template", "both"), default="both")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT))
    p.add_argument("--source-date-epoch", type=int, default=None,
                   help="mtime of every template entry (default: $SOURCE_DATE_EPOCH or "
                        "common.fsutil.DEFAULT_SOURCE_DATE_EPOCH, 2025-01-01)")
    p.add_argument("--zstd-level", type=int, default=10)
    p.set_defaults(func=_cmd_export)
