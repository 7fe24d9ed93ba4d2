"""Publish benchmark: a registry push (first vs unchanged re-push), a pull into an empty engine, and
push-docker against a plain `docker save | ssh HOST docker load`, all on loopback.

    python bench/bench_publish.py                    (a labelled demo image; --image dflash-train:cu130-sm120)

  1. start a loopback registry (docker-registry, TLS, htpasswd) and a second, empty Docker engine
     (loopback/registry.py, loopback/engine.py)
  2. publish twice: seconds, layers and bytes the engine sent, blob uploads the registry saw
  3. pull the published image into the second engine: seconds
  4. push-docker to the second engine through a loopback sshd (save | zstd, SFTP, load, ID check), then
     the same image with `docker save | ssh -p PORT root@127.0.0.1 docker load` (uncompressed, OpenSSH):
     seconds, bytes on the wire and MB/s of image (uncompressed save size / seconds)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from images import publish, push_docker
from loopback import registry, sshd
from loopback.demo_image import labelled_demo_image
from loopback.engine import start as start_engine


def far_rmi(docker_host: str, image: str) -> None:
    subprocess.run(["docker", "-H", docker_host, "rmi", "-f", image], capture_output=True)
    subprocess.run(["docker", "-H", docker_host, "image", "prune", "-f"], capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", help="image to publish (default: a labelled demo image, loopback/demo_image.py)")
    p.add_argument("--target", help="accepted for `make bench-publish`; --image wins")
    a = p.parse_args()
    image = a.image or labelled_demo_image("dflash-bench-publish:cu130-sm120")
    import docker

    save_bytes = int(docker.from_env().images.get(image).attrs["Size"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        work = Path(tmp)
        reg = registry.start(work / "registry")
        far_root = Path(f"/tmp/dflash-bench-far-{os.getpid()}")
        far_root.mkdir()
        engine, far_host = start_engine(far_root, namespace="dflash-bench")
        server = sshd.start(work / "sshd", {"DOCKER_HOST": far_host})
        try:
            os.environ.update(DFLASH_REGISTRY_USER=reg.user, DFLASH_REGISTRY_PASSWORD=reg.password)
            o = publish.PublishOptions(image=image, registry=f"{reg.host}/bench", ca_cert=str(reg.ca), progress=False)
            for label in ("first publish", "unchanged re-publish"):
                before = reg.uploads()
                t0 = time.monotonic()
                r = publish.publish(o)
                sent = r.image_bytes if r.layers_pushed else 0  # all layers or none: wire bytes = compressed size
                rows.append((label, time.monotonic() - t0, sent, f"{r.layers_pushed} layers sent "
                             f"({r.bytes_pushed / 1e6:.1f} MB before gzip), {r.layers_existing} existed, "
                             f"{reg.uploads() - before} blob uploads"))
            far = docker.DockerClient(base_url=far_host, timeout=3600)
            t0 = time.monotonic()
            far.images.pull(f"{reg.host}/bench/dflash-train@{r.digest}",
                            auth_config={"username": reg.user, "password": reg.password})
            rows.append(("pull into an empty engine", time.monotonic() - t0, r.image_bytes, "gzip layers + config"))
            far_rmi(far_host, f"{reg.host}/bench/dflash-train@{r.digest}")

            opts = push_docker.PushDockerOptions(host=server.target, image=image, out_dir=work / "dist",
                                                 port=server.port, identity=str(server.identity),
                                                 known_hosts=str(server.known_hosts), remote_dir=str(work / "remote"),
                                                 doctor="", progress=False)
            t0 = time.monotonic()
            rep = push_docker.push_docker(opts)
            s = time.monotonic() - t0
            rows.append(("push-docker (save|zstd, sftp, load)", s, rep.artifact_bytes,
                         f"{save_bytes / 1e6 / s:.1f} MB/s of image; export {rep.export_seconds:.1f} s, "
                         f"send {rep.transfer['seconds']:.1f} s, load {rep.load_seconds:.1f} s"))
            far_rmi(far_host, image)
            ssh = (f"ssh -p {server.port} -i {server.identity} -o UserKnownHostsFile={server.known_hosts} "
                   f"-o BatchMode=yes {server.target}")
            t0 = time.monotonic()
            pipe = subprocess.run(f"docker save {image} | tee >(wc -c > {work}/wire) | {ssh} docker load",
                                  shell=True, executable="/bin/bash", capture_output=True, text=True)
            s = time.monotonic() - t0
            if pipe.returncode != 0:
                raise SystemExit(pipe.stderr)
            wire = int((work / "wire").read_text())
            rows.append(("docker save | ssh docker load", s, wire, f"{save_bytes / 1e6 / s:.1f} MB/s of image"))
        finally:
            server.stop()
            engine.terminate()
            engine.wait(30)
            subprocess.run(["rm", "-rf", str(far_root)])
            reg.stop()
            registry.remove_engine_trust(reg.host)
    print(f"\nimage {image} ({save_bytes / 1e6:.0f} MB uncompressed)")
    print(f"{'step':<38}{'seconds':>9}{'MB sent':>10}  notes")
    for label, s, b, note in rows:
        print(f"{label:<38}{s:>9.1f}{b / 1e6:>10.1f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
