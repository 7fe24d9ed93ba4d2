"""Export: OCI archive media types, the deterministic rootfs template, carried config, records."""

import argparse
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from images import export, imageinfo, oci, records, template
from images.errors import ExportError
from tests.conftest import need_tools
from tests.support.demo_image import demo_image_or_skip
from common.fsutil import sha256_file


def _info(**kw):
    base = dict(ref="demo:1", id="sha256:" + "ab" * 32, tags=["demo:1"], labels={}, workdir="/workspace", user="",
                env=["PATH=/opt/venv/bin:/usr/bin:/bin", "VIRTUAL_ENV=/opt/venv", "NOTE=it's $HOME"],
                entrypoint=["dflash-train"], cmd=[])
    base.update(kw)
    return imageinfo.ImageInfo(**base)


def test_carried_files_write_env_wrappers_and_init():
    members = {n: tarfile.TarInfo(n) for n in ("./opt/venv/bin/dflash-train", "./opt/venv/bin/dflash", "./bin/sh")}
    files = template.carried_files(_info(), members, existing_environment=b"LANG=C.UTF-8\n")
    env = files["./etc/environment"][0].decode()
    assert env.startswith("LANG=C.UTF-8\n") and "VIRTUAL_ENV=/opt/venv\n" in env
    profile = files["./etc/profile.d/dflash.sh"][0].decode()
    assert "export NOTE='it'\"'\"'s $HOME'" in profile  # quoted: sourced, never expanded
    assert "export DFLASH_IMAGE_WORKDIR=/workspace" in profile
    assert files["./usr/local/bin/dflash-train"] == (
        b'#!/bin/sh\nexec /usr/local/bin/dflash-env /opt/venv/bin/dflash-train "$@"\n', 0o755)
    assert "./usr/local/bin/dflash" in files and files["./sbin/init"][1] == 0o755
    members["./sbin/init"] = tarfile.TarInfo("./sbin/init")
    assert "./sbin/init" not in template.carried_files(_info(), members)  # the image's own init wins


def _member(name: str, mode: int = 0o755, link: str | None = None) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mode = mode
    if link is not None:
        ti.type, ti.linkname = tarfile.SYMTYPE, link
    return ti


def test_every_program_of_the_images_own_path_gets_a_wrapper_on_the_system_path():
    """pct exec, lxc-attach, ssh and login shells all search /usr/local/bin but not /opt/venv/bin: the venv's
    python, torchrun and console scripts get a wrapper there; activate scripts (not executable), links to
    nothing and the system directories' programs do not."""
    members = {m.name: m for m in [
        _member("./opt/venv/bin/torchrun"), _member("./opt/venv/bin/dflash-eval"),
        _member("./opt/venv/bin/python3", link="/usr/bin/python3.11"), _member("./usr/bin/python3.11"),
        _member("./opt/venv/bin/python", link="python3"), _member("./opt/venv/bin/activate", mode=0o644),
        _member("./opt/venv/bin/dangling", link="/nowhere"), _member("./opt/tools/bin/torchrun"),
        _member("./usr/bin/perl")]}
    info = _info(env=["PATH=/opt/venv/bin:/opt/tools/bin:/usr/local/bin:/usr/bin:/bin"])
    files = template.carried_files(info, members)
    wrappers = {k: v[0].decode() for k, v in files.items() if k.startswith("./usr/local/bin/") and
                not k.endswith("/dflash-env")}
    assert sorted(wrappers) == [f"./usr/local/bin/{n}" for n in ("dflash-eval", "python", "python3", "torchrun")]
    # the first directory's torchrun, as the image's PATH finds it
    assert wrappers["./usr/local/bin/torchrun"] == '#!/bin/sh\nexec /usr/local/bin/dflash-env /opt/venv/bin/torchrun "$@"\n'
    assert "exec /usr/local/bin/dflash-env /opt/venv/bin/python " in wrappers["./usr/local/bin/python"]


