"""Every rank runs the same collectives in training and in evaluation, whatever data it holds
(dflash.batching.shares: a rank that a micro-batch has nothing for runs a zero-weight stand-in), under every layout,
on 2 and 3 gloo processes; and SIGTERM during an evaluation stops the run as it does during a step.

The data leaves ranks out on purpose: the evaluation split is one conversation (one padded batch of one
sequence, or one pack), and the 5 training sequences come in padded batches of 2, 2 and 1 (batch size 2) or in
5 packs of one sequence each (--pack-tokens = --max-length), so the end of every epoch has ranks with nothing.
Before the rule, the padded evaluation skipped the batch on a rank that held none of it: under shard or offload
rank 0 gathered the drafter's layers while rank 1 waited in the sums' all-reduce, and the run hung there.

All the runs are one launch (tests/support/ranks_in_step.py: one interpreter start, the ranks of each world
forked from it): the 3-process runs, the 2-process ones, then the padded ones by one plain process, the numbers a
stand-in must not change. A collective waits at most COLLECTIVE_S seconds and the launch at most LAUNCH_S: a hang
fails the run it happened in (and the rest of its world's, the ranks being out of step) instead of holding up
the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.config.drafters import drafter_out
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[3]
COLLECTIVE_S = 120  # a collective that one rank never reaches fails after this long (gloo's timeout)
LAUNCH_S = 900      # every run of the launch
TOKENS = 96         # every conversation is cut to --max-length 96
OPTS = dict(max_length=TOKENS, batch_size=2, grad_accum=2, max_steps=2, eval_every=2, drafter_dtype="fp32",
            pack_tokens=TOKENS, pack_anchors=16)
TWO_DRAFTERS = '[[drafters]]\nname = "a"\n\n[[drafters]]\nname = "b"\nblock-size = 3\n'

# world -> its runs: (name, options); "drafters": the two drafters above, "eval": False where the layout refuses
# an evaluation during training (pipeline: the target is in stages; its drafter ranks are world - target_stages)
CASES = {
    3: [("shard-padded", dict(layout="shard", packing="off")),
        ("offload-packed", dict(layout="offload", packing="on")),
        ("replicate-two-drafters", dict(layout="replicate", packing="off", drafters=True)),
        ("pipeline-padded", dict(layout="pipeline", packing="off", target_stages=1, eval=False)),
        ("pipeline-packed", dict(layout="pipeline", packing="on", target_stages=1, eval=False))],
    2: [("shard-padded", dict(layout="shard", packing="off")),
        ("shard-packed", dict(layout="shard", packing="on")),
        ("offload-padded", dict(layout="offload", packing="off")),
        ("offload-packed", dict(layout="offload", packing="on")),
        ("replicate-padded", dict(layout="replicate", packing="off")),
        ("replicate-packed", dict(layout="replicate", packing="on")),
        ("shard-two-drafters", dict(layout="shard", packing="off", drafters=True))],
}
ALONE = [("padded", dict(packing="off")), ("two-drafters", dict(packing="off", drafters=True))]  # world 1
SIGTERM_CASE = "shard-sigterm-in-evaluation"  # world 2, after its other runs
# packed: the real packs of each step's two micro-batches, by drafter ranks (5 packs an epoch, one per rank)
PACKS_PER_STEP = {2: [2 + 2, 1 + 2], 3: [3 + 2, 3 + 2]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    sweep = root / "sweep.toml"
    sweep.write_text(TWO_DRAFTERS)
    return {"root": root, "target": save_chat_target(root / "target"), "sweep": sweep,
            "train": write_chat_jsonl(root / "train.jsonl", n=5),
            "one": write_chat_jsonl(root / "one.jsonl", n=1, seed=5),
            "six": write_chat_jsonl(root / "six.jsonl", n=6, seed=6)}


def _argv(files: dict, out: Path, options: dict, eval_data: str = "one") -> list[str]:
    options = dict(options)
    drafters, evaluates = options.pop("drafters", False), options.pop("eval", True)
    flat = {**OPTS, **options}
    if evaluates:
        flat["eval_data"] = files[eval_data]
    else:
        flat.pop("eval_every")
    return train_args(files["target"], files["train"], out, **flat) + (["--config", str(files["sweep"])]
                                                                      if drafters else [])


def _launch(phases: list[dict], root: Path) -> dict[int, dict[int, dict[str, int]]]:
    """The phases' runs, their output in `root`; {world: {rank: {run name: exit code}}} of the runs each rank
    finished."""
    plan = root / "plan.json"
    plan.write_text(json.dumps({"timeout_s": COLLECTIVE_S, "results": str(root), "phases": phases}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(root / "heartbeat")}
    with open(root / "launch.log", "w") as log:
        launch = subprocess.Popen([sys.executable, "-m", "tests.support.ranks_in_step", str(plan)], cwd=REPO,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        launch.wait(timeout=LAUNCH_S)
    except subprocess.TimeoutExpired:
        pass  # the runs it did not finish fail their tests
    finally:
        try:
            os.killpg(launch.pid, signal.SIGKILL)  # the launch and every rank it forked
        except ProcessLookupError:
            pass
        launch.wait()
    done = {}
    for phase in phases:
        world = phase["world"]
        done[world] = {}
        for rank in range(world):
            results = root / f"{world}-{rank}.jsonl"
            lines = results.read_text().splitlines() if results.exists() else []
            done[world][rank] = {r["name"]: r["exit"] for r in map(json.loads, lines)}
    return done


@pytest.fixture(scope="module")
def launched(files):
    """(the runs' folder, {world: {rank: {run name: exit code}}}): every world's runs, and the padded ones by one
    plain process."""
    root = files["root"] / "runs"
    phases = [{"world": world, "runs": [{"name": name, "argv": _argv(files, root / str(world) / name, options)}
                                        for name, options in cases]} for world, cases in CASES.items()]
    phases[1]["runs"].append({"name": SIGTERM_CASE, "sigterm_rank": 1, "exit": {"0": 143, "1": 143}, "argv": _argv(
        files, root / "2" / SIGTERM_CASE, dict(layout="shard", packing="off", max_steps=4), eval_data="six")})
    phases.append({"world": 1, "runs": [{"name": name, "argv": _argv(files, root / "1" / name, options)}
                                        for name, options in ALONE]})
    for world in CASES.keys() | {1}:
        (root / str(world)).mkdir(parents=True)
    return root, _launch(phases, root)


def _logs(root: Path, world: int) -> str:
    return "\n".join(f"--- rank {r}\n" + (root / f"{world}-{r}.log").read_text()[-3000:]
                     for r in range(world) if (root / f"{world}-{r}.log").exists()) + \
        "\n--- launch\n" + (root / "launch.log").read_text()[-2000:]


def _finished(launched, world: int, name: str) -> Path:
    """The run's --out, once every rank of `world` finished it with exit 0."""
    folder, done = launched
    for rank, exits in done[world].items():
        assert name in exits, f"rank {rank} of {world} did not finish {name}: a hang?\n{_logs(folder, world)}"
        assert exits[name] == 0, f"rank {rank} of {world}: {name} exit {exits[name]}\n{_logs(folder, world)}"
    return folder / str(world) / name


def _outs(out: Path, options: dict) -> list[Path]:
    return [drafter_out(out, d) for d in ("a", "b")] if options.get("drafters") else [out]


def _same_numbers(mine: list[dict], one: list[dict]) -> None:
    assert [(m["split"], m["step"]) for m in mine] == [(m["split"], m["step"]) for m in one]
    for a, b in zip(mine, one):
        assert (a["tokens"], a["anchors"]) == (b["tokens"], b["anchors"]), (a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["accept_per_pos"] == pytest.approx(b["accept_per_pos"], abs=1e-4)


def test_a_rank_that_a_micro_batch_has_nothing_for_gets_a_zero_weight_stand_in():
    """The one rule, padded and packed: the first rank's share with its loss mask zeroed, whose sums count
    nothing."""
    import torch

    from dflash import distributed
    from dflash.batching.shares import packed_share, padded_share

    items = [{"input_ids": torch.arange(5) + i, "loss_mask": torch.ones(5, dtype=torch.long)} for i in range(6)]

    def at(rank: int):
        return distributed.Dist(rank=rank, world_size=3, local_rank=rank, device=torch.device("cpu"))

    assert [(s.indices, s.stand_in) for s in (padded_share([4, 5], items, at(r)) for r in range(3))] == \
        [([4], False), ([5], False), ([4], True)]
    assert [(s.indices, s.stand_in) for s in (packed_share([[0, 1], [2]], items, at(r)) for r in range(3))] == \
        [([0, 1], False), ([2], False), ([0, 1], True)]
    for share in (padded_share([4, 5], items, at(2)), packed_share([[0, 1], [2]], items, at(2))):
        assert all(torch.equal(c["input_ids"], items[i]["input_ids"]) for c, i in zip(share.items, share.indices))
        assert all(not c["loss_mask"].any() for c in share.items)
        assert not share.counted(torch.ones(8)).any()
    assert items[4]["loss_mask"].all()  # the copies' masks are their own
    real = padded_share([4, 5], items, at(0))
    assert real.items[0] is items[4] and torch.equal(real.counted(torch.ones(8)), torch.ones(8))


@pytest.mark.slow  # the first test launches every run: 3 gloo processes, about 2 min on a loaded 2-core machine
@pytest.mark.parametrize("world, name, options", [(w, n, o) for w, cases in CASES.items() for n, o in cases],
                         ids=[f"{w}-{n}" for w, cases in CASES.items() for n, _o in cases])
def test_every_rank_runs_every_micro_batch_of_training_and_evaluation(launched, world, name, options):
    out = _finished(launched, world, name)
    evaluates = options.get("eval", True)
    for mine in _outs(out, options):
        records = read_metrics(mine)
        assert [(m["split"], m["step"]) for m in records] == [("train", 1), ("train", 2)] + ([("eval", 2)] if evaluates else [])
        assert (RunDir(mine).drafter / "model.safetensors").is_file()
        for m in records[2:]:  # the one sequence, counted once: the other ranks' stand-ins add nothing
            assert m["sequences"] == 1 and m["tokens"] == TOKENS and m["anchors"] > 0
    if options["packing"] == "on":  # no stand-in's tokens among the step's
        trained = [m["tokens"] for m in read_metrics(out) if m["split"] == "train"]
        assert trained == [TOKENS * packs for packs in PACKS_PER_STEP[world - options.get("target_stages", 0)]]
    elif evaluates:  # padded: the numbers of one process on the same global batches
        one = _finished(launched, 1, "two-drafters" if options.get("drafters") else "padded")
        for mine, reference in zip(_outs(out, options), _outs(one, options)):
            _same_numbers(read_metrics(mine), read_metrics(reference))


@pytest.mark.slow  # a run of the launch above
def test_sigterm_during_an_evaluation_stops_the_run_as_during_a_step(launched):
    """Rank 1 takes SIGTERM in the first micro-batch of the step-2 evaluation (3 micro-batches of 2 sequences):
    every rank ends the evaluation before the next one and writes no record of it, checkpoints step 2 and stops,
    every rank with exit 143 (rank 0 exited 0: a stop by another rank's signal), as after a signal during a step."""
    folder, done = launched
    exits = {rank: runs.get(SIGTERM_CASE) for rank, runs in done[2].items()}
    assert exits == {0: 143, 1: 143}, f"{exits}\n{_logs(folder, 2)}"
    out = folder / "2" / SIGTERM_CASE
    assert [(m["split"], m["step"]) for m in read_metrics(out)] == [("train", 1), ("train", 2)]
    assert ckpt.read_latest(RunDir(out).checkpoints) == ckpt.step_dir_name(2)
    assert not RunDir(out).drafter.exists()
    log = RunDir(out).log.read_text()
    assert "evaluation stopped by SIGTERM received by another rank after 1 of its micro-batches" in log, log[-3000:]
    assert "stopped by SIGTERM received by another rank at step 2; continue with --resume" in log
