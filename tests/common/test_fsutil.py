"""The shared file-system primitives: atomic writes, file digests, SOURCE_DATE_EPOCH, the build lock."""

from __future__ import annotations

import hashlib
import multiprocessing
import os

import pytest

from wheelbuilder.errors import BusyError, ConfigurationError
from common.fsutil import (DEFAULT_SOURCE_DATE_EPOCH, atomic_write, exclusive, sha256_file,
                                 source_date_epoch)


def test_atomic_write_replaces_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "f.json"
    atomic_write(target, "old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path):
    target = tmp_path / "f"
    atomic_write(target, "old")
    with pytest.raises(TypeError):
        atomic_write(target, 12345)  # not bytes/str: fails while writing the temporary
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_sha256_file_whole_and_prefix(tmp_path):
    data = os.urandom(3 << 20)
    f = tmp_path / "blob"
    f.write_bytes(data)
    seen = []
    assert sha256_file(f, progress=seen.append) == hashlib.sha256(data).hexdigest()
    assert sum(seen) == len(data)
    assert sha256_file(f, limit=1000) == hashlib.sha256(data[:1000]).hexdigest()


def test_source_date_epoch(monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert source_date_epoch() == DEFAULT_SOURCE_DATE_EPOCH
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert source_date_epoch() == 1700000000
    for bad in ("banana", "-5", "2.5"):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", bad)
        with pytest.raises(ConfigurationError, match="SOURCE_DATE_EPOCH"):
            source_date_epoch()


def _hold(directory, ready, release):
    with exclusive(directory):
        ready.set()
        release.wait(30)


def test_exclusive_refuses_a_second_holder_and_keeps_the_holders_pid(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(BusyError, match=f"pid {holder.pid}"):
            with exclusive(tmp_path):
                pass
        # the failed attempt must not have emptied the holder's pid
        assert (tmp_path / ".build.lock").read_text().strip() == str(holder.pid)
    finally:
        release.set()
        holder.join(30)
    with exclusive(tmp_path):  # free again once the holder is gone
        assert (tmp_path / ".build.lock").read_text().strip() == str(os.getpid())