def test_wrapper_is_not_written_over_the_program_itself():
    members = {"./usr/local/bin/dflash-train": tarfile.TarInfo("x")}
    files = template.carried_files(_info(env=["PATH=/usr/local/bin:/usr/bin"]), members)
    assert "./usr/local/bin/dflash-train" not in files  # it would exec itself forever


def _oci_tar(path: Path, layer_type: str) -> Path:
    manifest = json.dumps({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json"},
                           "layers": [{"mediaType": layer_type}]}).encode()
    index = json.dumps({"manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                       "digest": "sha256:m"}]}).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                           ("blobs/sha256/m", manifest)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return path


def test_oci_check_rejects_docker_media_types(tmp_path):
    good = _oci_tar(tmp_path / "good.tar", "application/vnd.oci.image.layer.v1.tar")
    assert oci.check_oci_archive(good)["layers"]
    bad = _oci_tar(tmp_path / "bad.tar", "application/vnd.docker.image.rootfs.diff.tar.gzip")
    with pytest.raises(ExportError, match="non-OCI media types.*skopeo"):
        oci.check_oci_archive(bad)


@pytest.mark.docker
def test_missing_image_is_a_clear_error():
    pytest.importorskip("docker")
    try:
        imageinfo.docker_client().ping()
    except Exception:
        pytest.skip("no Docker engine")
    with pytest.raises(ExportError, match="not in the local engine.*make image"):
        imageinfo.inspect_image("dflash-no-such-image:never")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    need_tools("skopeo", "zstd")  # skopeo writes the OCI archive, zstd compresses the template
    image = demo_image_or_skip()
    out = tmp_path_factory.mktemp("export")
    return image, out, export.export(image, "both", out, epoch=1700000000, progress=False)


@pytest.mark.docker
def test_oci_archive_is_uncompressed_oci_layout(exported):
    _, out, result = exported
    archive = result.artifacts[0]
    assert archive.name.endswith(".oci.tar")
    with open(archive, "rb") as f:
        assert tarfile.is_tarfile(f)  # a plain tar: PVE only detects an *uncompressed* OCI archive
    manifest = oci.check_oci_archive(archive)
    assert all(layer["mediaType"].startswith("application/vnd.oci.image.layer.v1.tar")
               for layer in manifest["layers"])


@pytest.mark.docker
def test_records_describe_each_artifact(exported):
    image, out, result = exported
    for path, rec in zip(result.artifacts, result.records, strict=True):
        on_disk = json.loads(records.record_path(path).read_text())
        assert on_disk == rec
        assert rec["size"] == path.stat().st_size and rec["sha256"] == sha256_file(path)
        assert rec["image"]["id"].startswith("sha256:") and rec["image"]["labels"]["io.dflash.target"] == "cu130-sm120"
        assert rec["image"]["cuda"] == "13.0" and rec["image"]["entrypoint"] == ["dflash-train"]
        if rec["format"] == "template":
            assert rec["libcuda_in_image"] == []
    # no temp files left behind (.build.lock is the lock that keeps a second export out of this directory)
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".build.lock"]


@pytest.mark.docker
def test_template_is_sorted_numeric_fixed_time_and_carries_config(exported):
    _, out, result = exported
    tpl = result.artifacts[1]
    raw = subprocess.run(["zstd", "-dc", str(tpl)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        links = [m for m in members if m.islnk()]
        plain = [n for n in names if n not in {m.name for m in links}]
        assert plain == sorted(plain) and names[-len(links):] == sorted(m.name for m in links)
        assert all(m.mtime == 1700000000 and m.uname == "" and m.gname == "" for m in members)
        assert "./.dockerenv" not in names and not [n for n in names if n.startswith("./dev/")]
        assert all(n == "." or n.startswith("./") for n in names)
        profile = tar.extractfile("./etc/profile.d/dflash.sh").read().decode()
        assert "export VIRTUAL_ENV=/opt/venv" in profile and "export DFLASH_IMAGE_WORKDIR=/workspace" in profile
        wrapper = tar.extractfile("./usr/local/bin/dflash-train").read().decode()
        assert "/usr/local/bin/dflash-env /opt/venv/bin/dflash-train" in wrapper
        assert "./usr/local/bin/dflash-env" in names


@pytest.mark.docker
def test_template_export_is_bit_identical(exported, tmp_path):
    image, _, result = exported
    again = export.export(image, "template", tmp_path, epoch=1700000000, progress=False)
    assert again.records[0]["sha256"] == result.records[1]["sha256"]


def test_init_prefix_of_the_entrypoint_is_not_wrapped():
    members = {n: tarfile.TarInfo(n)
               for n in ("./usr/bin/tini", "./opt/venv/bin/dflash", "./opt/venv/bin/dflash-train")}
    info = _info(entrypoint=["tini", "--", "dflash", "entrypoint"], env=["PATH=/opt/venv/bin:/usr/bin"])
    files = template.carried_files(info, members)
    assert "./usr/local/bin/tini" not in files
    assert "./usr/local/bin/dflash" in files and "./usr/local/bin/dflash-train" in files


def test_image_defaults_to_the_targets_image():
    parser = argparse.ArgumentParser()
    export.register(parser.add_subparsers(dest="command"))
    by_target = parser.parse_args(["export", "--target", "cu130-sm120"])
    assert export.image_from_args(by_target) == "dflash-train:cu130-sm120"
    assert export.image_from_args(parser.parse_args(["export", "--image", "mine:1"])) == "mine:1"


def test_the_template_carries_the_packaged_scripts():
    scripts = Path(template.__file__).parent / "scripts"
    files = template.carried_files(_info(), {"./opt/venv/bin/dflash-train": tarfile.TarInfo("x")})
    assert files["./usr/local/bin/dflash-env"] == ((scripts / "dflash-env.sh").read_bytes(), 0o755)
    assert files["./sbin/init"] == ((scripts / "init.sh").read_bytes(), 0o755)


def test_the_template_carries_an_etc_hosts_only_for_an_empty_or_missing_one():
    """`docker export` leaves Docker's empty /etc/hosts placeholder: `localhost` would resolve nowhere."""
    placeholder = tarfile.TarInfo("./etc/hosts")
    assert template.carried_files(_info(), {})["./etc/hosts"] == (template.ETC_HOSTS.encode(), 0o644)
    assert "./etc/hosts" in template.carried_files(_info(), {"./etc/hosts": placeholder})
    placeholder.size = 30
    assert "./etc/hosts" not in template.carried_files(_info(), {"./etc/hosts": placeholder})
    assert "127.0.0.1\tlocalhost" in template.ETC_HOSTS and "::1\tlocalhost" in template.ETC_HOSTS


def test_cuda_comes_from_the_target_label():
    assert imageinfo.image_cuda({"io.dflash.target": "cu130-sm120"}, {}) == "13.0"
    assert imageinfo.image_cuda({"io.dflash.target": "cu128-sm120"}, {}) == "12.8"
    assert imageinfo.image_cuda({}, {"CUDA_VERSION": "12.8.1"}) == "12.8.1"
    assert imageinfo.image_cuda({}, {}) is None


def test_carried_files_go_through_merged_usr_links():
    sbin = tarfile.TarInfo("./sbin")
    sbin.type, sbin.linkname = tarfile.SYMTYPE, "usr/sbin"
    members = {"./sbin": sbin, "./usr/sbin": tarfile.TarInfo("./usr/sbin")}
    files = template.carried_files(_info(), members)
    assert "./usr/sbin/init" in files and "./sbin/init" not in files
    members["./usr/sbin/init"] = tarfile.TarInfo("./usr/sbin/init")
    assert "./usr/sbin/init" not in template.carried_files(_info(), members)


def test_libcuda_on_the_image_library_path_is_flagged():
    record = {"image": {"env": ["LD_LIBRARY_PATH=/usr/local/cuda/compat:/opt/venv/lib"]},
              "libcuda_in_image": ["/usr/local/cuda/compat/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"]}
    # The first shadows the host's bind-mounted driver; the second is covered by the bind mount itself.
    assert records.shadowing_libcuda(record) == ["/usr/local/cuda/compat/libcuda.so.1"]
    assert records.shadowing_libcuda({}) == []
