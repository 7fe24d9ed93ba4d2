"""Fixtures the real-LXC test modules share, built once per session: the Python image's template and the
workload mounted at /data (tests/images/test_lxc.py, tests/images/test_lxc_nodes.py)."""

import sys
from pathlib import Path

import pytest

from images import export, lxc
from tests.support.demo_image import python_image
from tests.support.dflash_train_fixtures import save_chat_target, write_chat_jsonl

ALL_REDUCE = """import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="session")
def python_template(tmp_path_factory):
    why = lxc.available()
    if why:
        pytest.skip(why)
    if sys.version_info[:2] != (3, 11):
        pytest.skip(f"the container runs Debian bookworm's python3.11 on this venv's packages; this venv is "
                    f"Python {sys.version_info.major}.{sys.version_info.minor}")
    pytest.importorskip("docker")
    try:
        image = python_image()
    except Exception as e:
        pytest.skip(f"cannot build the Python test image: {e}")
    (template,) = export.export(image, "template", tmp_path_factory.mktemp("py-artifacts"), progress=False).artifacts
    return template


@pytest.fixture(scope="session")
def workload(tmp_path_factory) -> Path:
    """/data inside: a tiny chat target, chat data and a gloo all_reduce script, readable by uid 1000."""
    data = tmp_path_factory.mktemp("data")
    save_chat_target(data / "target")
    write_chat_jsonl(data / "chat.jsonl", n=24)
    (data / "allreduce.py").write_text(ALL_REDUCE)
    for path in [data, *data.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return data


