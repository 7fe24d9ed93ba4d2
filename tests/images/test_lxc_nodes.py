"""Two nodes, proven under real LXC: two containers from the exported template on one host, joined by a
bridge this test creates, each given a static address the way `push` gives one (Proxmox's net0 value,
images/network.py, rendered as LXC keys). torchrun runs across them under plain `lxc-attach` (what
`pct exec` runs): 2 nodes x 1 process, gloo, c10d rendezvous on node 0's eth0 address; first an
all_reduce, then a demo-sized `--layout shard` training whose exported drafter equals the one-node,
two-process run's to the tolerance of tests/dflash/train/test_layouts.py (losses, gradient norms and fp32
weights to 1e-6). Checkpoints and the export go to a directory both nodes mount, as a cluster's shared
filesystem: each rank writes its own DCP shard and rank 0 the manifest and the drafter.

The template, the workload under /data and this venv's packages are those of tests/images/test_lxc.py
(tests/images/conftest.py builds them once per session).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from images import network
from tests.images.test_lxc import python_mounts, wait_for_init
from tests.support.bridge import lxc_bridge
from tests.support.dflash_train_fixtures import assert_same_run, train_args

pytestmark = [pytest.mark.lxc, pytest.mark.docker]

SUBNET = "10.231.77"
NODES = (f"{SUBNET}.11", f"{SUBNET}.12")
RDZV = f"{NODES[0]}:29400"
# tests/dflash/train/test_layouts.py's demo-sized run (OPTS there), under --layout shard
SHARD = dict(layout="shard", max_steps=3, batch_size=5, grad_accum=2, drafter_layers=2, save_every=2,
             drafter_dtype="fp32", target_layer_ids="1,2")
ENV = ["env", "OMP_NUM_THREADS=1"]


@pytest.fixture
def bridge():
    with lxc_bridge(SUBNET, "n") as name:
        yield name


@pytest.fixture
def shared(tmp_path) -> Path:
    d = tmp_path / "shared"
    d.mkdir()
    os.chown(d, 1000, 1000)  # the image's user writes the run there
    return d


@pytest.fixture
def nodes(python_template, workload, bridge, shared, tmp_path):
    from images import lxc

    made = []
    try:
        for i, addr in enumerate(NODES):
            net = network.parse_net(f"name=eth0,bridge={bridge},ip={addr}/24,gw={SUBNET}.1")
            c = lxc.Container(f"dflash-n{i}", tmp_path / "lxc")
            made.append(c)
            extra = python_mounts(workload)
            extra += [f"lxc.mount.entry = {shared} shared none rw,bind,create=dir 0 0"]
            extra += network.lxc_lines(net, 1)  # index 1: the template's config keeps lxc.net.0 = empty
            c.create(python_template, extra=extra)
        for c in made:
            c.start()
        for c in made:
            wait_for_init(c)
        yield made
    finally:
        with ThreadPoolExecutor(len(made) or 1) as pool:  # lxc-stop waits tens of seconds here: both at once
            list(pool.map(lambda c: c.destroy(), made))


def torchrun_on_both(nodes, argv: list[str], timeout: float = 600, local_addr: bool = True
                     ) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2` on each node at once, through plain lxc-attach. --local-addr: the agent that
    becomes rank 0 advertises it as MASTER_ADDR; by default that is its hostname, which the other node
    cannot resolve."""
    run = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", RDZV,
           "--rdzv-id", "two-nodes"]
    procs = [subprocess.Popen(["lxc-attach", "-P", str(c.lxcpath), "-n", c.name, "--clear-env", "--", *ENV, *run,
                               *(["--local-addr", addr] if local_addr else []), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c, addr in zip(nodes, NODES)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def doctor_network(node) -> dict:
    """The doctor's network check alone, as the image's user (the whole `dflash doctor --multi-node` runs
    under torchrun below; importing torch and transformers for the rest costs half a minute here)."""
    code = "import json; from dflash.doctor.network import check_network; print(json.dumps(vars(check_network())))"
    r = node.attach(["python", "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_two_containers_on_a_bridge_train_across_nodes_like_one_node(nodes, shared):
    n0, n1 = nodes
    # LXC set the address before init; init named the host after it; each node reaches the other over eth0
    for node, addr, other in ((n0, NODES[0], NODES[1]), (n1, NODES[1], NODES[0])):
        assert f"{addr}\t{node.name}" in node.attach(["cat", "/etc/hosts"]).stdout
        check = doctor_network(node)
        assert check["status"] == "pass", check
        assert f"routable: eth0 {addr}" in check["reason"] and f"resolves to {addr}" in check["reason"]
        ping = node.attach(["python3", "-c", f"import socket; socket.create_connection(('{other}', 29400), 2)"])
        assert "Connection refused" in ping.stderr  # the other node answers (nothing listens there yet)

    # Without --local-addr, the worker on the other node gets rank 0's hostname as MASTER_ADDR: the doctor
    # (on by itself under a torchrun across nodes) names the fix instead of a hang in init_process_group
    results = torchrun_on_both(nodes, ["--no-python", "dflash", "doctor", "--quick", "--json"], local_addr=False)
    verdicts = [{c["name"]: c for c in json.loads(r.stdout)["checks"]}["network"] for r in results]
    assert sorted(v["status"] for v in verdicts) == ["fail", "pass"], verdicts
    assert "torchrun --local-addr" in next(v["reason"] for v in verdicts if v["status"] == "fail")

    results = torchrun_on_both(nodes, ["/data/allreduce.py"])
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    ranks = sorted(re.findall(r"rank (\d) of 2: all_reduce sum 3", "".join(r.stdout for r in results)))
    assert ranks == ["0", "1"], [r.stdout for r in results]

    two_nodes = train_args(Path("/data/target"), Path("/data/chat.jsonl"), Path("/shared/nodes"), **SHARD)
    for r in torchrun_on_both(nodes, ["-m", "dflash.cli", "train", *two_nodes]):
        assert r.returncode == 0, r.stderr[-4000:]
    one_node = train_args(Path("/data/target"), Path("/data/chat.jsonl"), Path("/shared/one"), **SHARD)
    r = n0.attach([*ENV, "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "dflash.cli", "train", *one_node],
                  timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert_same_run(shared / "one", shared / "nodes")  # the layouts' tests' comparison


def test_doctor_says_a_node_without_a_routable_interface_cannot_join(python_template, workload, tmp_path):
    """The template's own network (`empty`: lo only), as push leaves it without --net0."""
    from images import lxc

    c = lxc.Container("dflash-lo", tmp_path / "lxc")
    try:
        c.create(python_template, extra=python_mounts(workload))
        c.start()
        wait_for_init(c)
        assert "127.0.1.1\tdflash-lo" in c.attach(["cat", "/etc/hosts"]).stdout  # resolves, to a loopback
        check = doctor_network(c)
        assert check["status"] == "fail", check
        assert "no interface besides lo is up with an IPv4 address" in check["reason"]
        assert "--net0 name=eth0,bridge=vmbr0,ip=10.10.0.11/24" in check["reason"]
    finally:
        c.destroy()
