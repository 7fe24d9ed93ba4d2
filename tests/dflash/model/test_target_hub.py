"""--target as a Hub model id: resolved from a local HF cache laid out as huggingface_hub writes it
(models--org--name/refs/main + snapshots/<rev>/), offline; the errors say what was tried."""

from __future__ import annotations

import pytest

from dflash.errors import TargetError
from dflash.model.target import Target, resolve_target
from tests.support.dflash_tiny import save_tiny_target

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen3"
    save_tiny_target(repo / "snapshots" / REV, "qwen3")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_loads_from_the_local_cache_offline(hub_cache):
    assert resolve_target("tiny-org/tiny-qwen3") == hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / REV
    target = Target.load("tiny-org/tiny-qwen3")
    assert target.num_layers == 6 and target.config.model_type == "qwen3"


def test_missing_id_offline_says_the_cache_was_tried_and_download_was_not(hub_cache):
    with pytest.raises(TargetError, match=rf"--target tiny-org/absent: not a local directory and not in the local "
                                          rf"HF cache {hub_cache} .*downloading was not tried because HF_HUB_OFFLINE"):
        resolve_target("tiny-org/absent")


def test_missing_id_online_says_both_were_tried(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: fails at once
    with pytest.raises(TargetError, match=r"not in the local HF cache .*, and downloading it failed"):
        resolve_target("tiny-org/absent")


def test_neither_directory_nor_id(tmp_path):
    with pytest.raises(TargetError, match="no such directory, and not a Hub model id"):
        resolve_target(tmp_path / "no" / "such" / "dir")
