"""dflash.datasets_io + dflash.token_cache: every input format, the on-disk cache (second start tokenises
nothing, another tokenizer rebuilds), the evaluation split, rank sharing, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import dflash.data.spans
from dflash.data import token_cache
from dflash.demo.corpus import demo_conversations
from dflash.demo.tokenizer import build_chat_tokenizer
from dflash.errors import DataError
from dflash.data.token_cache import load_tokenized

THINK = (Path(__file__).resolve().parents[2] / "data" / "templates" / "think_after_last_query.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_chat_tokenizer(["\n".join(m["content"] for m in c) for c in demo_conversations(200, seed=5)],
                               vocab_size=400)
    tok.chat_template = THINK
    return tok


def _conversations(n=24):
    convs = demo_conversations(n, seed=1, turns=(2, 2))
    for c in convs[::3]:  # some with reasoning, kept on the last turn only
        c[-1]["reasoning_content"] = "think about it first"
    return convs


def _config(tmp_path, data, **kw):
    from dflash.config import TrainConfig

    values = dict(target=str(tmp_path / "target"), data=str(data), out=str(tmp_path / "run"),
                  data_cache=str(tmp_path / "cache"), num_proc=1, max_length=512, block_size=4, seed=0, eval_data=None,
                  eval_fraction=0.0, on_bad_line="skip", progress=False)
    values.update(kw)
    return TrainConfig.from_flat(values)


@pytest.fixture
def count_tokenised(monkeypatch):
    calls = []
    real = dflash.data.spans.tokenize_conversation

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash.data.spans, "tokenize_conversation", counting)
    return calls


def _jsonl(path, convs, extra_lines=()):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs) + "".join(extra_lines))
    return path


def _ids(items):
    return [(it["input_ids"].tolist(), it["loss_mask"].tolist()) for it in items]


def test_second_start_tokenises_nothing_and_another_tokenizer_rebuilds(tmp_path, tokenizer, count_tokenised):
    data = _jsonl(tmp_path / "chat.jsonl", _conversations())
    first = load_tokenized(_config(tmp_path, data), tokenizer)
    assert len(count_tokenised) == 24 and len(first) == 24 and first.eval is None
    second = load_tokenized(_config(tmp_path, data, out=str(tmp_path / "other-run")), tokenizer)
    assert len(count_tokenised) == 24  # read from the cache: no conversation tokenised again
    assert _ids(second) == _ids(first) and second.fingerprint == first.fingerprint
    assert second.lengths == [len(ids) for ids, _ in _ids(first)]
    # the same data under another name hits the same cache (the key is the content)
    copy = _jsonl(tmp_path / "copy.jsonl", _conversations())
    load_tokenized(_config(tmp_path, copy), tokenizer)
    assert len(count_tokenised) == 24
    # a tokenizer with another chat template: rebuilt, not reused
    other = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    other.chat_template = THINK.replace("<|im_start|>assistant\\n'", "<|im_start|>assistant\\n\\n'")
    rebuilt = load_tokenized(_config(tmp_path, data), other)
    assert len(count_tokenised) == 48 and rebuilt.fingerprint != first.fingerprint
    assert len(list((tmp_path / "cache").iterdir())) == 2  # no temporary directory left behind


def test_every_format_gives_the_same_items(tmp_path, tokenizer):
    import datasets

    convs = _conversations(12)
    reference = _ids(load_tokenized(_config(tmp_path, _jsonl(tmp_path / "a.jsonl", convs)), tokenizer))
    (tmp_path / "a.json").write_text(json.dumps([{"messages": c} for c in convs]))
    shards = tmp_path / "shards"
    shards.mkdir()
    _jsonl(shards / "part-0.jsonl", convs[:5])
    datasets.Dataset.from_list([{"messages": c} for c in convs[5:]]).to_parquet(str(shards / "part-1.parquet"))
    datasets.Dataset.from_list([{"conversations": c, "id": i} for i, c in enumerate(convs)]).save_to_disk(
        str(tmp_path / "saved"))
    for data in (tmp_path / "a.json", shards, tmp_path / "saved"):
        assert _ids(load_tokenized(_config(tmp_path, data), tokenizer)) == reference, data


def test_parallel_tokenisation_matches_one_process(tmp_path, tokenizer):
    data = _jsonl(tmp_path / "chat.jsonl", _conversations(40))
    one = load_tokenized(_config(tmp_path, data, data_cache=str(tmp_path / "c1")), tokenizer)
    two = load_tokenized(_config(tmp_path, data, data_cache=str(tmp_path / "c2"), num_proc=2), tokenizer)
    assert _ids(one) == _ids(two)


def test_bad_records_are_counted_with_reasons(tmp_path, tokenizer):
    good = _conversations(8)
    lines = ["{not json\n", json.dumps({"text": "no conversation"}) + "\n",
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n",
             json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                                      {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": "now an answer"}]}) + "\n"]
    data = _jsonl(tmp_path / "chat.jsonl", good, lines)
    items = load_tokenized(_config(tmp_path, data), tokenizer)
    assert len(items) == 8
    assert items.report.skipped == {"bad_json": 1, "bad_conversation": 1, "no_assistant_turn": 1,
                                    "empty_assistant_turn": 1}
    assert any(f"{data}:9:" in e for e in items.report.examples)
    with pytest.raises(DataError, match=rf"{data}:9: .*--on-bad-line skip"):
        load_tokenized(_config(tmp_path, data, on_bad_line="stop", data_cache=str(tmp_path / "c2")), tokenizer)


def test_unreadable_shard_and_non_conversation_column_are_named(tmp_path, tokenizer):
    import datasets

    shards = tmp_path / "shards"
    shards.mkdir()
    _jsonl(shards / "a.jsonl", _conversations(4))
    (shards / "b.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"b\.parquet: cannot be read as Parquet"):
        load_tokenized(_config(tmp_path, shards), tokenizer)
    flat = tmp_path / "flat.parquet"
    datasets.Dataset.from_list([{"prompt": "q", "response": "a"}]).to_parquet(str(flat))
    with pytest.raises(DataError, match=r"flat\.parquet: no conversation column \(columns: prompt, response\)"):
        load_tokenized(_config(tmp_path, flat), tokenizer)
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match="unknown data format '.csv'"):
        load_tokenized(_config(tmp_path, tmp_path / "x.csv"), tokenizer)


def test_eval_split_by_fraction_and_by_file(tmp_path, tokenizer):
    data = _jsonl(tmp_path / "chat.jsonl", _conversations(20))
    items = load_tokenized(_config(tmp_path, data, eval_fraction=0.25), tokenizer)
    assert (len(items), len(items.eval)) == (15, 5)
    whole = _ids(load_tokenized(_config(tmp_path, data), tokenizer))
    assert sorted(_ids(items) + _ids(items.eval)) == sorted(whole)
    held = _jsonl(tmp_path / "held.jsonl", _conversations(3))
    items = load_tokenized(_config(tmp_path, data, eval_data=str(held)), tokenizer)
    assert (len(items), len(items.eval)) == (20, 3)


def test_other_ranks_wait_and_read(tmp_path, tokenizer, monkeypatch, count_tokenised):
    data = _jsonl(tmp_path / "chat.jsonl", _conversations(6))
    barriers = []
    monkeypatch.setattr(token_cache.distributed, "barrier", lambda d: barriers.append(d.rank))
    monkeypatch.setattr(token_cache, "_rank", lambda: (1, 2))
    with pytest.raises(DataError, match="rank 1: the tokenised data .* is not visible here"):
        load_tokenized(_config(tmp_path, data), tokenizer)  # rank 1 never builds
    assert count_tokenised == [] and barriers == [1]
    monkeypatch.setattr(token_cache, "_rank", lambda: (0, 2))
    built = load_tokenized(_config(tmp_path, data), tokenizer)
    monkeypatch.setattr(token_cache, "_rank", lambda: (1, 2))
    assert _ids(load_tokenized(_config(tmp_path, data), tokenizer)) == _ids(built)
    assert len(count_tokenised) == 6 and barriers == [1, 0, 1]


def test_second_training_run_starts_without_tokenising(tmp_path, count_tokenised):
    """Through the real entry point: `dflash-train` twice on the same data; the second reads the cache."""
    from dflash.config import TrainConfig, from_args
    from dflash.cli import train_parser
    from dflash.train.trainer import train
    from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=16)
    steps = []
    for run in ("a", "b"):
        config = from_args(train_parser().parse_args(train_args(target, data, tmp_path / run, max_steps=1,
                                                                num_proc=1, eval_fraction=0.25)))
        assert isinstance(config, TrainConfig)
        result = train(config, handle_signals=False, on_step=lambda step, m: steps.append((run, step)))
        assert result.step == 1
    assert len(count_tokenised) == 16  # all by the first run; the cache beside --out served the second
    assert steps == [("a", 1), ("b", 1)]
    assert len(list((tmp_path / "tokenized-cache").iterdir())) == 1


def test_the_space_estimate_covers_the_built_cache(tmp_path, tokenizer):
    """cache_space's estimate of a build's peak holds at least the finished cache (its peak holds more: the
    raw records and a second copy of the tokens) and stays within 4 times it."""
    from dflash.data import cache_space

    data = _jsonl(tmp_path / "chat.jsonl", _conversations(200))
    config = _config(tmp_path, data)
    load_tokenized(config, tokenizer)
    built = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
    need, tokens = cache_space.needed_bytes(config, tokenizer)
    assert built < need < 4 * built + (256 << 10)
    assert tokens > 0


@pytest.mark.slow  # three builds of the token cache and a short run (about 30 s; minutes on a loaded machine)
def test_a_full_disk_while_the_cache_is_built_names_the_cache_the_space_and_the_fix(tmp_path, capsys):
    """The token cache on a 4 MiB tmpfs with 256 KiB left; its build needs about 1.1 MiB. It said "writing the
    run's files in <--out> failed ... point --out at a larger one" (the cache is not in --out), or, when the
    disk filled while the records were read, ended in datasets' DatasetGenerationError traceback (exit 1)."""
    from dflash.cli import train_main
    from tests.support.dflash_train_fixtures import drop_run_log_handlers, save_chat_target, train_args, write_chat_jsonl
    from tests.support.small_disk import fill, small_disk

    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=600)
    with small_disk(tmp_path / "disk", "4m") as disk:
        filler = fill(disk, leave=256 << 10)
        cache = disk / "cache"
        argv = train_args(target, data, tmp_path / "run", max_steps=1, data_cache=str(cache))
        code = train_main(argv)
        err = capsys.readouterr().err
        drop_run_log_handlers()
        assert code == 4 and "Traceback" not in err, err[-3000:]
        message = next(line for line in err.splitlines() if "error:" in line)
        for words in (f"the tokenised data cache {cache} ran out of space", "No space left on device",
                      "tokens); that disk had 256.0 KiB free of 4.0 MiB when the build began", "--data-cache DIR",
                      "then run again"):
            assert words in message, message
        need = float(re.search(r"needs about ([\d.]+) MiB there", message)[1])
        assert 0.8 < need < 2, message  # the build of these 600 conversations needs 0.8 to 1.0 MB (measured)
        assert [p.name for p in cache.iterdir()] == []  # nothing a later run could take for a cache
        filler.unlink()  # room again: the next run builds the cache and trains
        assert train_main(argv) == 0
        drop_run_log_handlers()
        assert [p.name for p in cache.iterdir() if (p / "record.json").is_file()] == [
            p.name for p in cache.iterdir()]
        assert "tokenising" in capsys.readouterr().err
