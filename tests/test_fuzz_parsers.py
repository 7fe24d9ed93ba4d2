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

_SCRATCH: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _scratch_root(tmp_path_factory):
    """Every example's files go under one pytest-managed folder (hypothesis runs a test body many times per
    function-scoped fixture, so examples make their own folders, here rather than loose in the system temp)."""
    _SCRATCH.append(tmp_path_factory.mktemp("fuzz"))
    yield
    _SCRATCH.pop()


def _scratch(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[-1]))

REPO = Path(__file__).resolve().parents[1]
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
                    max_leaves=20)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "", "x"]),
                                 "content": st.one_of(st.text(max_size=30), st.integers(), st.none())})
CONVERSATION = st.one_of(st.lists(MESSAGE, max_size=4), st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}),
                         JSON)


def _file(name: str, data: bytes) -> Path:
    d = _scratch("fuzz-")
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
    from dflash.train.records.checkpoint import STATE_FILE, latest_checkpoint, load_state, step_dir_name

    root = _scratch("fuzz-ckpt-")
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


# --- run-directory readers: `dflash report`, checkpoint metadata, --resume's checks -------------------
NUMBER = st.one_of(st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.integers(),
                   st.booleans(), st.none(), st.text(max_size=6))
METRIC_VALUE = st.one_of(NUMBER, st.lists(NUMBER, max_size=4), JSON)
METRICS_KEYS = ("step", "split", "loss", "acc", "tau_est", "tau", "tau_replay", "tokens_per_s", "mfu",
                "gpu_mem_gib", "acc_per_pos", "accept_per_pos", "lr", "grad_norm", "tau_prompts")
METRICS_RECORD = st.one_of(
    st.dictionaries(st.sampled_from(METRICS_KEYS), METRIC_VALUE, max_size=8),
    st.fixed_dictionaries({"step": st.one_of(st.integers(0, 50), NUMBER),
                           "split": st.sampled_from(["train", "eval", "test", 3, None])},
                          optional={k: METRIC_VALUE for k in METRICS_KEYS[2:]}),
    JSON)
METRICS_LINE = st.one_of(METRICS_RECORD.map(lambda r: json.dumps(r).encode()), st.binary(max_size=24),
                         st.just(b'{"step": 1, "lo'), st.just(b"[" * 5000))


def _run_dir(lines: list[bytes], config: bytes | None) -> Path:
    run = _scratch("fuzz-run-")
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))
    if config is not None:
        (run / "config.json").write_bytes(config)
    return run


@given(lines=st.lists(METRICS_LINE, max_size=8),
       config=st.one_of(st.none(), JSON.map(lambda d: json.dumps(d).encode()), st.binary(max_size=16)))
