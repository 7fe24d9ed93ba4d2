"""Property-based fuzzing (hypothesis) of the parsers that read files users hand in: chat JSONL,
manifest.json, targets.toml, the .nv_fatbin reader and checkpoint metadata. Whatever the bytes, only the
program's documented error type may escape (a message and an exit code), never a traceback.

Bounded in CI: the "ci" profile runs DFLASH_FUZZ_EXAMPLES examples per parser (default 200); the "long"
profile runs many more on demand:

    DFLASH_FUZZ_PROFILE=long .venv/bin/python -m pytest tests/test_fuzz_parsers.py
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.errors import CheckpointError, DataError
from wheelbuilder.errors import AuditError, ConfigurationError

settings.register_profile("ci", max_examples=int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "200")), deadline=None,
                          derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("DFLASH_FUZZ_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
                    max_leaves=20)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "", "x"]),
                                 "content": st.one_of(st.text(max_size=30), st.integers(), st.none())})
CONVERSATION = st.one_of(st.lists(MESSAGE, max_size=4), st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}),
                         JSON)


def _file(name: str, data: bytes) -> Path:
    d = Path(tempfile.mkdtemp(prefix="fuzz-"))
    (d / name).write_bytes(data)
    return d / name


@given(lines=st.lists(st.one_of(CONVERSATION.map(json.dumps), st.text(max_size=40)), max_size=6),
       bom=st.booleans(), junk=st.binary(max_size=16), on_error=st.sampled_from(["skip", "stop"]))
def test_chat_jsonl(lines, bom, junk, on_error):
    from dflash.data.chat import load_chat_jsonl

    data = ("\ufeff" if bom else "").encode() + "\n".join(lines).encode() + junk
    try:
        conversations, _report = load_chat_jsonl(_file("chat.jsonl", data), on_error=on_error)
    except DataError:
        return
    assert isinstance(conversations, list)


MANIFEST_ENTRY = st.fixed_dictionaries({k: JSON for k in (
    "filename", "size", "sha256", "recipe", "recipe_version", "source_url", "source_sha256", "target", "arches",
    "toolchain", "build_seconds", "source_date_epoch")})


@given(doc=st.one_of(JSON, st.fixed_dictionaries({"format": st.sampled_from([1, 2, "1"]),
                                                  "wheels": st.lists(st.one_of(MANIFEST_ENTRY, JSON), max_size=3)})),
       raw=st.booleans(), junk=st.binary(max_size=24))
def test_manifest_json(doc, raw, junk):
    from wheelbuilder.manifest import read_manifest, verify_wheels

    path = _file("manifest.json", junk if raw else json.dumps(doc).encode())
    try:
        read_manifest(path.parent)
    except AuditError:
        pass
    assert all(isinstance(p, str) for p in verify_wheels(path.parent))


TARGETS = (REPO / "targets.toml").read_text()


@given(cut=st.integers(0, len(TARGETS)), insert=st.text(max_size=30), at=st.integers(0, len(TARGETS)),
       mode=st.sampled_from(["cut", "insert", "both"]))
def test_targets_toml(cut, insert, at, mode):
    from wheelbuilder.targets import load

    text = TARGETS
    if mode in ("insert", "both"):
        text = text[:at] + insert + text[at:]
    if mode in ("cut", "both"):
        text = text[:cut]
    try:
        load(_file("targets.toml", text.encode("utf-8", "surrogatepass")))
    except ConfigurationError:
        pass


def _container(entries: list[tuple[int, int, int, int, int]]) -> bytes:
    """A fatbin container of entries (kind, header size, payload size, sm, flags), payloads zeroed."""
    body = b""
    for kind, ehead, esize, sm, flags in entries:
        header = struct.pack("<HHIQIIHHI", kind, 0x101, ehead, esize, 0, 0, 0, 0, sm).ljust(max(ehead, 64), b"\0")
        header = header[:40] + struct.pack("<Q", flags) + header[48:]
        body += header[:max(ehead, 0)] + b"\0" * min(esize, 256)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


FATBIN_ENTRY = st.tuples(st.integers(0, 3), st.sampled_from([0, 8, 63, 64, 72, 80]), st.integers(0, 300),
                         st.sampled_from([90, 100, 120]), st.sampled_from([0, 0x2000, 0x8000, 0x100000]))


@given(entries=st.lists(FATBIN_ENTRY, max_size=4), flips=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)),
                                                                   max_size=4), tail=st.binary(max_size=32))
def test_fatbin_section(entries, flips, tail):
    from wheelbuilder.fatbin import parse_fatbin_section, summarize

    data = bytearray(_container(entries) + tail)
    for pos, value in flips:
        if pos < len(data):
            data[pos] = value
    try:
        summary = summarize(parse_fatbin_section(bytes(data)))
    except AuditError:
        return
    assert set(summary) == {"sass", "ptx", "arch_specific"}


ELF = Path(struct.__file__).parent  # any shared object of the interpreter is an ELF without device code


@given(cut=st.integers(0, 4096), flips=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=3))
def test_fatbin_elf_reader(cut, flips):
    import _ctypes

    from wheelbuilder.fatbin import read_fatbin

    data = bytearray(Path(_ctypes.__file__).read_bytes()[: 64 + cut * 16])
    for pos, value in flips:
        if pos < len(data):
            data[pos] = value
    try:
        read_fatbin(_file("m.so", bytes(data)))
    except AuditError:
        pass


@given(latest=st.text(max_size=30), steps=st.lists(st.integers(0, 99), max_size=3), state=st.binary(max_size=64))
def test_checkpoint_metadata(latest, steps, state):
    from dflash.train.checkpoint import STATE_FILE, latest_checkpoint, load_state, step_dir_name

    root = Path(tempfile.mkdtemp(prefix="fuzz-ckpt-"))
    for s in steps:
        (root / step_dir_name(s)).mkdir(exist_ok=True)
        (root / step_dir_name(s) / STATE_FILE).write_bytes(state)
    (root / "latest").write_text(latest, errors="surrogateescape")
    try:
        found = latest_checkpoint(root)
    except CheckpointError:
        return
    if found is not None:
        with pytest.raises(CheckpointError):
            load_state(found)  # fuzzed bytes are never a valid trainer state
