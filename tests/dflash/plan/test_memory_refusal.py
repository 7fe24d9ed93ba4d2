"""Training refuses, before the target's weights load, a layout and micro-batch the memory model says will
not fit the card, and names what would; --no-memory-check starts anyway. On the CPU the card is a stand-in
passed through train()'s `card_gb_for_tests` seam (a CPU run is otherwise never checked)."""

from __future__ import annotations

import pytest

from dflash.cli import train_config
from dflash.errors import TrainError
from dflash.plan.memory import MicroBatch
from dflash.plan.planner import check_training_fits, option, run_shapes
from dflash.plan.throughput import CARDS
from dflash.train.records.rundir import RunDir
from dflash.train.trainer import train
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusal")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=24)


def _peak_gb(config, mb: MicroBatch) -> float:
    target, drafter, _ = run_shapes(config, config.io.target)
    return option(target, drafter, mb, "replicate", 1, CARDS["h200"]).peak_gb


def test_a_run_that_does_not_fit_is_refused_naming_what_fits(tiny, tmp_path):
    target, data = tiny
    config = train_config(train_args(target, data, tmp_path / "run", max_anchors=8, max_steps=1))
    full = _peak_gb(config, MicroBatch(4, 96, 8))   # --batch-size 4, --max-length 96, --max-anchors 8
    half = _peak_gb(config, MicroBatch(4, 96, 4))
    assert half < full
    card = (full + half) / 2                         # fits 4 anchors per sequence, not 8
    with pytest.raises(TrainError) as exc:
        train(config, handle_signals=False, card_gb_for_tests=card)
    message = str(exc.value)
    assert message.startswith("--layout replicate will not fit: a micro-batch of 4 x 96, 8 anchors/seq needs")
    assert "--max-anchors 4" in message and "--no-memory-check" in message
    assert not RunDir(tmp_path / "run").metrics.exists() or not RunDir(tmp_path / "run").metrics.read_text()

    unchecked = train_config(train_args(target, data, tmp_path / "forced", max_anchors=8, max_steps=1)
                             + ["--no-memory-check"])
    result = train(unchecked, handle_signals=False, card_gb_for_tests=card)
    assert result.step == 1


def test_a_run_that_fits_starts_and_a_cpu_run_is_not_checked(tiny, tmp_path):
    target, data = tiny
    config = train_config(train_args(target, data, tmp_path / "run", max_steps=1))
    check_training_fits(config, 1, card_gb=1000.0)   # fits: no error
    check_training_fits(config, 1, card_gb=None)     # a CPU: no check
    with pytest.raises(TrainError, match="no layout fits 1 card"):
        check_training_fits(config, 1, card_gb=0.1)  # below the CUDA context alone


def test_the_checked_micro_batch_is_each_ranks_share(tiny, tmp_path):
    """--batch-size is summed over the ranks: 4 sequences on 2 ranks is 2 per rank (and --max-tokens caps
    it); the message names the layout the run asked for."""
    target, data = tiny
    config = train_config(train_args(target, data, tmp_path / "run", batch_size=4, max_tokens=512, max_length=96,
                                     max_anchors=8))
    with pytest.raises(TrainError, match=r"--layout shard will not fit: a micro-batch of 2 x 96, 8 anchors/seq"):
        check_training_fits(config, 2, card_gb=0.1, layout="shard")
    tight = train_config(train_args(target, data, tmp_path / "run", batch_size=4, max_tokens=192, max_length=96,
                                    max_anchors=8))
    with pytest.raises(TrainError, match=r"a micro-batch of 1 x 96, 8 anchors/seq"):
        check_training_fits(tight, 2, card_gb=0.1, layout="shard")


def test_padded_batches_are_checked_at_the_many_short_sequences_too(tiny, tmp_path):
    """Anchors are bounded per sequence: --batch-size short sequences carry more drafter rows than the few long
    ones that fill --max-tokens. The check takes both; a card between their peaks is refused, naming the short."""
    from dflash.batching import batching_for
    from dflash.plan.planner import worst_micro_batches

    target, data = tiny
    config = train_config(train_args(target, data, tmp_path / "run", batch_size=8, max_tokens=192, max_length=96,
                                     max_anchors=40, packing="off"))
    padded = batching_for(config, "cpu")
    long, short = worst_micro_batches(padded, 1)
    assert (long.batch, long.seq_len, short.batch, short.seq_len) == (2, 96, 8, 24)
    assert short.batch * short.anchors > long.batch * long.anchors
    card = (_peak_gb(config, long) + _peak_gb(config, short)) / 2
    assert _peak_gb(config, long) < card < _peak_gb(config, short)
    with pytest.raises(TrainError, match=r"a micro-batch of 8 x 24, 23 anchors/seq"):
        check_training_fits(config, 1, card, batching=padded)


def test_no_padded_micro_batch_the_data_order_forms_exceeds_what_was_checked(tmp_path):
    """Every micro-batch of an epoch, over many length mixes: its drafter rows (anchors) and padded tokens stay
    within the largest of the checked micro-batches."""
    from hypothesis import given, settings, strategies as st

    from dflash.batching import batching_for
    from dflash.config import TrainConfig
    from dflash.data.batches import make_batches
    from dflash.plan.planner import worst_micro_batches

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(8, 96), min_size=1, max_size=120), st.integers(1, 12), st.integers(96, 600),
           st.integers(1, 60), st.integers(1, 3))
    def check(lengths, batch_size, max_tokens, max_anchors, world):
        config = TrainConfig.from_flat(max_length=96, max_tokens=max_tokens, batch_size=batch_size,
                                       max_anchors=max_anchors, block_size=4, packing="off")
        checked = worst_micro_batches(batching_for(config, "cpu"), world)
        rows = max(m.batch * m.anchors for m in checked)
        tokens = max(m.batch * m.seq_len for m in checked)
        for batch in make_batches(lengths, max_tokens, batch_size, seed=0, epoch=0):
            for share in (batch[r::world] for r in range(world)):
                if share:
                    assert sum(min(max_anchors, lengths[i] - 1) for i in share) <= rows
                    assert len(share) * max(lengths[i] for i in share) <= tokens

    check()
