"""Model FLOPs of the frozen target's forward and the drafter's step, from shapes alone (no tensors):
the formulas behind MFU in training (dflash.train.probes.mfu) and tokens/s in the planner (dflash.plan)."""

from __future__ import annotations


def layer_weights(layers) -> int:
    """Weights of the decoder layers: their parameters, and the float8 weights an FP8 target holds as
    buffers (dflash.model.fp8.Fp8Linear and transformers' FP8Linear keep `weight` so: no parameter)."""
    fp8 = sum(b.numel() for name, b in layers.named_buffers()
              if name.rsplit(".", 1)[-1] == "weight" and b.is_floating_point() and b.element_size() == 1)
    return sum(p.numel() for p in layers.parameters()) + fp8


def target_forward_flops(target, lengths: list[int]) -> float:
    """Forward FLOPs of the frozen target over sequences of these (unpadded) lengths."""
    cfg = target.config
    layer_params = layer_weights(target._layers)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * target.num_layers
    n_full = sum(1 for t in types if t == "full_attention")
    causal_pairs = sum(n * (n + 1) / 2 for n in lengths)
    head_dim = int(getattr(cfg, "head_dim", None) or target.hidden_size // cfg.num_attention_heads)
    return 2 * layer_params * sum(lengths) + 4 * head_dim * cfg.num_attention_heads * causal_pairs * n_full


def drafter_pairs(anchor_positions: list[int], block_size: int, window: int | None = None) -> float:
    """Visible query-key pairs of the drafter's full-attention mask for valid anchors at these positions
    (with `window`: the context each block row sees is at most `window` positions)."""
    context = sum(min(a, window) if window else a for a in anchor_positions)
    return float(block_size * (context + block_size * len(anchor_positions)))


def drafter_flops(dcfg, context_tokens: int, rows: int, pairs: float) -> float:
    """Forward + backward FLOPs of the drafter: `rows` block rows over `context_tokens` context rows."""
    H = dcfg.hidden_size
    q_o_mlp = 2 * H * dcfg.num_attention_heads * dcfg.head_dim + 3 * H * dcfg.intermediate_size
    k_v = 2 * H * dcfg.num_key_value_heads * dcfg.head_dim
    per_layer = (2 * q_o_mlp * rows + 2 * k_v * (context_tokens + rows)
                 + 4 * dcfg.head_dim * dcfg.num_attention_heads * pairs)
    return 3 * (dcfg.num_hidden_layers * per_layer + 2 * len(dcfg.target_layer_ids) * H * H * context_tokens)


def head_flops(dcfg, scored_rows: int) -> float:
    """LM head FLOPs over the scored block positions (forward + input gradient)."""
    return 4 * dcfg.hidden_size * dcfg.vocab_size * scored_rows
