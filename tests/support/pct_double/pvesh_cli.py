"""The `pvesh` double: only `pvesh create /nodes/NODE/storage/STORAGE/oci-registry-pull --reference REF
[--filename NAME]`, done as pve-storage does it (src/PVE/API2/Storage/Status.pm, method oci_registry_pull,
since PVE 9.1): check the reference against the API's pattern, name the file
normalize_content_filename(NAME or REF) + ".tar", refuse to override an existing file, then
`skopeo copy docker://REF oci-archive:DIR/NAME.tmp.PID` and rename. skopeo reads its usual trust
(/etc/containers/certs.d/HOST/ca.crt) and credentials ($REGISTRY_AUTH_FILE, auth.json), as on the node."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

TEMPLATE_DIR = Path(os.environ.get("PCT_DOUBLE_TEMPLATE_DIR", "/var/lib/vz/template/cache"))
REFERENCE = re.compile(  # the API's pattern for `reference`, verbatim from Status.pm
    r"^(?:(?:[a-zA-Z\d]|[a-zA-Z\d][a-zA-Z\d-]*[a-zA-Z\d])(?:\.(?:[a-zA-Z\d]|[a-zA-Z\d][a-zA-Z\d-]*[a-zA-Z\d]))*"
    r"(?::\d+)?/)?[a-z\d]+(?:(?:[._]|__|[-]*)[a-z\d]+)*(?:/[a-z\d]+(?:(?:[._]|__|[-]*)[a-z\d]+)*)*:\w[\w.-]{0,127}$")


def die(msg: str) -> None:
    print(msg, file=sys.stderr)
    sys.exit(255)


def normalize_content_filename(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", re.sub(r"^.*[/\\]", "", name.strip()))


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "create":
        die(f"pvesh double: only `create .../oci-registry-pull` is implemented, not {' '.join(argv[:2])}")
    m = re.fullmatch(r"/?nodes/([\w.-]+)/storage/([\w-]+)/oci-registry-pull", argv[1])
    if not m:
        die(f"No '{argv[0]}' handler defined for '{argv[1]}'")
    node, storage = m.groups()
    if node not in ("localhost", socket.gethostname()):
        die(f"hostname lookup '{node}' failed - failed to get address info for: {node}")
    opts = dict(zip(argv[2::2], argv[3::2]))
    ref, name = opts.get("--reference"), opts.get("--filename")
    if not ref or not REFERENCE.match(ref):
        die("400 Parameter verification failed.\nreference: value does not match the regex pattern")
    if storage != "local":
        die(f"storage '{storage}' is not configured for content-type 'vztmpl'")
    filename = normalize_content_filename(name or ref) + ".tar"
    if (TEMPLATE_DIR / filename).is_file():
        die(f"refusing to override existing file '{filename}'")
    tmp = TEMPLATE_DIR / f"{filename}.tmp.{os.getpid()}"
    TEMPLATE_DIR.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["skopeo", "copy", f"docker://{ref}", f"oci-archive:{tmp}"], capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        die(f"{proc.stderr.strip()}\nTASK ERROR: command 'skopeo copy docker://{ref} oci-archive:{tmp}' failed: "
            f"exit code {proc.returncode}")
    tmp.rename(TEMPLATE_DIR / filename)
    print("TASK OK")


if __name__ == "__main__":
    main(sys.argv[1:])
