"""Checks that cost seconds, run before the target's weights load (minutes on a large target).

From the file system, the target's config.json and its tokenizer alone: the --data / --eval-data files
exist, --target-layer-ids are layers of the target, the mask token resolves, and both are ones vLLM and
SGLang serve (dflash.io.engines: not the last layer; the tokenizer's <|MASK|>). Each failure is the same
error, with the same message, that the full load would give later.
"""

from __future__ import annotations

from pathlib import Path

from dflash.config import TrainConfig
from dflash.errors import DataError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def check_data_paths(config: TrainConfig) -> None:
    """A --data or --eval-data that is plainly a local file path must exist (names resolved by the data
    loader, such as saved datasets, are left to it)."""
    for flag, value in (("--data", config.io.data), ("--eval-data", config.watch.eval_data)):
        if not value:
            continue
        path = Path(value).expanduser()
        looks_local = path.suffix.lower() in FILE_SUFFIXES or str(value).startswith(("/", "./", "../", "~"))
        if looks_local and not path.exists():
            raise DataError(f"{flag} {value}: no such file or directory; pass a JSONL/JSON/Parquet file, a "
                            "directory of them, or a saved dataset")


def check_target_cheaply(config: TrainConfig) -> None:
    """--target-layer-ids and the mask token against the target's config.json and tokenizer; skipped
    when --target is not a local model directory (the loader says why) or --init-drafter decides both."""
    if not config.io.target or config.model.init_drafter:
        return
    path = Path(config.io.target)
    if not (path / "config.json").is_file():
        return
    from transformers import AutoConfig, AutoTokenizer

    from dflash.io.engines import check_servable
    from dflash.model.target import _resolve_mask_token, check_layer_ids

    text = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    if config.model.target_layer_ids is not None:
        check_layer_ids(config.model.target_layer_ids, int(text.num_hidden_layers))
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    mask_id = _resolve_mask_token(tokenizer, text.model_type, int(text.vocab_size), config.model.mask_token)
    check_servable(config.model.target_layer_ids or [], int(text.num_hidden_layers), tokenizer, mask_id)


def check_before_loading(config: TrainConfig, *, data: bool = True, target: bool = True) -> None:
    if data:
        check_data_paths(config)
    if target:
        check_target_cheaply(config)
