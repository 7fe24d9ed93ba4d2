"""What vLLM and SGLang require of a drafter beyond its files, checked when training starts.

Tapped layers. Layer id l is the output of target decoder layer l. vLLM captures it as the input of layer
l + 1 (eagle3_utils.py adds 1), and the output of the last layer for l = L-1, as this project does. SGLang
refuses l = L-1 for Qwen3.5 targets (models/qwen3_5_text.py: ids must lie in [0, L-1)) and, for Qwen3
targets, captures "before layer l + 1" in a loop over layers 0..L-1 (models/qwen3.py), so it never
captures l = L-1 at all. HF's hidden_states[L] is the last layer's output *after* the final norm, not
the layer output. A drafter that taps L-1 is therefore refused: it would serve in one engine only.

Mask token. SGLang resolves the drafter's dflash_config.mask_token_id against the target tokenizer's
"<|MASK|>" token (dflash_config.mask_token, default "<|MASK|>") and refuses the drafter when the
tokenizer has that token under another id (speculative/dflash_worker_v2.py _resolve_mask_token_id).
"""

from __future__ import annotations

from dflash.errors import TargetError

SGLANG_MASK_TOKEN = "<|MASK|>"


def last_layer_problem(layer_ids, num_layers: int) -> str | None:
    """Why `layer_ids` cannot be served (tapping the last of `num_layers` layers), or None."""
    last = int(num_layers) - 1
    if last not in [int(i) for i in layer_ids]:
        return None
    return (f"target layer id {last} is the target's last layer (it has {num_layers}, ids 0..{last}): SGLang refuses "
            f"it for Qwen3.5 targets (ids must lie in [0, {last})) and never captures it for Qwen3 targets (it "
            f"captures before layer id + 1), and HF hidden_states[{num_layers}] is after the final norm, not that "
            f"layer's output; tap layers in 0..{last - 1}")


def mask_token_problem(tokenizer, mask_token_id: int) -> str | None:
    """Why SGLang would refuse `mask_token_id` with this target tokenizer, or None."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab_id = get_vocab().get(SGLANG_MASK_TOKEN) if callable(get_vocab) else None
    if vocab_id is None or int(vocab_id) == int(mask_token_id):
        return None
    return (f"mask token id {mask_token_id} is not the id of the target tokenizer's {SGLANG_MASK_TOKEN} ({vocab_id}): "
            f"SGLang resolves a drafter's mask_token_id against that token and refuses the drafter when they differ; "
            f"use the tokenizer's {SGLANG_MASK_TOKEN} (leave --mask-token unset, or pass --mask-token "
            f"'{SGLANG_MASK_TOKEN}')")


def check_servable(layer_ids, num_layers: int, tokenizer, mask_token_id: int, error=TargetError) -> None:
    """Raise `error` naming every reason vLLM or SGLang would not serve a drafter tapping `layer_ids`
    with `mask_token_id` for this target."""
    problems = [p for p in (last_layer_problem(layer_ids, num_layers), mask_token_problem(tokenizer, mask_token_id))
                if p]
    if problems:
        raise error("the drafter could not be served: " + "; ".join(problems))
