"""`kernels` (a dependency of transformers 5.25) fetches nothing from the Hugging Face Hub: not after dflash
starts, and not in the image's environment.

The Hub here is a real HTTP server on 127.0.0.1 that records every request and answers 404; each case runs
in a fresh Python whose HF_ENDPOINT points at it, with its own empty HF cache, so whatever transformers or
`kernels` would download shows up as a recorded request. On top of that a socket guard in that Python refuses
and records every connection to, and every name lookup of, anything but the loopback address, so a download
from elsewhere (GitHub, a hard-coded hub URL) shows up too. The first test shows that the recorder does see
a hub kernel being asked for; the others that nothing asks and nothing connects.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# The environment every case starts from: none of the settings under test, and no proxy for 127.0.0.1.
CLEARED = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "USE_HUB_KERNELS", "LOCAL_KERNELS", "KERNELS_CACHE",
           "DISABLE_KERNEL_MAPPING", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE")


@contextmanager
def recording_hub():
    """A stand-in Hub on 127.0.0.1: yields (endpoint URL, list of "METHOD path" it was asked)."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            asked.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_POST = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", asked
    finally:
        server.shutdown()
        server.server_close()


# Run first in each case's interpreter: connections and name lookups beyond the loopback address fail, and
# the interpreter prints what was tried as it exits.
SOCKET_GUARD = """
import atexit, socket
_outside = []
_LOCAL = {"127.0.0.1", "::1", "localhost"}
_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo
def _guarded_connect(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
        _outside.append(f"connect {address[0]}:{address[1]}")
        raise OSError(f"the test allows no connection to {address[0]}")
    return _connect(sock, address)
def _guarded_getaddrinfo(host, *args, **kwargs):
    if host is not None and (host.decode() if isinstance(host, bytes) else host) not in _LOCAL:
        _outside.append(f"resolve {host}")
        raise socket.gaierror(f"the test allows no name lookup of {host}")
    return _getaddrinfo(host, *args, **kwargs)
socket.socket.connect, socket.getaddrinfo = _guarded_connect, _guarded_getaddrinfo
atexit.register(lambda: print("outside the machine:", _outside))
"""


