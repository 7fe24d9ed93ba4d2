"""Fixtures of the training tests: the tiny chat target with its data, and a clean "dflash" logger after
every test (a dflash-train run binds its log handlers to the test's stderr and its train.log)."""

from __future__ import annotations

import pytest

from tests.support.dflash_train_fixtures import drop_run_log_handlers, save_chat_target, write_chat_jsonl


@pytest.fixture(autouse=True)
def no_handlers_left_by_a_run():
    yield
    drop_run_log_handlers()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """(the tiny chat target, 24 demo conversations as chat JSONL), once per test module."""
    root = tmp_path_factory.mktemp("chat")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=24)
