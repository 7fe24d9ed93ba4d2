"""Whether a drafter fits a target: the target's shape read from its config.json alone (`target_shape`),
and every mismatch between a drafter's config and that target named (`check_fits_target`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.errors import DrafterError
from dflash.model.drafter import DrafterConfig


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree with, read from a target's config.json (no weights loaded)."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int
    fingerprint: str | None = None  # only a loaded Target computes it


def target_shape(path) -> TargetShape:
    """TargetShape of the HF model directory (or Hub model id: dflash.model.target.resolve_target) `path`,
    from its config.json alone."""
    from dflash.model.target import read_target_config, resolve_target

    text = read_target_config(resolve_target(path)).get_text_config()  # a TargetError names a missing or bad config.json
    return TargetShape(int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size),
                       int(getattr(text, "max_position_embeddings", None) or 40960))


def check_fits_target(config: DrafterConfig, target, where: str = "the drafter") -> None:
    """Refuse a drafter that does not fit `target` (a Target or a TargetShape); names every mismatch."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != the target's {target.hidden_size}")
    if config.num_target_layers != target.num_layers:
        problems.append(f"num_target_layers {config.num_target_layers} != the target's {target.num_layers} layers")
    bad = [i for i in config.target_layer_ids if i >= target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} do not exist in a {target.num_layers}-layer target")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != the target's {target.vocab_size}")
    if config.mask_token_id >= target.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is outside the target's vocabulary "
                        f"(0..{target.vocab_size - 1})")
    from dflash.io.engines import mask_token_problem

    if getattr(target, "tokenizer", None) is not None and (problem := mask_token_problem(target.tokenizer,
                                                                                          config.mask_token_id)):
        problems.append(problem)
    fingerprint = getattr(target, "fingerprint", None)
    if not problems and fingerprint and config.target_fingerprint and config.target_fingerprint != fingerprint:
        problems.append(f"its target_fingerprint {config.target_fingerprint} != the target's {fingerprint} "
                        "(same sizes, other architecture or vocabulary)")
    if problems:
        raise DrafterError(f"{where} was trained for a different target: {'; '.join(problems)}. "
                           "Pass the target it was trained for (or a drafter trained for this target)")
