"""Model shapes: real targets' sizes as presets, and random models of those sizes to time and test with.

Two kinds of shape, both plain dicts:

target shapes (`random_target` builds a random Qwen3.5 hybrid of one: 3 GatedDeltaNet : 1 full attention)
    hidden, layers, vocab, intermediate     width, decoder layers, vocabulary, MLP width
    heads, kv_heads, head_dim               full-attention query heads, KV heads, head width
    linear_k_heads, linear_v_heads          GatedDeltaNet key / value heads (128 wide each)
  QWEN35_27B is Qwen3.5-27B's text model; `scaled_qwen35_shape` sizes one from a width alone.

drafter step shapes (STEP_SHAPES: what one training micro-batch of the drafter sees)
    hidden, heads, kv_heads, head_dim, intermediate, vocab    the target's attention shape and vocabulary,
                                                              which the drafter copies
    target_layers                                             the target's decoder layers (tapped: 5)
    batch, seq, anchors                                       B sequences of T tokens, anchors per sequence
  `drafter_config` turns one into a DrafterConfig; dflash.train.probes.synthetic makes the batch of one.
"""

from __future__ import annotations

import types

import torch

from dflash.model.drafter import DrafterConfig
from dflash.model.target import Target, default_layer_ids

# Qwen3.5-27B's text model: 64 layers (3 GatedDeltaNet : 1 full attention), hidden 5120, 26.9B parameters,
# 54 GB in bf16.
QWEN35_27B = dict(hidden=5120, layers=64, vocab=248320, intermediate=17408, heads=24, kv_heads=4, head_dim=256,
                  linear_k_heads=16, linear_v_heads=48)

STEP_SHAPES = {
    # Qwen3.5-27B's attention layers (the drafter copies them), its vocabulary and 64 layers; 2 x 4096 tokens
    "27b": dict(hidden=5120, heads=24, kv_heads=4, head_dim=256, intermediate=17408, vocab=248320,
                target_layers=64, batch=2, seq=4096, anchors=512),
    "small": dict(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=3072, vocab=32000,
                  target_layers=24, batch=2, seq=1024, anchors=64),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                 target_layers=8, batch=2, seq=128, anchors=8),
}


def scaled_qwen35_shape(hidden: int, layers: int, vocab: int) -> dict:
    """A Qwen3.5 hybrid target shape of this width: MLP 3 x hidden, 128-wide heads, up to 4 KV heads."""
    return dict(hidden=hidden, layers=layers, vocab=vocab, intermediate=3 * hidden, heads=max(1, hidden // 128),
                kv_heads=max(1, min(4, hidden // 128)), head_dim=128, linear_k_heads=max(1, hidden // 256),
                linear_v_heads=max(1, hidden // 128))


def mrope_sections(head_dim: int) -> list[int]:
    """Three M-RoPE sections covering head_dim x 0.25 (partial rotary) / 2 frequencies: 256 -> [11, 11, 10]."""
    base, extra = divmod(head_dim // 8, 3)
    return [base + (i < extra) for i in range(3)]


def qwen35_config(shape: dict):
    """The transformers config of a Qwen3.5 hybrid of a target shape (3 GatedDeltaNet : 1 full attention);
    its tokenizer stand-in pads with 0 and ends with 1."""
    from transformers import Qwen3_5TextConfig

    s, L = shape, shape["layers"]
    linear_head_dim = s.get("linear_head_dim", 128)
    return Qwen3_5TextConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=L,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        linear_num_key_heads=s["linear_k_heads"], linear_num_value_heads=s["linear_v_heads"],
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope_sections(s["head_dim"]), "mrope_interleaved": True},
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, attn_implementation="sdpa",
    )


def random_target(shape: dict, device: torch.device, dtype: torch.dtype) -> Target:
    """A random Qwen3.5 hybrid of a target shape, built directly on `device` in `dtype` (seeded: the same
    weights every call). Its tokenizer is a stand-in (pad 0, eos 1), its mask token id 2; feed it ids."""
    from transformers import Qwen3_5ForCausalLM

    config = qwen35_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype)
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1, mask_token_id=None)
    return Target(model, tokenizer, mask_token=2)


def drafter_config(shape: dict, layers: int, block_size: int) -> DrafterConfig:
    """The drafter of a step shape: the target's attention shape and vocabulary, `layers` decoder layers,
    5 tapped target layers, the last vocabulary id as the mask token."""
    s = shape
    return DrafterConfig(hidden_size=s["hidden"], num_hidden_layers=layers, num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         intermediate_size=s["intermediate"], vocab_size=s["vocab"], block_size=block_size,
                         num_target_layers=s["target_layers"],
                         target_layer_ids=default_layer_ids(s["target_layers"], 5), mask_token_id=s["vocab"] - 1)
