"""Several drafters from one pass over the data: one target forward per micro-batch, its tapped states fed
to every drafter.

    dflash-train --config sweep.toml          (a `drafters` list: dflash.config.drafters)

Each drafter is a Lane (dflash.train.lane) of its own config, run directory (<out>/drafters/NAME:
config.json, metrics.jsonl, checkpoints/, drafter/, report/), optimizer, LR schedule, metrics and, under
torchrun, its own DDP or FSDP2 wrapper; the loop that drives them is the one a single drafter trains in
(dflash.train.loop). This module sets such a run up: every drafter's options checked, their tapped layers
(the target pass taps the union: dflash.train.taps), the memory they need, the target and data loaded once.
<out> holds the run's config.json and train.log; <out>/drafters/drafters.json lists the drafters for
--resume, which resumes them all from their own latest checkpoints (they must all be at the same step).

Memory: `drafter_state_bytes` is what one drafter's training state takes (fp32 weights, gradients and
AdamW's two moments); `check_drafters_fit` refuses a run whose drafters and target would not fit on
the GPU before any weights load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable

import torch

from dflash.config import TrainConfig
from dflash.config.drafters import DrafterSpec, drafter_configs, write_plan
from dflash.data.batches import load_items
from dflash.errors import SAID_BY_RANK_0, ConfigError, DflashError
from dflash.model.dflash2 import dflash2_extra_params
from dflash.train import layouts, pipeline
from dflash.train.evaluation import eval_split
from dflash.train.monitor import claimed_run
from dflash.train.precheck import check_before_loading, check_resume_checkpoint
from dflash.train.rundir import RunDir
from dflash.train.signals import StopFlag
from dflash.train.taps import tapped_layers, union
from dflash.train.setup import attention_impl, load_target
from dflash.train.loop import LoopResult, TrainingLoop
from dflash.train.trainer import known_fault

log = logging.getLogger("dflash.train")


# --- memory ----------------------------------------------------------------------------------------
def drafter_state_bytes(n_params: int) -> int:
    """Bytes one drafter's training state takes: fp32 master weights, fp32 gradients, AdamW's two fp32
    moments (16 bytes per parameter). Activations are not counted (they follow the micro-batch)."""
    return 16 * n_params


def drafter_param_count(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                        layers: int, tapped: int) -> int:
    """Parameters of a drafter (dflash.model.drafter) of this shape: fc over the tapped states, its norms,
    and per layer q/k/v/o with q/k norms, two RMSNorms and a SwiGLU MLP."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return tapped * hidden * hidden + 2 * hidden + layers * per_layer


# Share of the GPU kept for activations, the tapped states and the allocator's slack. Measured on one H200 at
# the 27B shape (2 x 4096 tokens, 512 anchors per sequence): one 5-layer drafter peaked 19 GB above its state
# and the target; three such drafters (142 GB of states and target on a 150 GB card) ran out of memory.
ACTIVATION_RESERVE = 0.10


def check_drafters_fit(drafter_params: dict[str, int], target_bytes: int, device_bytes: int) -> None:
    """Refuse drafters whose training states would not fit on the device beside the target's weights,
    ACTIVATION_RESERVE of the device kept free."""
    states = {name: drafter_state_bytes(n) for name, n in drafter_params.items()}
    need = target_bytes + sum(states.values())
    if need <= device_bytes * (1 - ACTIVATION_RESERVE):
        return
    gb = 1e9
    each = ", ".join(f"{name} {b / gb:.1f}" for name, b in states.items())
    raise ConfigError(
        f"{len(states)} drafters do not fit beside the target: their states (fp32 weights, gradients and AdamW "
        f"moments: {each} GB) and the target's weights ({target_bytes / gb:.1f} GB) need {need / gb:.1f} GB "
        f"before any activation, over {1 - ACTIVATION_RESERVE:.0%} of the GPU's {device_bytes / gb:.1f} GB (the rest is "
        "kept for activations). Train fewer drafters per run, or smaller ones (--drafter-layers).")


def _target_bytes_and_shape(config: TrainConfig, target) -> tuple[int, dict]:
    """(the target's weight bytes as the run holds them, its attention shape), without loading it when
    `target` is None (from its config.json and the sizes of its weight files)."""
    if target is not None:
        c = target.config
        n = sum(p.numel() * p.element_size() for p in target.model.parameters()) if hasattr(target, "model") else 0
        return n, dict(hidden=target.hidden_size, layers=target.num_layers, config=c)
    from dflash.model.target import read_target_config, resolve_target

    path = resolve_target(config.io.target)
    text = read_target_config(path).get_text_config()
    files = sum(f.stat().st_size for f in path.glob("*.safetensors")) or sum(f.stat().st_size for f in path.glob("*.bin"))
    return files, dict(hidden=int(text.hidden_size), layers=int(text.num_hidden_layers), config=text)


