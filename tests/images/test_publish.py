"""publish against a real registry on loopback (docker-registry with TLS from a CA made here and htpasswd
auth): tags, no layer sent twice, the SBOM as a referrer, pull back and run the doctor, and every refusal."""

import base64
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import CI_TARGET, REQUIRED, need_tools
from images import publish, push, registry
from images.errors import ExportError, HostError, RegistryError
from loopback import registry as loopback_registry
from loopback.demo_image import labelled_demo_image
from loopback.net import free_port

REPO = Path(__file__).resolve().parents[2]
IMAGE_A, IMAGE_B = "dflash-publish-demo:a", "dflash-publish-demo:b"


def published_id(image: str) -> str:
    from images.engine import client as engine

    return engine().images.get(image).id


# -- references (no registry needed) ----------------------------------------------------------------

def test_registry_reference_needs_a_host_and_a_namespace():
    assert registry.parse_registry("ghcr.io/myorg") == registry.Reference("ghcr.io", "myorg/dflash-train")
    assert registry.parse_registry("127.0.0.1:5000/a/b/").repository == "a/b/dflash-train"
    with pytest.raises(RegistryError, match=r"'ghcr.io' has no namespace: give host\[:port\]/namespace"):
        registry.parse_registry("ghcr.io")
    with pytest.raises(RegistryError, match="does not start with a registry host"):
        registry.parse_registry("myorg/dflash")
    with pytest.raises(RegistryError, match="has a scheme"):
        registry.parse_registry("https://ghcr.io/myorg")
    with pytest.raises(RegistryError, match="not a repository path"):
        registry.parse_registry("ghcr.io/MyOrg")
    ref = registry.parse_reference("reg.example.com:5000/team/dflash-train:cu130-sm120")
    assert (ref.registry, ref.repository, ref.tag) == ("reg.example.com:5000", "team/dflash-train", "cu130-sm120")
    with pytest.raises(RegistryError, match="has no tag"):
        registry.parse_reference("reg.example.com/team/dflash-train")


