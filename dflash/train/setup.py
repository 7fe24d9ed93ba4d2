"""What a run is built from, resolved for its device before the loop starts: the attention kernel, whether
the drafter's layers compile, the precision, the drafter's config, and the frozen target (its batching:
dflash.batching.batching_for)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dflash.batching import batching_for
from dflash.config import TrainConfig
from dflash.errors import ConfigError
from dflash.model.drafter import FLEX_MIN_QUERY_ROWS

FLEX_MIN_HEAD_DIM = 16  # flex_attention's compiled kernels refuse narrower heads


def attention_impl(config: TrainConfig, device: torch.device, head_dim: int | None = None) -> str:
    """--attention resolved for `device`: 'auto' is flex on a GPU (compiled kernels), sdpa elsewhere, for
    heads narrower than flex's kernels take, and for a batching that fixes fewer drafter query rows per
    micro-batch (packed rows: --pack-anchors x --block-size) than compiled flex takes (every step would run
    sdpa: see dflash.model.drafter.FLEX_MIN_QUERY_ROWS; a padded batch that short takes sdpa for its own step)."""
    attention = config.runtime.attention
    batching = batching_for(config, device)
    rows = batching.query_rows()  # fixed drafter query rows per micro-batch, or None
    too_few = rows is not None and rows < FLEX_MIN_QUERY_ROWS  # the drafter runs such rows on sdpa, compiled or not
    if attention == "flex" and device.type != "cuda":
        raise ConfigError(f"--attention flex needs a GPU: flex_attention has no backward on {device.type}; "
                          "use --attention sdpa (or auto, which picks sdpa there).")
    if attention == "flex" and head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM:
        raise ConfigError(f"--attention flex needs head_dim >= {FLEX_MIN_HEAD_DIM} (flex_attention's kernels), but "
                          f"the drafter's heads are {head_dim} wide; use --attention sdpa (or auto).")
    if attention == "flex" and too_few:
        raise ConfigError(f"--attention flex needs at least {FLEX_MIN_QUERY_ROWS} drafter query rows per "
                          f"micro-batch, but {batching.anchors_flag} {batching.n_anchors} x --block-size "
                          f"{config.model.block_size} is {rows}; raise {batching.anchors_flag} to at least "
                          f"{-(-FLEX_MIN_QUERY_ROWS // config.model.block_size)}, or use --attention sdpa (or auto).")
    if attention != "auto":
        return attention
    wide_enough = head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if device.type == "cuda" and wide_enough and not too_few else "sdpa"


def compile_layers(config: TrainConfig, device: torch.device) -> bool:
    """--compile resolved for `device`: 'auto' compiles the drafter's layers on a GPU only (on a CPU the
    compile costs more than it saves on the small models trained there)."""
    return config.runtime.compile == "on" or (config.runtime.compile == "auto" and device.type == "cuda")


def auto_precision(device: torch.device) -> torch.dtype:
    """--precision auto on `device`: bf16 on a GPU, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def precision(config: TrainConfig, device: torch.device) -> torch.dtype:
    """--precision resolved for `device`: the autocast dtype of the drafter and the dtype of the target."""
    if config.runtime.precision == "auto":
        return auto_precision(device)
    return torch.bfloat16 if config.runtime.precision == "bf16" else torch.float32


def pad_id(target) -> int:
    """The id a batch pads with: the tokenizer's pad token, else its EOS, else 0."""
    tok = target.tokenizer
    for value in (tok.pad_token_id, tok.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def drafter_config(config: TrainConfig, target):
    """The drafter this run trains: --init-drafter's (checked against the target), or a new one shaped
    like the target's attention with --drafter-layers and --sliding-window."""
    from dflash.io.drafter_dir import read_drafter_config
    from dflash.io.fit import check_fits_target
    from dflash.kinds import check_kind, named

    from dflash.io.engines import check_servable

    check_servable(target.layer_ids, target.num_layers, target.tokenizer, target.mask_token_id)
    opts = config.model
    if not opts.init_drafter:
        return named(opts.drafter_kind).new_config(target, opts.drafter_layers, opts.block_size, opts.sliding_window)
    where = f"--init-drafter {opts.init_drafter}"
    init = read_drafter_config(opts.init_drafter)
    check_kind(init, opts.drafter_kind, where)
    check_fits_target(init, target, where)
    if init.block_size != opts.block_size:
        raise ConfigError(f"{where} was trained with block size {init.block_size}, --block-size is "
                          f"{opts.block_size}; pass --block-size {init.block_size}.")
    if (init.target_layer_ids, init.mask_token_id) != (list(target.layer_ids), target.mask_token_id):
        raise ConfigError(f"{where} taps target layers {init.target_layer_ids} with mask token {init.mask_token_id}, "
                          f"the target was loaded with {target.layer_ids} and {target.mask_token_id}; load it "
                          "with load_target(config, ...), which takes both from the drafter.")
    return replace(init, target_fingerprint=target.fingerprint)


def load_target(config: TrainConfig, device: torch.device, path=None, cpu: bool = False):
    """The frozen target of --target (or `path`): in bf16 when training uses bf16 autocast (its forward
    is most of the cost on a GPU), else in fp32 (`cpu`: on the CPU, in `device`'s dtype; --layout pipeline
    moves each rank's share). With --init-drafter, tapped at that drafter's layers with its mask token,
    once its config.json is checked against the target's."""
    from dflash.model.target import Target

    path, opts = path or config.io.target, config.model
    layer_ids, mask_token = opts.target_layer_ids, opts.mask_token
    if opts.init_drafter:
        from dflash.io.drafter_dir import read_drafter_config
        from dflash.io.fit import check_fits_target, target_shape

        init = read_drafter_config(opts.init_drafter)
        check_fits_target(init, target_shape(path), f"--init-drafter {opts.init_drafter}")
        layer_ids, mask_token = init.target_layer_ids, init.mask_token_id
    return Target.load(path, device="cpu" if cpu else device, dtype=precision(config, device),
                       layer_ids=layer_ids, mask_token=mask_token)