def check_memory(configs: dict[str, TrainConfig], target, device: torch.device, tapped: dict[str, int]) -> None:
    """`check_drafters_fit` for these drafters (`tapped`: each one's count of tapped target layers) on `device`
    (a GPU; a CPU run is left to the host's memory)."""
    if device.type != "cuda":
        return
    first = next(iter(configs.values()))
    target_bytes, shape = _target_bytes_and_shape(first, target)
    c, hidden = shape["config"], shape["hidden"]
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    params = {name: drafter_param_count(hidden, heads, kv, head_dim, int(c.intermediate_size),
                                        cfg.model.drafter_layers, tapped[name])
              + (dflash2_extra_params(hidden, int(c.vocab_size), cfg.model.drafter_layers)
                 if cfg.model.drafter_kind == "dflash2" else 0) for name, cfg in configs.items()}
    check_drafters_fit(params, target_bytes, torch.cuda.get_device_properties(device).total_memory)


def _drafter_layers(config: TrainConfig, configs: dict[str, TrainConfig], target) -> dict[str, list[int]]:
    """Each drafter's tapped target layers, checked against the target's config.json (or the `target` given)
    before any weight loads."""
    if target is not None:
        return tapped_layers(configs, target.num_layers, loaded=target.layer_ids)
    from dflash.io.fit import target_shape
    from dflash.train.precheck import check_target_cheaply

    for name, cfg in configs.items():  # a drafter's own layers: in range, and ones the serving engines tap
        if cfg.model.target_layer_ids != config.model.target_layer_ids:
            try:
                check_target_cheaply(cfg)
            except DflashError as exc:
                raise type(exc)(f"drafter '{name}': {exc}") from None
    if config.model.init_drafter:  # its config.json fixes the layers of every drafter
        from dflash.io.drafter import read_drafter_config

        return {name: list(read_drafter_config(config.model.init_drafter).target_layer_ids) for name in configs}
    return tapped_layers(configs, target_shape(config.io.target).num_layers)


def train_multi(config: TrainConfig, specs: list[DrafterSpec], *, target=None, items: list[dict] | None = None,
                on_step: Callable[[int, dict], bool] | None = None, handle_signals: bool = True) -> LoopResult:
    """Train the drafters `specs` names on one pass of `config`'s target and data (as train() does one).
    `on_step(step, {name: metrics})` may return True to stop the run as SIGTERM would."""
    configs = drafter_configs(config, specs)  # every drafter's options checked before anything else
    layouts.check_layout(config)  # before any process group or weight
    with layouts.joined(config) as d, claimed_run(config, d) as run:
        stop = StopFlag().install() if handle_signals else StopFlag()
        trainer = None
        try:
            for cfg in configs.values():
                attention_impl(cfg, d.device)
            # the run's own checkpoints are its drafters': each is checked below
            check_before_loading(config.replace(resume=False), data=items is None, target=target is None)
            for cfg in configs.values():
                check_resume_checkpoint(cfg)
            layers = _drafter_layers(config, configs, target)
            check_memory(configs, target, d.device, {name: len(ids) for name, ids in layers.items()})
            tapping = config.replace(target_layer_ids=union(layers)) if not config.model.init_drafter else config
            if config.layout.target_in_stages:  # the stage ranks tap every drafter's layers and serve them all
                target, d, items = pipeline.place(config, d, lambda: target or load_target(tapping, d.device, cpu=True),
                                                  lambda t: load_items(config, t) if items is None else items, stop)
                if target is None:  # a stage rank, done serving
                    return LoopResult(stopped_by=stop.reason, exit_code=stop.exit_code if stop else 0)
            if target is None:  # tapping every drafter's layers
                target = load_target(tapping, d.device)
            if items is None:
                items = load_items(config, target)
            items, eval_items = eval_split(config, target, items)
            if d.is_main:
                config.to_json(run.config)
                write_plan(run.root, specs)
                for cfg in configs.values():
                    Path(cfg.io.out).mkdir(parents=True, exist_ok=True)
                    cfg.to_json(RunDir(cfg.io.out).config)
            trainer = TrainingLoop(configs, target, items, d, stop, on_step, eval_items, layers)
            if config.io.resume:
                trainer.restore()
            log.info("training %d drafters (%s) for %d steps on %d sequences, one target pass, world size %d, "
                     "device %s", len(configs), ", ".join(configs), trainer.total_steps, len(items), d.world_size,
                     d.device)
            result = trainer.run()
            getattr(target, "close", lambda: None)()  # pipeline: the stage ranks may stop
            return result
        except DflashError as exc:
            if d.is_main or not isinstance(exc, SAID_BY_RANK_0):  # a refusal: rank 0's line says it for all
                log.error("stopped: %s", exc)
            raise
        except Exception as exc:  # a full disk, a lost rank: the drafters checkpoint at the same steps
            first = RunDir(next(iter(configs.values())).io.out)
            error = known_fault(exc, config, first, d, trainer.step if trainer else 0)
            if error is None:
                raise
            log.error("stopped: %s", error)
            raise error from None
        finally:
            stop.uninstall()