def test_credentials_come_from_the_environment_then_the_docker_config(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_REGISTRY_USER", raising=False)
    monkeypatch.delenv("DFLASH_REGISTRY_PASSWORD", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert registry.credentials("reg.example.com") is None
    (tmp_path / "config.json").write_text(json.dumps(
        {"auths": {"reg.example.com": {"auth": base64.b64encode(b"alice:pw:with:colons").decode()}}}))
    c = registry.credentials("reg.example.com")
    assert (c.username, c.password) == ("alice", "pw:with:colons") and "config.json" in c.source
    assert "pw:with" not in repr(c)  # the secret never shows in a repr or a log line
    monkeypatch.setenv("DFLASH_REGISTRY_USER", "bob")
    monkeypatch.setenv("DFLASH_REGISTRY_PASSWORD", "env-pw")
    assert registry.credentials("reg.example.com").username == "bob"


# -- a real registry --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    why = loopback_registry.available()
    if why:
        pytest.skip(why)
    r = loopback_registry.start(tmp_path_factory.mktemp("registry"))
    yield r
    r.stop()
    loopback_registry.remove_engine_trust(r.host)


@pytest.fixture(scope="module")
def images_ab():
    from tests.support.demo_image import demo_image_or_skip

    demo_image_or_skip()
    return labelled_demo_image(IMAGE_A, "aaaaaaaaaaaaaaaaaaaa"), labelled_demo_image(IMAGE_B, "bbbbbbbbbbbbbbbbbbbb")


@pytest.fixture
def docker_config(reg, tmp_path, monkeypatch):
    """Credentials the way `docker login` leaves them: in a (temporary) Docker config, not the environment."""
    monkeypatch.delenv("DFLASH_REGISTRY_USER", raising=False)
    monkeypatch.delenv("DFLASH_REGISTRY_PASSWORD", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    auth = base64.b64encode(f"{reg.user}:{reg.password}".encode()).decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
    return tmp_path


def opts(reg, image, ns="team", **kw):
    return publish.PublishOptions(image=image, registry=f"{reg.host}/{ns}", ca_cert=str(reg.ca), progress=False, **kw)


def client(reg):
    return registry.Registry(reg.host, registry.Credentials(reg.user, reg.password, "test"), str(reg.ca))


@pytest.mark.registry
@pytest.mark.docker
def test_publish_tags_sbom_pull_back_and_no_layer_twice(reg, images_ab, docker_config, capsys):
    before = reg.uploads()
    first = publish.publish(opts(reg, IMAGE_A))
    assert first.tags == ["cu130-sm120", "cu130-sm120-aaaaaaaaaaaa", "cu130-sm120-wheel-" + first.tags[2][-12:]]
    assert first.layers_pushed >= 1 and first.bytes_pushed > 0 and first.digest.startswith("sha256:")
    sent_first = reg.uploads() - before
    c = client(reg)
    for tag in first.tags:  # every tag names the one manifest
        assert c.manifest("team/dflash-train", tag).digest == first.digest
    # the SBOM: an OCI 1.1 artifact whose subject is the image, found by tag and by the referrers fallback
    sbom_manifest = c.manifest("team/dflash-train", "cu130-sm120.sbom").json
    assert sbom_manifest["artifactType"] == "application/vnd.cyclonedx+json"
    assert sbom_manifest["subject"]["digest"] == first.digest
    assert sbom_manifest["annotations"]["org.opencontainers.image.revision"] == "aaaaaaaaaaaaaaaaaaaa"
    referrers = c.manifest("team/dflash-train", first.digest.replace(":", "-")).json
    assert [m["digest"] for m in referrers["manifests"]] == [first.sbom["digest"]]
    bom = json.loads(c.blob("team/dflash-train", sbom_manifest["layers"][0]["digest"]))
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.5"
    torch = [x for x in bom["components"] if x["name"] == "torch"]
    assert torch and torch[0]["hashes"] and torch[0]["properties"][0]["name"] == "dflash:lock"

    # unchanged re-publish: every layer "already exists"; the registry starts no blob upload at all
    again = publish.publish(opts(reg, IMAGE_A))
    assert again.digest == first.digest and again.sbom["digest"] == first.sbom["digest"]
    assert again.layers_pushed == 0 and again.bytes_pushed == 0
    assert again.layers_existing == first.layers_pushed + first.layers_existing
    assert reg.uploads() - before == sent_first
    print(f"first push: {first.layers_pushed} layers, {first.bytes_pushed} B, {sent_first} uploads; "
          f"re-push: {again.layers_pushed} layers, {again.bytes_pushed} B, 0 uploads")

    # pull back through the engine (credentials as auth_config) and run the doctor from the pulled image
    from images.engine import client as engine

    e = engine()
    assert not [t for t in e.images.get(IMAGE_A).tags if t.startswith(reg.host)]  # publish leaves no extra tags
    pulled = e.images.pull(f"{reg.host}/team/dflash-train", tag="cu130-sm120",
                           auth_config={"username": reg.user, "password": reg.password})
    assert pulled.id == e.images.get(IMAGE_A).id
    out = e.containers.run(f"{reg.host}/team/dflash-train@{first.digest}", ["doctor", "--quick"],
                           network_mode="none", remove=True)
    assert b"doctor: all checks passed" in out
    e.images.remove(f"{reg.host}/team/dflash-train:cu130-sm120", noprune=True)
    summary = publish.summary(first)
    assert f"docker pull {reg.host}/team/dflash-train@{first.digest}" in summary and "--gpus all" in summary


@pytest.mark.registry
@pytest.mark.docker
def test_tag_that_points_elsewhere_is_refused_without_force(reg, images_ab, docker_config):
    publish.publish(opts(reg, IMAGE_A, ns="moving"))
    with pytest.raises(RegistryError,
                       match=r"moving/dflash-train:cu130-sm120 already points to another image.*--force"):
        publish.publish(opts(reg, IMAGE_B, ns="moving"))
    c = client(reg)
    a_id = c.manifest("moving/dflash-train", "cu130-sm120").config_digest
    report = publish.publish(opts(reg, IMAGE_B, ns="moving", force=True))
    assert c.manifest("moving/dflash-train", "cu130-sm120").digest == report.digest
    assert c.manifest("moving/dflash-train", "cu130-sm120").config_digest != a_id


@pytest.mark.registry
@pytest.mark.docker
def test_wrong_password_missing_credentials_unknown_ca_unreachable(reg, images_ab, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))  # empty: no config.json
    monkeypatch.setenv("DFLASH_REGISTRY_USER", reg.user)
    monkeypatch.setenv("DFLASH_REGISTRY_PASSWORD", "not-the-password")
    with pytest.raises(RegistryError,
                       match=rf"refused the credentials of '{reg.user}' from DFLASH_REGISTRY_USER.*docker login"):
        publish.publish(opts(reg, IMAGE_A))
    monkeypatch.delenv("DFLASH_REGISTRY_USER")
    with pytest.raises(RegistryError, match="asks for credentials and none were found"):
        publish.publish(opts(reg, IMAGE_A))
    loopback_registry.remove_engine_trust(reg.host)  # the engine's copy would be trusted as a fallback
    with pytest.raises(RegistryError, match=r"not signed by a CA this machine trusts.*--ca-cert"):
        publish.publish(publish.PublishOptions(image=IMAGE_A, registry=f"{reg.host}/team", progress=False))
    closed = free_port()
    with pytest.raises(RegistryError,
                       match=rf"cannot reach the registry https://127.0.0.1:{closed}/v2/.*Connection refused"):
        publish.publish(publish.PublishOptions(image=IMAGE_A, registry=f"127.0.0.1:{closed}/team", progress=False))


@pytest.mark.docker
def test_image_never_built_is_refused_naming_make_image():
    with pytest.raises(ExportError, match=r"nothing to publish\. Build it first: make image TARGET=cu128-sm90"):
        publish.publish(publish.PublishOptions(image="dflash-train:cu128-sm90", registry="127.0.0.1:1/team"))


# -- the real image, end to end ---------------------------------------------------------------------

@pytest.fixture
def real_image(request):
    from images.engine import image_exists

    tag = f"dflash-train:{CI_TARGET}"
    if image_exists(tag):
        return tag
    if "registry" in REQUIRED:
        return request.getfixturevalue("runtime_image")  # CI builds it (once per run)
    pytest.skip(f"{tag} is not built here (make image TARGET={CI_TARGET})")


@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.slow
def test_real_image_publish_pull_back_run_its_doctor(reg, real_image, docker_config):
    from images.engine import client as engine

    report = publish.publish(opts(reg, real_image, ns="e2e"))
    assert report.sbom, "the runtime image carries /opt/dflash/sbom.cdx.json"
    e = engine()
    pulled = e.images.pull(f"{reg.host}/e2e/dflash-train@{report.digest}",
                           auth_config={"username": reg.user, "password": reg.password})
    assert pulled.id == e.images.get(real_image).id
    out = e.containers.run(pulled.id, ["doctor", "--quick"], network_mode="none", remove=True)
    assert b"FAIL" not in out
    e.images.remove(f"{reg.host}/e2e/dflash-train@{report.digest}", noprune=True)  # the pull's digest name
    bom = json.loads(client(reg).blob("e2e/dflash-train", client(reg).manifest(
        "e2e/dflash-train", f"{report.tags[0]}.sbom").json["layers"][0]["digest"]))
    wheel = [c for c in bom["components"] if any(p["name"] == "dflash:wheel" for p in c["properties"])]
    assert wheel, "the built causal-conv1d wheel is in the SBOM with its manifest sha256"


# -- Proxmox >= 9.1 pulls from the registry itself ----------------------------------------------------

@pytest.fixture(scope="module")
def pve_pull(reg, images_ab, tmp_path_factory):
    from images import lxc
    from loopback import sshd
    from tests.support.pct_double import start_host

    for why in (sshd.available(), lxc.available()):
        if why:
            pytest.skip(why)
    need_tools("skopeo", "umoci")  # the pvesh double pulls with skopeo, the pct double unpacks with umoci
    base = tmp_path_factory.mktemp("pve")
    auth = base / "auth.json"  # what `skopeo login` leaves on the node
    auth.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(
        f"{reg.user}:{reg.password}".encode()).decode()}}}))
    certs = Path("/etc/containers/certs.d") / reg.host  # skopeo's trust, as on the node
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copy(reg.ca, certs / "ca.crt")
    env = {"PCT_DOUBLE_PYTHON": sys.executable, "PYTHONPATH": str(REPO), "PCT_DOUBLE_ROOT": str(base / "lxc"),
           "PCT_DOUBLE_CONF_DIR": str(base / "conf"), "PCT_DOUBLE_TEMPLATE_DIR": str(base / "cache"),
           "REGISTRY_AUTH_FILE": str(auth)}
    (base / "lxc").mkdir()
    (base / "lxc" / "pve-version").write_text("9.1.2\n")
    server = start_host(base / "sshd", env)
    yield {"server": server, "base": base}
    for ct in (base / "lxc").iterdir():
        if ct.is_dir() and ct.name.isdigit():
            lxc.Container(ct.name, base / "lxc").destroy()
    server.stop()
    shutil.rmtree(certs, ignore_errors=True)


