"""Losslessness is judged honestly: an output that first differs from greedy decoding where the target's two best
logits are within its dtype's rounding is a near-tie (counted, exit 0); one that differs at a clear margin is
not lossless (exit 1). The rule on synthetic logits, then end to end through evaluate and dflash-eval with a
test double that makes the verify pass and one-token decoding round a near-tie differently, as bf16 does."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.cli import eval_main
from dflash.decode.evaluate import evaluate_baseline, format_results, untrained_drafter
from dflash.decode.lossless import NEAR_TIE_ULPS, DivergenceWatch, judge_divergence, near_tie_tolerance
from dflash.io.drafter_dir import save_drafter
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target
from tests.support.dflash_train_fixtures import save_chat_target, write_chat_jsonl

BS, NEW = 4, 8
REAL_LM_HEAD = Target.lm_head  # what the doubles below wrap, whichever of them is installed


def _logits(top: float, runner_up: float, vocab: int = 10) -> torch.Tensor:
    logits = torch.linspace(-5.0, 0.0, vocab)
    logits[3], logits[7] = top, runner_up
    return logits


# ---- the rule ------------------------------------------------------------------------------------------
def test_the_tolerance_is_a_few_ulps_of_the_top_logit():
    assert NEAR_TIE_ULPS == 4
    assert near_tie_tolerance(20.0, torch.bfloat16) == 0.5          # ulp(20) in bf16 = 16 * 2^-7 = 0.125
    assert near_tie_tolerance(-20.0, torch.bfloat16) == 0.5
    assert near_tie_tolerance(0.3, torch.bfloat16) == 4 * 2.0 ** -7  # |top| < 1 counts as 1
    assert near_tie_tolerance(20.0, torch.float32) == 4 * 16 * 2.0 ** -23


@pytest.mark.parametrize("runner_up, dtype, near_tie", [
    (20.0, torch.bfloat16, True),          # an exact tie
    (19.875, torch.bfloat16, True),        # 1 bf16 ulp
    (19.5, torch.bfloat16, True),          # 4 ulps: the tolerance itself
    (19.375, torch.bfloat16, False),       # 5 ulps
    (19.0, torch.bfloat16, False),
    (20.0 - 2 * 16 * 2.0 ** -23, torch.float32, True),   # 2 float32 ulps
    (19.875, torch.float32, False),        # a bf16 near-tie is a failure in float32: CPU runs stay strict
])
def test_a_divergence_below_the_tolerance_is_a_near_tie_above_it_a_failure(runner_up, dtype, near_tie):
    verdict = judge_divergence(_logits(20.0, runner_up), greedy_token=3, spec_token=7, dtype=dtype)
    assert verdict["near_tie"] is near_tie
    assert verdict["margin"] == pytest.approx(20.0 - runner_up, abs=1e-12)
    assert verdict["tolerance"] == near_tie_tolerance(20.0, dtype)


def test_the_margin_is_to_the_token_speculative_decoding_emitted():
    """A token ranked below the runner-up is judged by its own (larger) gap, not the top-2 margin."""
    logits = _logits(20.0, 19.9)
    logits[5] = 18.0
    assert judge_divergence(logits, 3, 7, torch.bfloat16)["near_tie"] is True
    assert judge_divergence(logits, 3, 5, torch.bfloat16) == {"margin": 2.0, "tolerance": 0.5, "near_tie": False}


def test_the_watch_judges_only_the_first_difference():
    watch = DivergenceWatch([4, 7, 6], torch.bfloat16)
    watch(0, 4, _logits(20.0, 10.0))
    watch(1, 3, _logits(20.0, 19.875))          # greedy picks 3 where speculative decoding emitted 7 ...
    watch(2, 3, _logits(20.0, 0.0))             # ... and from there the prefixes differ: not judged
    assert watch.finish([4, 3, 3]) == {"position": 1, "greedy_token": 3, "spec_token": 7, "margin": 0.125,
                                       "tolerance": 0.5, "near_tie": True}
    same = DivergenceWatch([4, 5])
    same(0, 4, _logits(1.0, 0.0))
    assert same.finish([4, 5]) is None
    ended = DivergenceWatch([4, 5, 6]).finish([4, 5])  # greedy stopped first: nothing to judge, not a tie
    assert ended["position"] == 2 and ended["spec_token"] == 6 and ended["near_tie"] is False


def test_the_table_says_near_ties_and_failures():
    tie = {"prompt": 1, "position": 4, "greedy_token": 10, "spec_token": 11, "margin": 0.125, "tolerance": 0.5,
           "near_tie": True}
    row = {"tau": 1.5, "tokens_per_s": 10.0, "cache": "on", "temperature": 0.0}
    text = format_results({"untrained drafter": {**row, "lossless": True, "near_ties": 1, "divergences": [tie]},
                           "drafter": {**row, "lossless": False, "near_ties": 0, "divergences": [
                               {**tie, "margin": 3.0, "near_tie": False}]}})
    assert "True (1 near-tie)" in text and " False" in text
    assert "untrained drafter: prompt 1, new token 4: greedy 10, speculative 11, logit margin 0.125 <= tolerance " \
           "0.5: near-tie\n" in text
    assert "\ndrafter: prompt 1, new token 4: greedy 10, speculative 11, logit margin 3 > tolerance 0.5: " \
           "NOT lossless" in text
    assert "(near-tie: the greedy token's logit is at most 4 ulps of the top logit" in text


# ---- end to end, through a test double --------------------------------------------------------------------
def rounding_by_shape_double(gap):
    """Test double for Target.lm_head: the real head, then in every row the runner-up logit moved `gap(top)`
    below the top one in a one-row call (greedy decoding's forward, the prefill) and `gap(top)` above it in a
    multi-row call (a verify pass). So the argmax flips between the block pass and one-token decoding, the way
    kernels of different shapes round a bf16 near-tie differently; the margin greedy decoding sees is `gap`."""
    def lm_head(self, hidden):
        logits = REAL_LM_HEAD(self, hidden)
        rows = logits.reshape(-1, logits.shape[-1]).clone()
        best = rows.topk(2, dim=-1)
        gaps = torch.tensor([[gap(float(t))] for t in best.values[:, 0]], dtype=rows.dtype)
        sign = 1.0 if rows.shape[0] > 1 else -1.0
        rows.scatter_(1, best.indices[:, 1:], best.values[:, :1] + sign * gaps)
        return rows.reshape(logits.shape)

    return lm_head


def within_rounding(top: float) -> float:
    return near_tie_tolerance(top, torch.float32) / 2     # 2 float32 ulps: a near-tie


def clear_margin(top: float) -> float:
    return 1.0                                             # a wrong token, far beyond any rounding


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return Target.load(save_tiny_target(tmp_path_factory.mktemp("near-tie-target"), "qwen3_5"))


def _prompts():
    return torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_evaluate_counts_a_near_tie_and_fails_a_clear_divergence(hybrid, monkeypatch, use_cache):
    plain = evaluate_baseline(hybrid, _prompts(), NEW, "repeat_last", block_size=BS, stop_token_ids=[],
                              use_cache=use_cache)
    assert plain["lossless"] is True and plain["near_ties"] == 0 and plain["divergences"] == []

    monkeypatch.setattr(Target, "lm_head", rounding_by_shape_double(within_rounding))
    tied = evaluate_baseline(hybrid, _prompts(), NEW, "repeat_last", block_size=BS, stop_token_ids=[],
                             use_cache=use_cache)
    assert tied["lossless"] is True and tied["near_ties"] == 2 and tied["mismatched_prompts"] == [0, 1]
    for d in tied["divergences"]:  # the prefill's token agrees; the first verified one flips
        assert d["position"] == 1 and d["near_tie"] and 0 < d["margin"] <= d["tolerance"] < 1e-4

    monkeypatch.setattr(Target, "lm_head", rounding_by_shape_double(clear_margin))
    wrong = evaluate_baseline(hybrid, _prompts(), NEW, "repeat_last", block_size=BS, stop_token_ids=[],
                              use_cache=use_cache)
    assert wrong["lossless"] is False and wrong["near_ties"] == 0 and wrong["mismatched_prompts"] == [0, 1]
    assert all(d["margin"] == pytest.approx(1.0) and not d["near_tie"] for d in wrong["divergences"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("near-tie-eval")
    target_dir = save_chat_target(root / "target")
    save_drafter(untrained_drafter(Target.load(target_dir), block_size=BS, num_hidden_layers=1), root / "drafter",
                 dtype=None)
    return ["--target", str(target_dir), "--drafter", str(root / "drafter"),
            "--data", str(write_chat_jsonl(root / "chat.jsonl", n=4)), "--limit", "2", "--max-new-tokens", "6",
            "--device", "cpu"]


def test_dflash_eval_exits_0_on_near_ties_and_shows_them(tiny, monkeypatch, capsys):
    monkeypatch.setattr(Target, "lm_head", rounding_by_shape_double(within_rounding))
    assert eval_main(tiny) == 0                                     # the drafter and both baselines
    text = capsys.readouterr().out
    for method in ("drafter", "untrained drafter", "repeat last token"):
        assert any(line.startswith(method) and line.endswith("True (2 near-ties)") for line in text.splitlines())
    assert text.count(": near-tie\n") == 6 and "not a decoding error" in text
    assert eval_main([*tiny, "--no-baselines", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["drafter"]
    assert report["lossless"] is True and report["near_ties"] == 2 and report["target_dtype"] == "float32"
    assert [d["near_tie"] for d in report["divergences"]] == [True, True]


def test_dflash_eval_exits_1_on_a_clear_divergence(tiny, monkeypatch, capsys):
    monkeypatch.setattr(Target, "lm_head", rounding_by_shape_double(clear_margin))
    assert eval_main([*tiny, "--no-baselines"]) == 1
    text = capsys.readouterr().out
    assert any(line.startswith("drafter") and line.endswith(" False") for line in text.splitlines())
    assert text.count(": NOT lossless") == 2 and "near-tie" not in text
    assert eval_main([*tiny, "--no-baselines", "--json", "--no-cache"]) == 1
    report = json.loads(capsys.readouterr().out)["drafter"]
    assert report["lossless"] is False and report["near_ties"] == 0 and len(report["divergences"]) == 2
