"""A DFlash2 drafter trained by dflash-train decodes losslessly at temperature 0, proposing the selector's
greedy walk; at temperature 1 its sampled walk, verified against the realized rows, emits the target's
distribution; its cached context computes what its uncached forward computes."""

import json

import pytest
import torch

from dflash.cli import train_main
from dflash.errors import ConfigError
from dflash.decode.evaluate import DrafterProposer, Sampler, evaluate, load_for_eval
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Drafter
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    target, data = save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=8)
    argv = train_args(target, data, root / "run", max_steps=3, target_layer_ids="0,1,2", drafter_layers=2,
                      sliding_window=3, drafter_kind="dflash2")
    assert train_main(argv) == 0
    return root


def test_a_trained_dflash2_drafter_decodes_exactly_the_greedy_output(run):
    target, drafter = load_for_eval(run / "target", run / "run" / "drafter")
    assert isinstance(drafter, DFlash2Drafter)
    prompts = [[5, 9, 12, 40, 41], [7, 7, 8, 50, 51, 52]]
    result = evaluate(target, drafter, prompts, 16)
    assert result["lossless"] is True and result["mismatched_prompts"] == []
    assert 1.0 <= result["tau"] <= drafter.config.block_size


def test_the_cached_context_equals_the_uncached_forward(run):
    target, drafter = load_for_eval(run / "target", run / "run" / "drafter")
    tokens = [5, 9, 12, 40, 41, 42, 43]
    context = target.context(torch.tensor([tokens]))
    cached, uncached = DrafterProposer(drafter, incremental=True), DrafterProposer(drafter, incremental=False)
    for cut in (4, 6):
        new = context[:, (0 if cut == 4 else 4):cut]
        a = cached.propose(target, tokens[:cut + 1], new, Sampler()).tokens
        b = uncached.propose(target, tokens[:cut + 1], new, Sampler()).tokens
        assert a == b


def test_init_drafter_of_the_other_kind_is_refused(run, tmp_path, capsys):
    argv = train_args(run / "target", run / "chat.jsonl", tmp_path / "again", max_steps=1,
                      init_drafter=run / "run" / "drafter", drafter_layers=2)
    assert train_main(argv) == ConfigError.exit_code
    assert "is a dflash2 drafter and --drafter-kind is dflash; pass --drafter-kind dflash2" in capsys.readouterr().err


def test_sampling_with_a_dflash2_drafter_emits_the_target_distribution(tmp_path):
    """The second generated token of many seeded runs at temperature 1 (the first one a draft supplies)
    against the target's exact marginal, with a DFlash2 drafter whose selector is far from a no-op: the
    whole loop (sampled walk, its q, the acceptance rule, the caches). 300 runs detect gross errors only;
    the next test is the sharp check of the q the walk reports."""
    from dflash.decode.evaluate import speculative_generate, untrained_drafter
    from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config
    from dflash.model.target import Target
    from tests.dflash.decode.test_spec_sampling import ALPHA, chi_square_p
    from tests.support.dflash_tiny import save_tiny_target

    target = Target.load(save_tiny_target(tmp_path / "hybrid", "qwen3_5"))
    drafter = untrained_drafter(target, DFlash2Config.from_target(target, block_size=4, num_hidden_layers=1,
                                                                  selector_rank=8, selector_top_k=6))
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        last, _ = target.forward_cached(torch.tensor([prompt]))
        p1 = torch.softmax(target.lm_head(last[0, -1]).float(), -1)
        last, _ = target.forward_cached(torch.tensor([prompt + [t] for t in range(target.vocab_size)]))
        p2 = p1 @ torch.softmax(target.lm_head(last[:, -1]).float(), -1)
    proposer = DrafterProposer(drafter)
    seconds = []
    for seed in range(300):
        proposer.begin()
        sampler = Sampler(1.0, torch.Generator().manual_seed(seed))
        seconds.append(speculative_generate(target, proposer, prompt, 2, use_cache=True, sampler=sampler).tokens[1])
    assert chi_square_p(seconds, p2) > ALPHA