def pull_options(reg, pve, ctid, ref, **kw):
    s = pve["server"]
    return push.PushOptions(host=s.target, ctid=ctid, image="unused", port=s.port, identity=str(s.identity),
                            known_hosts=str(s.known_hosts), pve_config_dir=str(pve["base"] / "conf"),
                            from_registry=ref, ca_cert=str(reg.ca), out_dir=pve["base"] / "dist",
                            plan={"gpus": "none", "rootfs_gb": 1, "net0": None}, **kw)


@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.ssh
@pytest.mark.lxc
def test_push_from_registry_the_host_pulls_then_the_container_runs_the_doctor(reg, pve_pull, docker_config):
    ref = f"{reg.host}/pull/dflash-train:cu130-sm120"
    publish.publish(opts(reg, IMAGE_A, ns="pull"))
    report = push.push(pull_options(reg, pve_pull, 301, ref, doctor="dflash doctor --quick"))
    pulls = [s for s in report.steps if s["step"] == "run" and "oci-registry-pull" in s["command"]]
    assert len(pulls) == 1 and f"--reference {ref}" in pulls[0]["command"]
    assert not [s for s in report.steps if s["step"] in ("export", "transfer")]  # nothing left this machine
    cache = pve_pull["base"] / "cache"
    files = [p.name for p in cache.iterdir()]
    config = client(reg).manifest("pull/dflash-train", "cu130-sm120").config_digest
    assert config == published_id(IMAGE_A) and files == [f"dflash-train_cu130-sm120_{config[7:19]}.oci.tar"]
    assert "doctor: all checks passed" in report.doctor_output
    # the same image again: the file is found (PVE would refuse to overwrite it) and no pull runs
    again = push.push(pull_options(reg, pve_pull, 302, ref, doctor=""))
    assert [s for s in again.steps if s["step"] == "pull"][0]["reused"] is True


@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.ssh
@pytest.mark.lxc
def test_push_from_registry_refused_before_pve_9_1(reg, pve_pull, docker_config):
    publish.publish(opts(reg, IMAGE_A, ns="pull"))
    (pve_pull["base"] / "lxc" / "pve-version").write_text("8.2.4\n")
    try:
        with pytest.raises(HostError, match=r"Proxmox VE 8.2.4; pulling from a registry .* needs PVE >= 9.1"):
            push.push(pull_options(reg, pve_pull, 303, f"{reg.host}/pull/dflash-train:cu130-sm120"))
    finally:
        (pve_pull["base"] / "lxc" / "pve-version").write_text("9.1.2\n")
