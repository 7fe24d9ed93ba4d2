"""Checks that cost seconds, run before the target's weights load (minutes on a large target).

From the file system, the target's config.json and its tokenizer alone:
- the --data / --eval-data paths exist, are data the loader reads (a file of a known format, a directory
  holding shards, a saved dataset) and hold at least one record (not only empty files);
- the target's config.json is valid JSON with a model_type that transformers knows; --target-layer-ids
  are layers of the target; the mask token resolves, and both are ones vLLM and SGLang serve
  (dflash.io.engines: not the last layer; the tokenizer's <|MASK|>);
- with --resume: the checkpoint to continue from is there and readable (its drafter's header and its
  trainer state, read without their tensor data);
- on a GPU: the memory model (dflash.plan) says the --layout and micro-batch fit the memory this process may
  use (unless --no-memory-check).
Each failure is the same error, with the same message, that the full load would give later.
"""

from __future__ import annotations

import torch

from pathlib import Path

from dflash.config import TrainConfig
from dflash.errors import CheckpointError, DataError, DflashError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
_BLANK = b" \t\r\n\f\v"
_BOM = b"\xef\xbb\xbf"


def _has_content(path: Path) -> bool:
    """True when the file holds a byte other than whitespace (a UTF-8 BOM at its start does not count).
    Reads only up to the first such byte: one block for any real data file."""
    with path.open("rb") as fh:
        first = True
        for block in iter(lambda: fh.read(1 << 16), b""):
            if first:
                block, first = block.removeprefix(_BOM), False
            if block.strip(_BLANK):
                return True
    return False


def _parquet_rows(path: Path) -> int | None:
    """Rows of a Parquet file from its footer, or None when the footer cannot be read (the loader then
    names the damage)."""
    try:
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows
    except Exception:  # a damaged file: left to the reader, whose message names it
        return None


def check_data_source(flag: str, value) -> None:
    """`value` of --data/--eval-data: readable as data (dflash.data.sources.find_source) and not empty."""
    from dflash.data.sources import find_source

    source = find_source(value)
    if source.kind != "shards":
        return
    try:
        empty = [shard for shard in source.shards
                 if (shard.suffix == ".parquet" and _parquet_rows(shard) == 0)
                 or (shard.suffix != ".parquet" and not _has_content(shard))]
    except OSError as exc:
        raise DataError(f"{flag} {value}: cannot be read ({exc}); fix its permissions or point {flag} "
                        "elsewhere") from None
    if len(empty) == len(source.shards):
        what = "is empty" if source.shards == (source.path,) else f"holds only empty files ({len(empty)})"
        raise DataError(f"{flag} {value} {what}: no conversation to train on. Pass a chat JSONL with one "
                        '{"messages": [...]} conversation per line (or JSON, Parquet, a directory of them)')


def check_data_paths(config: TrainConfig) -> None:
    """A --data or --eval-data that is plainly a local file path must exist; every one that exists must be
    data the loader reads and hold a record (names resolved by the data loader, such as saved datasets,
    are left to it)."""
    for flag, value in (("--data", config.io.data), ("--eval-data", config.watch.eval_data)):
        if not value:
            continue
        path = Path(value).expanduser()
        looks_local = path.suffix.lower() in FILE_SUFFIXES or str(value).startswith(("/", "./", "../", "~"))
        if looks_local and not path.exists():
            raise DataError(f"{flag} {value}: no such file or directory; pass a JSONL/JSON/Parquet file, a "
                            "directory of them, or a saved dataset")
        if path.exists():
            check_data_source(flag, path)


def check_target_cheaply(config: TrainConfig) -> None:
    """The target's config.json, --target-layer-ids and the mask token against the target's config.json and
    tokenizer; skipped when --target is not a local model directory (the loader says why) or --init-drafter
    decides both."""
    if not config.io.target or config.model.init_drafter:
        return
    path = Path(config.io.target)
    if not (path / "config.json").is_file():
        return
    from dflash.io.engines import check_servable
    from dflash.model.target import _resolve_mask_token, check_layer_ids, load_target_tokenizer, read_target_config

    text = read_target_config(path).get_text_config()
    if config.model.target_layer_ids is not None:
        check_layer_ids(config.model.target_layer_ids, int(text.num_hidden_layers))
    tokenizer = load_target_tokenizer(path)
    mask_id = _resolve_mask_token(tokenizer, text.model_type, int(text.vocab_size), config.model.mask_token)
    check_servable(config.model.target_layer_ids or [], int(text.num_hidden_layers), tokenizer, mask_id)


