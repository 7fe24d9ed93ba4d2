"""What the DFlash2 layout adds to the reference DFlash layout on disk (dflash.io.drafter_dir reads and writes
both; docs/dflash2.md lists where each engine reads each key and tensor):

    architectures ["DFlash2DraftModel"]       vLLM registry -> qwen3_dflash2.DFlash2Qwen3ForCausalLM;
                                               SGLang models/dflash.py DFlash2DraftModel
    dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
                   output_multiplier, final_logit_softcapping}
    layers.N.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}
    candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}

    auto_map {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}   transformers' trust_remote_code path:
    modeling_dflash2.py (dflash/io/remote_code_dflash2.py, self-contained) is written beside the weights

not modeling_dflash.py, whose DFlashDraftModel would load a DFlash2 drafter without its convolutions and
selector.
"""

from __future__ import annotations

from pathlib import Path

from dflash.errors import DrafterError
from dflash.io.config_values import as_float
from dflash.model.dflash2 import DFLASH2_KEYS, DFlash2Config
from dflash.model.drafter import DrafterConfig

ARCHITECTURE = "DFlash2DraftModel"
MODEL_FILE = "modeling_dflash2.py"  # dflash/io/remote_code_dflash2.py, for AutoModel(..., trust_remote_code=True)
AUTO_MAP = {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # vLLM reads them with []


def is_dflash2(config: DrafterConfig) -> bool:
    return isinstance(config, DFlash2Config)


def remote_code_source() -> str:
    """modeling_dflash2.py: the self-contained DFlash2DraftModel that config.json's auto_map names."""
    from dflash.io import remote_code_dflash2

    return Path(remote_code_dflash2.__file__).read_text()


def dflash_config_keys(config: DFlash2Config) -> dict:
    """The DFlash2 keys of dflash_config (final_logit_softcapping null when off: every reader takes null as off)."""
    return {k: getattr(config, k) for k in DFLASH2_KEYS}


def parse_keys(dflash: dict, where: Path) -> dict:
    """DFlash2Config's own fields from a config.json's dflash_config, or a DrafterError naming the key."""
    missing = [k for k in _REQUIRED if dflash.get(k) is None]
    if missing:
        raise DrafterError(f"{where}: a {ARCHITECTURE} needs dflash_config.{', dflash_config.'.join(missing)} "
                           "(vLLM reads them unconditionally); add them from the drafter's training config")
    values = {}
    for key in _REQUIRED:
        value = dflash[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DrafterError(f"{where}: dflash_config.{key} is {value!r}; it must be an integer >= 1")
        values[key] = value
    for key, default in (("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        value = dflash.get(key, default)
        if value is not None:  # a finite number; DFlash2Config asks for > 0
            value = as_float(value, f"dflash_config.{key}", where)
        values[key] = None if key == "final_logit_softcapping" and not value else value
    return values
