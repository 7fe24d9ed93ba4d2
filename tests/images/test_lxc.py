"""The exported artifacts boot under real LXC, and lxc-attach (what `pct exec` runs) sees the image's
environment through the carried files."""

import pytest

from images import export, lxc
from tests.conftest import need_tools
from images.errors import LxcError
from tests.support.pct_double.demo_image import demo_image_or_skip

pytestmark = [pytest.mark.lxc, pytest.mark.docker]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    why = lxc.available()
    if why:
        pytest.skip(why)
    need_tools("skopeo", "zstd")  # both formats are exported
    image = demo_image_or_skip()
    out = tmp_path_factory.mktemp("artifacts")
    oci, template = export.export(image, "both", out, progress=False).artifacts
    return {"oci": oci, "template": template}


@pytest.fixture
def container(tmp_path):
    c = lxc.Container("dflash-t", tmp_path / "lxc")
    yield c
    c.destroy()


def test_template_boots_and_attach_sees_the_image_environment(artifacts, container):
    container.create(artifacts["template"])
    container.start()
    assert container.state() == "RUNNING"
    # The image has no init: the carried /sbin/init keeps the container up.
    assert "sleep" in container.attach(["ps", "-o", "args"]).stdout or container.attach(["cat", "/proc/1/cmdline"]).stdout
    r = container.attach(["dflash-train", "--steps", "3"])  # /usr/local/bin wrapper, env cleared like a bare exec
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "demo-train VIRTUAL_ENV=/opt/venv PWD=/workspace ARGS=--steps 3"
    env = container.attach(["/usr/local/bin/dflash-env", "env"]).stdout
    assert "LD_LIBRARY_PATH=/opt/venv/lib" in env and "PATH=/opt/venv/bin:" in env
    doctor = container.attach(["dflash", "doctor"])
    assert doctor.returncode == 0 and doctor.stdout.startswith("doctor: all checks passed VIRTUAL_ENV=/opt/venv")
    assert container.attach(["/opt/venv/bin/dflash-hardlink"]).returncode == 0  # hard links survived the repack
    container.stop()
    assert container.state() == "STOPPED"


def test_oci_archive_boots_with_env_only_for_init(artifacts, container):
    need_tools("umoci")  # unpacks the OCI archive, as pct does
    container.create(artifacts["oci"])
    container.start()
    init_env = container.attach(["cat", "/proc/1/environ"]).stdout
    assert "VIRTUAL_ENV=/opt/venv" in init_env  # the image's Env reaches init (as PVE 9.1 maps it)
    # pct exec on PVE does not see it (lxc.environment.runtime): push passes the recorded environment.
    r = container.attach(["env", "-i", "VIRTUAL_ENV=/opt/venv", "/opt/venv/bin/dflash", "doctor"])
    assert r.returncode == 0 and "VIRTUAL_ENV=/opt/venv" in r.stdout


def test_existing_container_is_refused(artifacts, container):
    container.create(artifacts["template"])
    with pytest.raises(LxcError, match="already exists"):
        container.create(artifacts["template"])