def _damaged(checkpoint: Path, what: Path, reason: str) -> CheckpointError:
    from dflash.train.records.checkpoint import STATE_FILE

    root = checkpoint.parent
    earlier = sorted(p.name for p in root.glob("step-*") if p.name < checkpoint.name and (p / STATE_FILE).is_file())
    if earlier:
        fix = (f"Resume from the previous checkpoint: echo {earlier[-1]} > {root / 'latest'}, then run again with "
               "--resume; or start over without --resume (in another --out, or after removing this one)")
    else:
        fix = ("There is no earlier checkpoint to resume from: start over without --resume (in another --out, or "
               "after removing this one)")
    return CheckpointError(f"{what} is damaged ({reason}), so checkpoint {checkpoint.name} cannot be resumed. {fix}.")


def check_resume_checkpoint(config: TrainConfig) -> None:
    """With --resume: the checkpoint `latest` names exists, its drafter's config and tensor headers read, its
    trainer state unpickles (tensors memory-mapped, not read), and every file has the size and sha256 its
    manifest recorded when it was written: a damaged file is named before the target loads, with the way
    out."""
    if not config.io.resume:
        return
    import zipfile

    import torch

    from dflash.io.drafter_dir import read_drafter_config
    from dflash.train.records.checkpoint import STATE_FILE, latest_checkpoint, load_error_text
    from dflash.train.records.manifest import WRITTEN_KEY, check_manifest
    from dflash.train.parallel import drafter_state
    from dflash.train.parallel.sharded_checkpoint import KIND_KEY
    from dflash.train.records.rundir import RunDir

    root = RunDir(config.io.out).checkpoints
    last = latest_checkpoint(root)
    if last is None:
        raise CheckpointError(f"--resume: no checkpoint in {root}: the run stopped before its first one, so there "
                              "is nothing to continue. Start it over with --overwrite instead of --resume (deletes "
                              "its metrics and log), or give another --out.")
    try:
        saved = read_drafter_config(last / "drafter")
    except DflashError as exc:
        raise _damaged(last, last / "drafter", str(exc)) from None
    state = last / STATE_FILE
    if not zipfile.is_zipfile(state):
        raise _damaged(last, state, "not a complete file as torch.save writes it: its zip index is missing, so it "
                                    "was cut short or overwritten")
    try:
        loaded = torch.load(state, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # UnpicklingError, RuntimeError from the zip reader, EOFError, ...
        raise _damaged(last, state, f"its contents do not load: {load_error_text(exc)}") from None
    # a sharded (DCP) checkpoint keeps its optimizer state in dcp/, not in this file
    needed = {"scheduler", "rng", "step"} | ({"optimizer"} if isinstance(loaded, dict) and
                                               loaded.get(KIND_KEY, "full") == "full" else set())
    if not isinstance(loaded, dict) or not needed <= loaded.keys():
        raise _damaged(last, state, "it loads, but holds no trainer state (optimizer, scheduler, rng, step)")
    drafter_state.of(config.layout).check_checkpoint(last, loaded)
    # bytes changed inside tensor data load without an error anywhere else
    problem = check_manifest(last, required=bool(loaded.get(WRITTEN_KEY)))
    if problem:
        raise _damaged(last, *problem)
    check_resume_shape(config, last, saved)


def check_resume_shape(config: TrainConfig, checkpoint: Path, saved) -> None:
    """The options that fix the drafter's shape against `saved`, the DrafterConfig of the drafter `checkpoint`
    holds: another drafter kind, block size, layer count, window or tapped layers is refused by its flag before
    any weight loads (the whole config is compared once the target is loaded:
    dflash.train.records.checkpoint.check_compatible). With --init-drafter, its config.json fixes all but the
    kind and the block size."""
    from dflash.kinds import kind_of

    opts = config.model
    pairs = {"--drafter-kind": (kind_of(saved).name, opts.drafter_kind),
             "--block-size": (saved.block_size, opts.block_size)}
    if not opts.init_drafter:
        pairs["--drafter-layers"] = (saved.num_hidden_layers, opts.drafter_layers)
        pairs["--sliding-window"] = (saved.sliding_window or 0, opts.sliding_window)
        if opts.target_layer_ids is not None:
            pairs["--target-layer-ids"] = (",".join(map(str, saved.target_layer_ids)),
                                           ",".join(map(str, opts.target_layer_ids)))
    differ = {flag: pair for flag, pair in pairs.items() if pair[0] != pair[1]}
    if differ:
        was = " ".join(f"{flag} {old}" for flag, (old, _) in differ.items())
        now = " ".join(f"{flag} {new}" for flag, (_, new) in differ.items())
        raise CheckpointError(
            f"--resume: checkpoint {checkpoint.name} in {checkpoint.parent} holds a drafter trained with {was}; this "
            f"run asks for {now}. Its weights and optimizer state fit only that drafter: resume with {was} (the "
            f"options the run started with are in {Path(config.io.out) / 'config.json'}), or start a new run in "
            "another --out without --resume.")


def drafter_layers(config: TrainConfig, configs: dict[str, TrainConfig], target) -> dict[str, list[int]]:
    """Each drafter's tapped target layers, checked against the target's config.json (or the `target` given)
    before any weight loads (one target pass taps their union: dflash.train.parallel.taps)."""
    from dflash.train.parallel.taps import tapped_layers

    if target is not None:
        return tapped_layers(configs, target.num_layers, loaded=target.layer_ids)
    from dflash.io.fit import target_shape

    for name, cfg in configs.items():  # a drafter's own layers: in range, and ones the serving engines tap
        if cfg.model.target_layer_ids != config.model.target_layer_ids:
            try:
                check_target_cheaply(cfg)
            except DflashError as exc:
                raise type(exc)(f"drafter '{name}': {exc}") from None
    if config.model.init_drafter:  # its config.json fixes the layers of every drafter
        from dflash.io.drafter_dir import read_drafter_config

        return {name: list(read_drafter_config(config.model.init_drafter).target_layer_ids) for name in configs}
    return tapped_layers(configs, target_shape(config.io.target).num_layers)


def check_memory(config: TrainConfig, configs: dict[str, TrainConfig], layers: dict[str, list[int]], world: int,
                 device, card_gb_for_tests: float | None = None) -> None:
    """The run's layout and micro-batch against the memory model (dflash.plan.planner.check_training_fits):
    the card's memory is what this process may use on `device` (None on a CPU: no check), or
    `card_gb_for_tests`, the seam through which a CPU test stands in a card of that size. Several drafters on
    one target pass: their states add up, one drafter's activations at a time, the largest anchors any of them
    samples."""
    from dflash.plan.planner import check_training_fits, visible_card_gb
    from dflash.plan.sizes import drafter_shape, target_shape_from_dir
    from dflash.batching import batching_for

    card_gb = card_gb_for_tests if card_gb_for_tests is not None else visible_card_gb(device)
    batching = batching_for(config, device if device is not None else torch.device("cpu"))
    if len(configs) == 1 or card_gb is None or not config.runtime.memory_check or not config.io.target:
        check_training_fits(config, world, card_gb, config.runtime.layout, batching=batching)  # returns when unchecked
        return
    from dflash.model.target import resolve_target

    target = target_shape_from_dir(resolve_target(config.io.target))
    shapes = [drafter_shape(target, layers=cfg.model.drafter_layers, block_size=cfg.model.block_size,
                            tapped=len(layers[name]), sliding_window=cfg.model.sliding_window,
                            kind=cfg.model.drafter_kind, recompute=cfg.runtime.recompute_layers)
              for name, cfg in configs.items()]
    widest = config.replace(max_anchors=max(cfg.model.max_anchors for cfg in configs.values()))
    check_training_fits(widest, world, card_gb, config.runtime.layout, batching=type(batching)(widest),
                        drafters=shapes)


def check_before_loading(config: TrainConfig, configs: dict[str, TrainConfig], *, data: bool = True, target=None,
                         world_size: int = 1, device=None, card_gb_for_tests: float | None = None
                         ) -> dict[str, list[int]]:
    """Every check above, for the run of `config` training `configs` ({name: config}, {"": config} for one
    drafter): the data (unless given: `data` False), the target (unless given as `target`), each drafter's
    checkpoint to resume, their tapped layers, and the memory. Returns each drafter's tapped layers."""
    if data:
        check_data_paths(config)
    if target is None:
        check_target_cheaply(config)
    for cfg in configs.values():
        check_resume_checkpoint(cfg)
    layers = drafter_layers(config, configs, target)
    if target is None:
        check_memory(config, configs, layers, world_size, device, card_gb_for_tests)
    return layers
