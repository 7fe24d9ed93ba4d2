"""Push benchmark: export time and artifact sizes for an image, and upload throughput over loopback SSH.

    python bench/bench_push.py                      (demo image; --image dflash-train:cu130-sm120 for the real one)

  1. export the image as an OCI archive and as a rootfs template (.tar.zst), timed; sizes beside the
     uncompressed rootfs tar
  2. start a throwaway OpenSSH server on 127.0.0.1 (loopback/sshd.py) and upload each payload with
     SSH compression off and on: the same code path as `push` (SFTP, sha256 on the host, atomic rename)
and prints a table. Loopback has no network limit, so the rates measure SSH/SFTP and hashing cost, the
floor of what a real link adds to; on a slow link, the template's zstd size is what matters.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from common.fsutil import sha256_file
from images import export, ssh, transfer
from loopback import sshd
from loopback.demo_image import demo_image


def upload(server, payload: Path, dest: Path, compress: bool) -> tuple[float, float]:
    """Seconds and MB/s of one fresh upload (the destination is emptied first)."""
    for old in dest.glob("*"):
        old.unlink()
    with ssh.SshHost(server.target, port=server.port, identity=str(server.identity),
                     known_hosts=str(server.known_hosts), compress=compress) as host:
        digest = sha256_file(payload)
        t0 = time.monotonic()
        transfer.send_file(host, payload, str(dest), sha256=digest, progress=False)
        seconds = time.monotonic() - t0
    return seconds, payload.stat().st_size / 1e6 / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", help="image to export (default: a small demo image, loopback/demo_image.py)")
    p.add_argument("--zstd-level", type=int, default=10)
    a = p.parse_args()
    image = a.image or demo_image()
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        work = Path(tmp)
        result = export.export(image, "both", work / "out", epoch=0, level=a.zstd_level, progress=False)
        oci, template = result.artifacts
        raw = work / "rootfs.tar"
        subprocess.run(["zstd", "-q", "-d", str(template), "-o", str(raw)], check=True)

        print(f"\nimage {image}")
        print(f"{'artifact':<28}{'size MB':>10}{'export s':>10}")
        print(f"{'OCI archive (.oci.tar)':<28}{oci.stat().st_size / 1e6:>10.1f}{result.seconds['oci']:>10.1f}")
        print(f"{'template (.tar.zst -' + str(a.zstd_level) + ')':<28}{template.stat().st_size / 1e6:>10.1f}"
              f"{result.seconds['template']:>10.1f}")
        print(f"{'rootfs tar, uncompressed':<28}{raw.stat().st_size / 1e6:>10.1f}{'':>10}")

        server = sshd.start(work / "sshd")
        try:
            print(f"\n{'payload':<28}{'ssh compression':>16}{'seconds':>10}{'MB/s':>8}")
            for name, payload in (("template .tar.zst", template), ("OCI archive", oci), ("rootfs tar", raw)):
                for compress in (False, True):
                    seconds, rate = upload(server, payload, work / "dest", compress)
                    print(f"{name:<28}{'on' if compress else 'off':>16}{seconds:>10.2f}{rate:>8.1f}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
