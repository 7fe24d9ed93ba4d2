"""The DFlash2 drafter kind: DFlash plus block-local dynamic convolutions and a candidate selector
(dflash.kinds.dflash2.dflash2_drafter), trained with DFlash's loss plus the selector's (dflash.kinds.dflash2.selector_loss),
proposing the selector's walk over its top-K candidates. docs/dflash2.md lists each part's sources.

What its layout adds to the reference DFlash layout on disk (dflash.io.drafter_dir reads and writes both):

    architectures ["DFlash2DraftModel"]       vLLM registry -> qwen3_dflash2.DFlash2Qwen3ForCausalLM;
                                               SGLang models/dflash.py DFlash2DraftModel
    dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
                   output_multiplier, final_logit_softcapping}
    layers.N.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}
    candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}

    auto_map {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}   transformers' trust_remote_code path:
    modeling_dflash2.py (dflash/kinds/dflash2/remote_dflash2.py, self-contained) is written beside the weights

not modeling_dflash.py, whose DFlashDraftModel would load a DFlash2 drafter without its convolutions and
selector.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.errors import DrafterError
from dflash.kinds.kind import DrafterKind
from dflash.kinds.config_values import as_float
from dflash.kinds.dflash2.dflash2_drafter import DFLASH2_KEYS, DFlash2Config, DFlash2Drafter
from dflash.kinds.dflash2.selector_loss import dflash2_sums

ARCHITECTURE = "DFlash2DraftModel"
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # vLLM reads them with []


def read_keys(dflash: dict, where: Path) -> dict:
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


def objective(drafter, hidden, lm_head, head_weight, blocks, gamma, selector_missing: str = "drop"):
    """DFlash's loss on the unary logits plus the selector term; `selector_missing` picks the published variant."""
    return dflash2_sums(drafter, hidden, lm_head, blocks.block_ids, blocks.labels, blocks.label_valid, gamma,
                        missing=selector_missing)


def propose(drafter, hidden, anchor_id: int, target, sampler):
    """The selector's walk over slots 1..bs-1 of one block's hidden states [1,bs,H]: greedy at temperature
    0, sampled row by row above it, with the realized rows' distributions."""
    anchor = torch.tensor([anchor_id], device=target.device)
    if sampler.temperature > 0:
        tokens, q = drafter.propose_sampled(hidden[:, 1:], anchor, target.lm_head, sampler.temperature,
                                            sampler.generator, target.dtype)
        return tokens.tolist(), q
    return drafter.propose(hidden[:, 1:], anchor, target.lm_head, target.dtype)[0].tolist(), None


KIND = DrafterKind(
    name="dflash2", title="DFlash2",
    summary="DFlash2 (DFlash plus block-local convolutions and a candidate selector, docs/dflash2.md)",
    config_class=DFlash2Config, model_class=DFlash2Drafter,
    architecture=ARCHITECTURE, model_file="modeling_dflash2.py",
    remote_code=Path(__file__).with_name("remote_dflash2.py"),
    own_keys=DFLASH2_KEYS, read_keys=read_keys,
    objective=objective, options=("selector_missing",), propose=propose,
    # the two dynamic convolutions per layer keep their inputs, coefficients and outputs: 44.5-45.0 bytes per
    # layer x row x H more than a DFlash layer (two shapes; rounded up), counted as saved tensors under bf16
    # autocast on the CPU (uncompiled; tests/dflash/plan/test_dflash2_plan.py). On an H100 with an FP8 27B
    # target, 8192-token packs ran at 512 anchors and ran out of memory at 1,024, which the model without it
    # accepted (84.7 GB of 85.5).
    layer_activation_surplus=46.0,
)