def test_report_readers(lines, config):
    """metrics.jsonl and config.json of a run, as `dflash report` reads, summarises and plots them: whatever
    they hold, a report (what was left out named) or a DflashError."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash.errors import DflashError
    from dflash.train.records import run_report
    from dflash.train.records.rundir import RunDir

    run = _run_dir(lines, config)
    problems: list[str] = []
    try:
        train, evals = run_report.read_records(run, problems)
    except DflashError:
        return
    settings_ = run_report.read_config(RunDir(run), problems)
    assert isinstance(run_report.summary_markdown(run, train, evals, settings_, problems), str)
    fig, ax = plt.subplots()
    try:
        for draw in (run_report._plot_loss, run_report._plot_acceptance, run_report._plot_tau,
                     run_report._plot_throughput):
            draw(ax, train, evals)
            ax.cla()
    finally:
        plt.close("all")


@settings(max_examples=max(5, int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "200")) // 20))
@given(lines=st.lists(METRICS_LINE, max_size=6), config=st.one_of(st.none(), st.binary(max_size=16)))
def test_report_command(lines, config):
    """`dflash report RUN_DIR` end to end (plots written): exit 0 or a DflashError's code, never a traceback.
    Fewer examples: each writes four PNGs."""
    import contextlib
    import io

    from dflash.cli import main

    run = _run_dir(lines, config)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["report", str(run)])
    assert code in (0, 2), err.getvalue()
    assert "Traceback" not in err.getvalue()


def _drafter_reference() -> dict:
    from dflash.io.drafter_dir import reference_config
    from dflash.model.drafter import DrafterConfig

    config = DrafterConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=48, vocab_size=96, block_size=4, num_target_layers=4,
                           target_layer_ids=[1, 2], mask_token_id=3, target_fingerprint="abc")
    return json.loads(json.dumps(reference_config(config)))


DRAFTER_KEYS = sorted(_drafter_reference()) + ["dflash_config.target_layer_ids", "dflash_config.mask_token_id",
                                               "dflash_config.extra", "format", "eagle_aux_hidden_state_layer_ids"]
FIELD_VALUE = st.one_of(JSON, st.lists(st.one_of(st.integers(-2, 6), st.text(max_size=3)), max_size=4),
                        st.sampled_from(["full_attention", "sliding_attention", "dflash-drafter/1", "qwen3"]))


@given(edits=st.dictionaries(st.sampled_from(DRAFTER_KEYS), st.one_of(FIELD_VALUE, st.just("<drop>")), max_size=4),
       whole=st.one_of(st.none(), JSON))
def test_drafter_config(edits, whole):
    """A drafter's (or a checkpoint's drafter/) config.json with fields of any value: a DrafterConfig or a
    DrafterError naming the problem."""
    from dflash.errors import DrafterError
    from dflash.io.drafter_dir import parse_reference_config

    data = _drafter_reference() if whole is None else whole
    if isinstance(data, dict):
        for key, value in edits.items():
            holder, name = (data, key) if not key.startswith("dflash_config.") else (
                data.get("dflash_config"), key.split(".", 1)[1])
            if not isinstance(holder, dict):
                continue
            if value == "<drop>":
                holder.pop(name, None)
            else:
                holder[name] = value
    try:
        parse_reference_config(data if isinstance(data, dict) else {"x": data})
    except DrafterError:
        pass


@given(config=st.one_of(st.binary(max_size=48), JSON.map(lambda d: json.dumps(d).encode())))
def test_drafter_config_file(config):
    from dflash.errors import DrafterError
    from dflash.io.drafter_dir import read_drafter_config

    directory = _scratch("fuzz-drafter-")
    (directory / "config.json").write_bytes(config)
    (directory / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}      ")
    try:
        read_drafter_config(directory)
    except DrafterError:
        pass


_STATE: dict = {}


def _valid_state() -> bytes:
    """trainer_state.pt bytes of the shape the trainer writes (made once)."""
    if "bytes" not in _STATE:
        import io

        import torch

        buffer = io.BytesIO()
        torch.save({"format": 1, "step": 2, "optimizer": {"state": {}, "param_groups": []}, "scheduler": {},
                    "rng": {"torch": torch.get_rng_state()}, "epoch": 0, "batch_index": 2}, buffer)
        _STATE["bytes"] = buffer.getvalue()
    return _STATE["bytes"]


@given(latest=st.one_of(st.just("step-00000002"), st.text(max_size=20)),
       cut=st.one_of(st.none(), st.integers(0, 4000)),
       flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=3),
       drafter=st.one_of(st.none(), st.binary(max_size=32)))
def test_resume_checks(latest, cut, flips, drafter):
    """What --resume checks before the target loads (dflash.train.precheck): `latest`, the checkpoint's
    drafter/ and its trainer_state.pt, damaged any way: nothing or a DflashError (a CheckpointError)."""
    from types import SimpleNamespace

    from dflash.errors import DflashError
    from dflash.train.precheck import check_resume_checkpoint

    out = _scratch("fuzz-resume-")
    step = out / "checkpoints" / "step-00000002"
    (step / "drafter").mkdir(parents=True)
    config = _drafter_reference()
    config["dflash_config"]["target_layer_ids"] = [1, 2]
    (step / "drafter" / "config.json").write_bytes(drafter if drafter is not None else json.dumps(config).encode())
    (step / "drafter" / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}      ")
    state = bytearray(_valid_state()[:cut] if cut is not None else _valid_state())
    for pos, value in flips:
        if pos < len(state):
            state[pos] = value
    (step / "trainer_state.pt").write_bytes(bytes(state))
    (out / "checkpoints" / "latest").write_text(latest, errors="surrogateescape")
    try:
        check_resume_checkpoint(SimpleNamespace(io=SimpleNamespace(resume=True, out=str(out))))
    except DflashError:
        pass


MANIFEST_NAMES = st.one_of(st.sampled_from(["a.bin", "sub/b.bin", "./a.bin", "../a.bin", "/etc/hostname", "",
                                            "manifest.json"]), st.text(max_size=12))
MANIFEST_FILES = st.dictionaries(MANIFEST_NAMES, st.one_of(
    st.fixed_dictionaries({}, optional={"size": st.one_of(st.sampled_from([1, 2]), NUMBER),
                                        "sha256": st.one_of(st.text("0123456789abcdef", min_size=64, max_size=64),
                                                            st.text(max_size=70), NUMBER)}), JSON), max_size=4)


@given(doc=st.one_of(JSON, st.fixed_dictionaries({"files": st.one_of(MANIFEST_FILES, JSON)})), raw=st.booleans(),
       junk=st.binary(max_size=24))
def test_checkpoint_manifest(doc, raw, junk):
    """A checkpoint's manifest.json, damaged any way (--resume's last check, dflash.train.records.manifest): what
    is wrong comes back as (the file, a reason), never an exception; fuzzed sums never match."""
    from dflash.train.records.manifest import MANIFEST, check_manifest

    checkpoint = _scratch("fuzz-manifest-")
    (checkpoint / "sub").mkdir()
    (checkpoint / "a.bin").write_bytes(b"a")
    (checkpoint / "sub" / "b.bin").write_bytes(b"bb")
    (checkpoint / MANIFEST).write_bytes(junk if raw else json.dumps(doc).encode())
    path, reason = check_manifest(checkpoint)
    assert isinstance(path, Path) and isinstance(reason, str) and reason


TARGET_CONFIG = st.fixed_dictionaries(
    {"model_type": st.one_of(st.sampled_from(["qwen3", "qwen3_5_text", "llama", "nope", ""]), JSON)},
    optional={k: JSON for k in ("num_hidden_layers", "hidden_size", "vocab_size", "layer_types", "text_config",
                                "rope_parameters", "num_attention_heads")})


@given(config=st.one_of(TARGET_CONFIG.map(lambda d: json.dumps(d).encode()), st.binary(max_size=32),
                        JSON.map(lambda d: json.dumps(d).encode())))
def test_target_config(config):
    """A target's config.json, read before its weights: a config or a TargetError."""
    from dflash.errors import TargetError
    from dflash.model.target import read_target_config

    directory = _scratch("fuzz-target-")
    (directory / "config.json").write_bytes(config)
    try:
        read_target_config(directory)
    except TargetError:
        pass


