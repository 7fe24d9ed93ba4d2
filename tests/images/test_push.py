"""push end to end: loopback OpenSSH + the pct double (real LXC underneath) + a real export."""

import argparse
import socket
import sys
from pathlib import Path

import pytest

from images import export, lxc, push
from images.errors import HostError, PushError
from loopback import sshd
from tests.conftest import need_tools
from tests.support.bridge import lxc_bridge
from tests.support.demo_image import demo_image_or_skip
from tests.support.pct_double import start_host
from wheelbuilder import targets as tg
from wheelbuilder.errors import FatalError

REPO = Path(__file__).resolve().parents[2]


def test_cli_registers_push_with_defaults():
    parser = argparse.ArgumentParser()
    push.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["push", "--host", "root@pve", "--ctid", "200"])
    assert args.func is push._cmd_push and args.gpus == "all" and args.format == "auto" and not args.dry_run
    assert args.bwlimit is None and args.shm_size is None
    default_target = tg.load().default_target
    assert export.image_from_args(args) == f"dflash-train:{default_target}"  # what `make image` builds
    with pytest.raises(SystemExit):
        parser.parse_args(["push", "--host", "root@pve", "--ctid", "two-hundred"])


def test_images_errors_share_wheelbuilders_family_with_their_own_codes():
    from images import errors

    family = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ImagesError)
              and c is not errors.ImagesError]
    assert all(issubclass(c, FatalError) for c in family)
    assert sorted(c.exit_code for c in family) == list(range(8, 17))


@pytest.fixture(scope="module")
def pve(tmp_path_factory):
    """A loopback 'Proxmox host': sshd whose session PATH starts with the pct/pveversion/pvesm doubles."""
    for why in (sshd.available(), lxc.available()):
        if why:
            pytest.skip(why)
    need_tools("zstd")  # the rootfs template; the OCI test asks for skopeo and umoci itself
    image = demo_image_or_skip()
    base = tmp_path_factory.mktemp("pve")
    env = {"PCT_DOUBLE_PYTHON": sys.executable, "PYTHONPATH": str(REPO), "PCT_DOUBLE_ROOT": str(base / "lxc"),
           "PCT_DOUBLE_CONF_DIR": str(base / "conf"), "PCT_DOUBLE_TEMPLATE_DIR": str(base / "cache")}
    (base / "lxc").mkdir()
    server = start_host(base / "sshd", env)
    yield {"server": server, "base": base, "image": image, "out": tmp_path_factory.mktemp("dist")}
    for ct in (base / "lxc").iterdir():
        if ct.is_dir() and ct.name.isdigit():
            lxc.Container(ct.name, base / "lxc").destroy()
    server.stop()


def options(pve, ctid, **kw):
    s = pve["server"]
    plan = {"gpus": "none", "rootfs_storage": "local-lvm", "rootfs_gb": 1, "net0": None,
            **kw.pop("plan", {})}
    return push.PushOptions(host=s.target, ctid=ctid, image=pve["image"], out_dir=kw.pop("out", pve["out"]),
                            port=s.port, identity=str(s.identity), known_hosts=str(s.known_hosts),
                            pve_config_dir=str(pve["base"] / "conf"), plan=plan, **kw)


def set_pve_version(pve, version):
    (pve["base"] / "lxc" / "pve-version").write_text(version + "\n")




@pytest.mark.ssh
@pytest.mark.lxc
@pytest.mark.docker
def test_push_template_end_to_end_then_refuse_then_replace(pve, capsys):
    set_pve_version(pve, "8.2.4")
    report = push.push(options(pve, 200, plan={"data_storage": "local-lvm", "data_gb": 1}))
    assert "doctor: all checks passed VIRTUAL_ENV=/opt/venv PWD=/workspace" in report.doctor_output
    template = next((pve["base"] / "cache").glob("*.tar.zst"))
    conf = (pve["base"] / "conf" / "200.conf").read_text()
    assert "ostype: unmanaged" in conf and "unprivileged: 1" in conf and "mp0: local-lvm:1,mp=/data" in conf
    assert lxc.Container("200", pve["base"] / "lxc").state() == "RUNNING"
    assert (pve["base"] / "lxc" / "200-volumes" / "mp0").is_dir()
    # The raw lines give it a /dev/shm of half --memory (the default 64 GiB) and a loopback that LXC
    # brings up: the demo image has neither ip nor python3, so its init could not.
    assert "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir,size=32768M 0 0" in conf
    assert "lxc.net.99.type: empty\nlxc.net.99.flags: up\n" in conf
    ct = lxc.Container("200", pve["base"] / "lxc")
    assert ct.attach(["df", "-k", "/dev/shm"]).stdout.splitlines()[1].split()[1] == str(32768 * 1024)
    assert int(ct.attach(["cat", "/sys/class/net/lo/flags"]).stdout, 16) & 1  # IFF_UP
    sent = [s for s in report.steps if s["step"] == "transfer"][0]
    assert sent["status"] == "sent" and sent["bytes"] == template.stat().st_size

    with pytest.raises(HostError, match="CTID 200 is already in use"):
        push.push(options(pve, 200))

    again = push.push(options(pve, 200, plan={"replace": True}))
    assert [s["status"] for s in again.steps if s["step"] == "transfer"] == ["already-present"]
    assert [s for s in again.steps if s["step"] == "export"][0]["reused"]
    commands = [s["command"] for s in again.steps if s["step"] == "run"]
    assert commands[:2] == ["pct stop 200", "pct destroy 200 --purge"]
    assert "doctor: all checks passed" in again.doctor_output


