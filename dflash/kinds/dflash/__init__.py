"""The DFlash drafter kind: a block-diffusion drafter of Qwen3 layers fed the target's tapped states
(dflash.model.drafter), trained with the position-weighted block loss (dflash.objective), proposing the
LM head's argmax (or a sample) at each block slot, and stored in the reference DFlash layout."""

from __future__ import annotations

from pathlib import Path

from dflash.kinds.kind import DrafterKind
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.objective.head_loss import fused_weighted_ce
from dflash.objective.losses import weighted_ce_from_hidden


def objective(drafter, hidden, lm_head, head_weight, blocks, gamma):
    """The weighted block loss; with the head's weight, fused with it (dflash.objective.head_loss)."""
    if head_weight is not None:
        return fused_weighted_ce(hidden, head_weight, blocks.labels, blocks.label_valid, gamma)
    return weighted_ce_from_hidden(hidden, lm_head, blocks.labels, blocks.label_valid, gamma)


def propose(drafter, hidden, anchor_id: int, target, sampler):
    """Slots 1..bs-1 of one block's hidden states [1,bs,H] through the target's LM head: argmax at
    temperature 0, else sampled, with the distributions sampled from."""
    logits = target.lm_head(hidden[0, 1:].to(target.dtype))                               # [bs-1,V]
    if sampler.temperature <= 0:
        return logits.argmax(-1).tolist(), None
    return sampler.pick(logits).tolist(), sampler.probs(logits).cpu()


KIND = DrafterKind(
    name="dflash", title="DFlash", summary="DFlash (the reference block-diffusion drafter)",
    config_class=DrafterConfig, model_class=Drafter,
    architecture="DFlashDraftModel", model_file="modeling_dflash.py",
    remote_code=Path(__file__).with_name("remote_dflash.py"),
    own_keys=(), read_keys=lambda dflash_config, where: {},
    objective=objective, options=(), propose=propose,
)