@given(lines=st.lists(st.one_of(CONVERSATION.map(lambda c: json.dumps(c).encode()), st.binary(max_size=40)),
                      max_size=6),
       bom=st.booleans(), suffix=st.sampled_from([".jsonl", ".json"]), max_length=st.integers(1, 40))
def test_data_shard_reader(lines, bom, suffix, max_length):
    """--data files as the training reader and its check before the target loads see them: records (each
    refused one with its reason: not UTF-8, too long for --max-length), or a DataError naming the file."""
    from types import SimpleNamespace

    from dflash.data.sources import _shard_records, max_record_bytes
    from dflash.train.precheck import check_data_paths

    path = _file("data" + suffix, (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines))
    try:
        check_data_paths(SimpleNamespace(io=SimpleNamespace(data=str(path)), watch=SimpleNamespace(eval_data=None)))
        records = list(_shard_records([str(path)], max_length))
    except DataError:
        return
    for record in records:
        assert set(record) == {"raw", "where", "error"} and all(isinstance(v, str) for v in record.values())
        assert record["error"].startswith(("not_utf8", "too_long")) if record["error"] else True
        assert len(record["raw"].encode("utf-8", "surrogatepass")) <= max_record_bytes(max_length)


RUN_CONFIG_KEYS = ("block_size", "lr", "max_length", "target_layer_ids", "report_to", "epochs", "target", "resume",
                   "eval_fraction", "precision")


@given(doc=st.one_of(st.dictionaries(st.sampled_from(RUN_CONFIG_KEYS), JSON, max_size=3), JSON),
       raw=st.one_of(st.none(), st.binary(max_size=16)))
def test_resume_run_config(doc, raw):
    """<out>/config.json as `dflash-train --resume` reads it back: a TrainConfig or a ConfigError."""
    from dflash.config import TrainConfig
    from dflash.errors import DflashError

    path = _file("config.json", raw if raw is not None else json.dumps(doc).encode())
    try:
        TrainConfig.from_json(path)
    except DflashError:
        pass


def test_a_jsonl_record_of_exactly_the_limit_is_kept_without_its_line_end():
    """A found case: a 128-byte record on a line of its own (129 bytes with the newline) at --max-length 1."""
    from dflash.data.sources import _shard_records, max_record_bytes

    limit = max_record_bytes(1)
    frame = json.dumps({"messages": [{"role": "user", "content": ""}]})
    record = json.dumps({"messages": [{"role": "user", "content": "x" * (limit - len(frame))}]})
    assert len(record.encode()) == limit
    path = _file("exact.jsonl", record.encode() + b"\r\n" + b"[]\n")
    records = list(_shard_records([str(path)], 1))
    assert records[0] == {"raw": record, "where": f"{path}:1", "error": ""}