@pytest.mark.ssh
@pytest.mark.lxc
@pytest.mark.docker
def test_push_oci_on_pve_9_1(pve):
    need_tools("skopeo", "umoci")  # skopeo writes the archive here, umoci unpacks it in the pct double
    set_pve_version(pve, "9.1.2")
    report = push.push(options(pve, 201))
    assert [s for s in report.steps if s["step"] == "export"][0]["path"].endswith(".oci.tar")
    assert "doctor: all checks passed VIRTUAL_ENV=/opt/venv PWD=/workspace" in report.doctor_output


@pytest.mark.ssh
@pytest.mark.lxc
@pytest.mark.docker
def test_oci_on_old_pve_is_refused_before_export(pve, tmp_path):
    set_pve_version(pve, "8.4.1")
    with pytest.raises(HostError, match="--format template"):
        push.push(options(pve, 202, format="oci", out=tmp_path))
    assert not list(tmp_path.iterdir())


@pytest.mark.ssh
@pytest.mark.lxc
@pytest.mark.docker
def test_dry_run_prints_and_changes_nothing(pve, tmp_path, capsys):
    set_pve_version(pve, "8.2.4")
    before = sorted(p.name for p in (pve["base"] / "cache").iterdir())
    report = push.push(options(pve, 203, dry_run=True, out=tmp_path))
    err = capsys.readouterr().err
    assert "would export" in err and "would send" in err
    assert "+ ssh root@127.0.0.1 pct create 203 local:vztmpl/" in err and "pct exec 203 --" in err
    assert not (pve["base"] / "conf" / "203.conf").exists() and not list(tmp_path.iterdir())
    assert sorted(p.name for p in (pve["base"] / "cache").iterdir()) == before
    assert all(s.get("dry_run", True) for s in report.steps if s["step"] == "run")


@pytest.mark.ssh
@pytest.mark.lxc
@pytest.mark.docker
def test_failing_doctor_fails_the_push(pve):
    set_pve_version(pve, "8.2.4")
    with pytest.raises(PushError, match="`false` failed inside it"):
        push.push(options(pve, 204, doctor="false"))


@pytest.mark.ssh
@pytest.mark.lxc
@pytest.mark.docker
def test_push_with_a_static_net0_gives_eth0_its_address_and_the_hostname(pve):
    """--ostype unmanaged configures nothing inside (the pct double, like PVE, sets no address from ip=):
    push's raw lxc.net.0.ipv4.* lines do, before init, which then names the host after the address."""
    set_pve_version(pve, "8.2.4")
    with lxc_bridge("10.231.78", "p") as bridge:
        net0 = f"name=eth0,bridge={bridge},ip=10.231.78.21/24,gw=10.231.78.1"
        push.push(options(pve, 205, plan={"net0": net0, "hostname": "node-a"}))
        conf = (pve["base"] / "conf" / "205.conf").read_text()
        assert f"net0: {net0}\n" in conf
        assert "lxc.net.0.ipv4.address: 10.231.78.21/24\nlxc.net.0.ipv4.gateway: 10.231.78.1\n" in conf
        ct = lxc.Container("205", pve["base"] / "lxc")
        assert ct.attach(["hostname", "-I"]).stdout.split() == ["10.231.78.21"]
        assert "10.231.78.21\tnode-a\n" in ct.attach(["cat", "/etc/hosts"]).stdout
        # reachable from the host over the bridge: nothing listens on that port, so the answer is a refusal
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("10.231.78.21", 9), timeout=5)
        ct.destroy()