def run_python(code: str, tmp_path: Path, endpoint: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter behind the socket guard that takes `endpoint` for the Hub, with `env` on
    top."""
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    base.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), NO_PROXY="127.0.0.1,localhost",
                no_proxy="127.0.0.1,localhost", PYTHONPATH=str(REPO), **env)
    r = subprocess.run([sys.executable, "-c", SOCKET_GUARD + code], env=base, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def nothing_left_the_machine(r: subprocess.CompletedProcess) -> bool:
    return "outside the machine: []" in r.stdout.splitlines()


def image_environment() -> dict[str, str]:
    """The ENV the Dockerfile's runtime-env stage sets (the runtime image inherits it)."""
    text = (REPO / "Dockerfile").read_text()
    stage = text[text.index("AS runtime-env"):text.index("AS runtime\n")]
    block = re.search(r"^ENV (.*?)(?<!\\)\n", stage, re.S | re.M).group(1)
    return dict(item.split("=", 1) for item in block.replace("\\\n", " ").split())


# transformers' loader of its FP8 matmul kernel (FineGrainedFP8 layers call it at their first forward).
LAZY_LOAD = """
from transformers.integrations.hub_kernels import lazy_load_kernel
try:
    print("finegrained-fp8:", lazy_load_kernel("finegrained-fp8"))
except Exception as e:
    print("finegrained-fp8 failed:", type(e).__name__)
"""


def test_the_recorder_sees_a_hub_kernel_asked_for_when_hub_kernels_are_on(tmp_path):
    """The control: transformers' FP8 kernel loader with hub kernels on asks the Hub for its kernel."""
    with recording_hub() as (endpoint, asked):
        r = run_python(LAZY_LOAD, tmp_path, endpoint, USE_HUB_KERNELS="1")
    assert "finegrained-fp8 failed" in r.stdout, r.stdout  # the stand-in Hub has no kernel to give
    assert any("kernels-community" in a for a in asked), asked


def test_the_socket_guard_sees_a_hub_kernel_asked_for_at_the_real_hub(tmp_path):
    """The control of the guard: the same loader pointed at the real Hub is stopped at its name lookup."""
    r = run_python(LAZY_LOAD, tmp_path, "https://huggingface.co", USE_HUB_KERNELS="1")
    assert "finegrained-fp8 failed" in r.stdout, r.stdout
    assert not nothing_left_the_machine(r) and "resolve huggingface.co" in r.stdout, r.stdout


def test_after_dflash_starts_no_hub_kernel_is_fetched(tmp_path):
    """HF_HUB_OFFLINE unset, USE_HUB_KERNELS unset: importing dflash switches hub kernels off, so the
    loaders that would download refuse or skip, and a Qwen3.5 target loads and runs with no request."""
    from tests.support.dflash_tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "target", "qwen3_5")
    code = f"""
import os, torch
import dflash
assert os.environ["USE_HUB_KERNELS"] == "0"
{LAZY_LOAD}
from transformers import AutoModelForCausalLM
from transformers.integrations.hub_kernels import kernelize
model = AutoModelForCausalLM.from_pretrained({str(target)!r}, use_kernels=True)
assert not model.use_kernels, "use_kernels=True must be refused"
try:
    kernelize(model)
except ValueError as e:
    print("kernelize:", e)
else:
    raise AssertionError("kernelize ran with hub kernels off")
from dflash.model.target import Target
t = Target.load({str(target)!r})
print("context:", tuple(t.context(torch.randint(4, 96, (1, 12))).shape))
from dflash.doctor.kernel_path import check_kernel_path
print("kernel-path:", check_kernel_path([]).reason)
"""
    with recording_hub() as (endpoint, asked):
        r = run_python(code, tmp_path, endpoint)
    assert "finegrained-fp8: None" in r.stdout and "Hub kernels are disabled" in r.stdout, r.stdout
    assert "context: (1, 12, 160)" in r.stdout, r.stdout
    assert "hub kernels off (USE_HUB_KERNELS=0)" in r.stdout, r.stdout
    assert asked == [] and nothing_left_the_machine(r), r.stdout


def test_the_image_environment_keeps_every_kernel_loader_offline(tmp_path):
    """The image's ENV (read from the Dockerfile): even the loaders that ignore USE_HUB_KERNELS (`kernels`'
    get_kernel, a Hub attention kernel) only look in the empty local cache and fail without a request."""
    env = image_environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["USE_HUB_KERNELS"] == "0", env
    code = f"""
{LAZY_LOAD}
from kernels import get_kernel
try:
    get_kernel("kernels-community/activation", version=1)
except Exception as e:
    print("get_kernel:", type(e).__name__, e)
else:
    raise AssertionError("a hub kernel loaded from an empty cache")
from transformers.integrations.hub_kernels import load_and_register_attn_kernel
try:
    load_and_register_attn_kernel("kernels-community/flash-attn2")
except Exception as e:
    print("attention kernel:", type(e).__name__)
else:
    raise AssertionError("a hub attention kernel loaded from an empty cache")
"""
    with recording_hub() as (endpoint, asked):
        r = run_python(code, tmp_path, endpoint, HF_HUB_OFFLINE=env["HF_HUB_OFFLINE"],
                       USE_HUB_KERNELS=env["USE_HUB_KERNELS"])
    assert "finegrained-fp8: None" in r.stdout and "offline mode" in r.stdout, r.stdout
    assert "attention kernel:" in r.stdout, r.stdout
    assert asked == [] and nothing_left_the_machine(r), r.stdout


@pytest.mark.parametrize("value", ["1", "yes"])
def test_an_explicit_use_hub_kernels_is_left_as_it_is(tmp_path, value):
    """dflash only supplies the default: whoever sets USE_HUB_KERNELS keeps it."""
    with recording_hub() as (endpoint, _):
        r = run_python("import os, dflash; print(os.environ['USE_HUB_KERNELS'])", tmp_path, endpoint,
                       USE_HUB_KERNELS=value)
    assert r.stdout.splitlines()[0] == value
