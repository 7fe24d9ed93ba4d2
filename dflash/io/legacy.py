"""Older drafters of this project ("format": "dflash-drafter/1": keys num_layers/num_heads/num_kv_heads,
MLP tensors as layers.N.gate_proj) rewritten into the reference DFlash layout (`dflash export`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dflash.io.drafter_dir import CONFIG_NAME, LEGACY_FORMAT, MODEL_TYPE, check_tensors, read_json, save_drafter, weight_files
from dflash.io.fit import TargetShape, check_fits_target
from dflash.errors import DrafterError
from dflash.model.drafter import Drafter, DrafterConfig

_LEGACY_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads"}


def _legacy_name(name: str) -> str:
    """layers.N.gate_proj.weight -> layers.N.mlp.gate_proj.weight; other names are unchanged."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in ("gate_proj", "up_proj", "down_proj"):
        return ".".join(parts[:2] + ["mlp"] + parts[2:])
    return name


def convert_legacy(src, dst, *, target: TargetShape | None = None, num_target_layers: int | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Rewrite an older project drafter ("format": "dflash-drafter/1") into the reference layout at `dst`.

    The old config does not record the target's layer count: it comes from `target` (`dflash export
    --target`, which is also checked against the drafter) or `num_target_layers`. `dst` appears
    complete or not at all.
    """
    if (target is None) == (num_target_layers is None):
        raise DrafterError("converting an older drafter needs the target's layer count: pass the target "
                           "(--target DIR) or the count (--num-target-layers N), one of them")
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    if not (src / CONFIG_NAME).is_file():
        raise DrafterError(f"{src} has no {CONFIG_NAME}; pass a drafter directory written by dflash-train")
    data = read_json(src / CONFIG_NAME)
    if data.get("format") != LEGACY_FORMAT:
        if data.get("model_type") == MODEL_TYPE:
            raise DrafterError(f"{src} is already in the reference layout; nothing to convert")
        raise DrafterError(f"{src / CONFIG_NAME} is neither an older project drafter ({LEGACY_FORMAT}) nor a "
                           "reference-layout one; nothing to convert")
    if dst.exists():
        raise DrafterError(f"{dst} exists; pass a new directory (export never overwrites)")
    values = {_LEGACY_KEYS.get(k, k): v for k, v in data.items() if k not in ("format", "target_hidden_size")}
    try:
        config = DrafterConfig(**values, num_target_layers=target.num_layers if target else num_target_layers,
                               max_position_embeddings=target.max_position_embeddings if target else 40960)
    except (TypeError, ValueError) as exc:
        raise DrafterError(f"{src / CONFIG_NAME} cannot be converted: {exc}") from exc
    if target is not None:
        check_fits_target(config, target, str(src))
    state = {_legacy_name(k): v for k, v in load_file(str(weight_files(src)[0])).items()}
    check_tensors(config, {k: (tuple(v.shape), "") for k, v in state.items()}, src)
    with torch.device("meta"):
        drafter = Drafter(config)
    drafter.load_state_dict(state, strict=True, assign=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter(drafter, tmp, dtype)
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
