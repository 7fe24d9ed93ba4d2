"""push-docker end to end: a second Docker engine (its own data root and socket) behind a real OpenSSH
server on loopback, so the image really travels: save | zstd -> resumable upload -> docker load -> doctor."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from images import push_docker
from images.errors import ExportError, PushError
from loopback import engine, sshd
from loopback.demo_image import labelled_demo_image
from tests.conftest import need_tools
from tests.support.demo_image import demo_image_or_skip

pytestmark = [pytest.mark.docker, pytest.mark.ssh]

IMAGE = "dflash-push-docker-demo:cu130-sm120"


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    """'A GPU box': sshd whose sessions talk to a second, empty Docker engine."""
    why = sshd.available()
    if why:
        pytest.skip(why)
    if not shutil.which("dockerd") or os.geteuid() != 0:
        pytest.skip("a second Docker engine needs dockerd and root (apt-get install docker.io, as root)")
    need_tools("zstd")  # the image travels as docker save | zstd and is unpacked with zstd -dc there
    demo_image_or_skip()  # the base of the labelled image (without busybox or dflash-base it cannot be built)
    image = labelled_demo_image(IMAGE)
    root = Path("/tmp") / f"dflash-far-{os.getpid()}"  # short: unix socket paths are limited to 108 bytes
    root.mkdir(exist_ok=True)
    proc, docker_host = engine.start(root, namespace="dflash-test")
    server = sshd.start(tmp_path_factory.mktemp("sshd"), {"DOCKER_HOST": docker_host})
    yield {"server": server, "docker_host": docker_host, "image": image, "out": tmp_path_factory.mktemp("dist"),
           "remote": str(tmp_path_factory.mktemp("remote"))}
    server.stop()
    proc.terminate()
    proc.wait(30)
    subprocess.run(["rm", "-rf", str(root)], check=False)


def far_docker(far, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", far["docker_host"], *args], capture_output=True, text=True)


def options(far, **kw):
    s = far["server"]
    return push_docker.PushDockerOptions(host=s.target, image=far["image"], out_dir=far["out"], port=s.port,
                                         identity=str(s.identity), known_hosts=str(s.known_hosts),
                                         remote_dir=far["remote"], progress=False, **kw)


def test_image_travels_is_checked_and_its_doctor_runs_then_nothing_is_resent(far, capsys):
    assert far_docker(far, "image", "inspect", far["image"]).returncode != 0  # the far engine starts empty
    report = push_docker.push_docker(options(far))
    local_id = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", far["image"]],
                              capture_output=True, text=True).stdout.strip()
    assert report.status == "loaded" and report.image_id == local_id
    assert far_docker(far, "image", "inspect", "--format", "{{.Id}}", far["image"]).stdout.strip() == local_id
    assert report.transfer["status"] == "sent" and report.transfer["bytes"] == report.artifact_bytes > 0
    assert report.doctor_rc == 0 and "doctor: all checks passed ARGS=doctor --quick" in report.doctor_output
    assert not os.listdir(far["remote"])  # the file is removed once loaded
    again = push_docker.push_docker(options(far))
    assert again.status == "already-present" and again.transfer == {}


def test_interrupted_upload_resumes_from_the_partial(far):
    far_docker(far, "rmi", "-f", far["image"])
    info = push_docker.inspect_image(far["image"])
    artifact, record = push_docker.save_compressed(info, far["out"], progress=False)
    half = artifact.read_bytes()[: record["size"] // 2]
    Path(far["remote"], f".{artifact.name}.partial").write_bytes(half)  # what a killed upload leaves
    report = push_docker.push_docker(options(far, doctor=""))
    assert report.status == "loaded" and report.transfer["status"] == "resumed"
    assert report.transfer["bytes"] == record["size"] - len(half)


def test_failing_doctor_fails_with_the_command_to_reproduce(far):
    with pytest.raises(PushError, match=r"failed there \(exit 1\).*ssh root@127.0.0.1 docker run"):
        push_docker.push_docker(options(far, doctor="doctor --fail"))


def test_image_never_built_is_refused_naming_make_image(far):
    with pytest.raises(ExportError, match=r"not in the local engine.*make image TARGET=cu128-sm90"):
        push_docker.push_docker(push_docker.PushDockerOptions(host=far["server"].target,
                                                              image="dflash-train:cu128-sm90"))