def test_the_sampled_walk_draws_from_the_q_it_reports(tmp_path):
    """What makes sampling lossless: each draft token is drawn from the q handed to the acceptance rule
    (tests/dflash/decode/test_spec_sampling.py proves the rule exact for any q): slot 1 against its q, and
    slot 2 against the q of the row after slot 1's most frequent pick."""
    from collections import Counter

    from dflash.decode.evaluate import untrained_drafter
    from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config
    from dflash.model.target import Target
    from tests.dflash.decode.test_spec_sampling import ALPHA, chi_square_p
    from tests.support.dflash_tiny import save_tiny_target

    target = Target.load(save_tiny_target(tmp_path / "t", "qwen3"))
    drafter = untrained_drafter(target, DFlash2Config.from_target(target, block_size=4, num_hidden_layers=1,
                                                                  selector_rank=8, selector_top_k=6))
    sel = drafter.candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 3.0, generator=torch.Generator().manual_seed(1))
        sel.predecessor_codebook.normal_(0, 3.0, generator=torch.Generator().manual_seed(2))
        hidden = torch.randn(1, 3, drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
        draws = [drafter.propose_sampled(hidden, torch.tensor([9]), target.lm_head, 0.7,
                                         torch.Generator().manual_seed(s)) for s in range(600)]
    firsts = [int(t[0]) for t, _ in draws]
    q1 = draws[0][1][0]
    assert all(torch.equal(q[0], q1) for _, q in draws) and q1.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert (q1 > 0).sum() == 6 and chi_square_p(firsts, q1) > ALPHA
    common = Counter(firsts).most_common(1)[0][0]
    group = [(t, q) for t, q in draws if int(t[0]) == common]
    assert chi_square_p([int(t[1]) for t, _ in group], group[0][1][1]) > ALPHA
    assert sorted(set(firsts)) != [common]  # the walk did branch: slot 2's q depends on slot 1's pick
    assert any(not torch.equal(q[1], group[0][1][1]) for t, q in draws if int(t[0]) != common)


def test_dflash_eval_compares_a_dflash_and_a_dflash2_drafter_on_the_same_prompts(run, capsys):
    from dflash.cli import eval_main

    first = run / "dflash"
    argv = train_args(run / "target", run / "chat.jsonl", first, max_steps=1, target_layer_ids="0,1,2",
                      drafter_layers=2, sliding_window=3)
    assert train_main(argv) == 0
    capsys.readouterr()
    assert eval_main(["--target", str(run / "target"), "--drafter", str(first / "drafter"),
                      "--compare", str(run / "run" / "drafter"), "--data", str(run / "chat.jsonl"), "--limit", "2",
                      "--max-new-tokens", "8", "--no-baselines", "--device", "cpu", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert list(results) == ["drafter", "dflash2 drafter"]
    for r in results.values():
        assert r["lossless"] is True and len(r["accept_per_pos"]) == 3 and r["n_prompts"] == 2


def test_two_drafters_of_one_kind_get_a_row_each(run, capsys):
    """Two drafter/ directories of one kind (here one given twice) keep a row each: the second is named by its
    path (they were keyed by kind and directory name, so one row replaced the other)."""
    from dflash.cli import eval_main

    second = run / "second"
    assert train_main(train_args(run / "target", run / "chat.jsonl", second, max_steps=1, target_layer_ids="0,1,2",
                                 drafter_layers=2, sliding_window=3)) == 0
    capsys.readouterr()
    same = str(second / "drafter")
    assert eval_main(["--target", str(run / "target"), "--drafter", str(run / "run" / "drafter"), "--compare", same,
                      "--compare", str(run / "run" / "drafter"), "--compare", same, "--data", str(run / "chat.jsonl"),
                      "--limit", "1", "--max-new-tokens", "4", "--no-baselines", "--device", "cpu", "--json"]) == 0
    rows = list(json.loads(capsys.readouterr().out))
    assert len(rows) == 4 and len(set(rows)) == 4, rows
    assert rows == ["drafter", "dflash drafter", "dflash2 drafter", f"dflash {same}"]  # the last was keyed away
