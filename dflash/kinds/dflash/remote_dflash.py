"""DFlash drafter for `transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)`.

dflash-images writes this file beside a drafter's config.json as `modeling_dflash.py` (config.json's
"auto_map" names it), so a drafter directory loads without this project installed. It imports only
torch and transformers and uses transformers' Qwen3 building blocks (RMSNorm, MLP, rotary embedding).

    model = AutoModel.from_pretrained(DIR, trust_remote_code=True)      # a DFlashDraftModel
    hidden = model(position_ids=..., noise_embedding=..., target_hidden=...)
    logits = target.lm_head(hidden)
    out = model.spec_generate(target=target, input_ids=ids, max_new_tokens=64, stop_token_ids=[eos])

forward() takes what the reference DFlash drafter takes: `target_hidden` [B,T,k*H], the target's tapped
layers at positions 0..T-1 (layer id l is the output of target layer l, HF hidden_states[l + 1]),
concatenated in dflash_config.target_layer_ids order; `noise_embedding` [B,Q,H], the target's
embeddings of the block [anchor, MASK x (Q-1)]; `position_ids` [B,T+Q], the positions of both. It
returns the drafter's hidden states for the block after its final norm. Every block token sees the
whole context and its own block in a full_attention layer; in a sliding_attention layer a token at
position p sees the keys at positions p-W+1..p (W = sliding_window). No KV cache: each call recomputes
the context's keys and values.

spec_generate() is greedy speculative decoding with any causal-LM target, lossless by construction
(output = the target's greedy continuation); it recomputes the target's forward over the whole
sequence each step, so it shows that the drafter works and what it accepts, not serving speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

FULL, SLIDING = "full_attention", "sliding_attention"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context features followed by the block."""

    def __init__(self, config: Qwen3Config, layer_type: str):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.window = config.sliding_window if layer_type == SLIDING else None
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _split(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.head_dim).transpose(1, 2)

    def forward(self, x, context, cos, sin, positions, attention_mask=None):
        Q = x.shape[1]
        kv_in = torch.cat([context, x], dim=1)
        q = _rotate(self.q_norm(self._split(self.q_proj(x), self.heads)), cos[:, :, -Q:], sin[:, :, -Q:])
        k = _rotate(self.k_norm(self._split(self.k_proj(kv_in), self.kv_heads)), cos, sin)
        v = self._split(self.v_proj(kv_in), self.kv_heads)
        mask = attention_mask
        if mask is None and self.window is not None:
            query_pos, key_pos = positions[:, -Q:, None], positions[:, None, :]
            mask = ((key_pos <= query_pos) & (key_pos > query_pos - self.window)).unsqueeze(1)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        B = out.shape[0]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_type: str):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_type)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, context, cos, sin, positions, attention_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, positions, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The DFlash drafter: fc + RMSNorm over the tapped target states, Qwen3-style layers whose keys and
    values also read those states, a final RMSNorm. No embedding and no LM head: the target's are used."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(getattr(config, "block_size", None) or dflash.get("block_size", 16))
        types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, t) for t in types)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs):
        if past_key_values is not None:
            raise NotImplementedError("this drafter recomputes its context each call; pass past_key_values=None")
        B, T, _ = target_hidden.shape
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        position_ids = position_ids.expand(B, -1)
        if position_ids.shape[1] != T + noise_embedding.shape[1]:
            raise ValueError(f"position_ids has {position_ids.shape[1]} positions; the context has {T} and the "
                             f"block {noise_embedding.shape[1]}")
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self.layers:
            x = layer(x, context, cos, sin, position_ids, attention_mask)
        return self.norm(x)

    def context_features(self, hidden_states) -> torch.Tensor:
        """The drafter's target_hidden from a target forward's output_hidden_states."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0, **kwargs):
        """Greedy speculative decoding of `input_ids` [1,n] with `target`; returns [1, n + new tokens]."""
        if temperature and temperature > 0:
            raise NotImplementedError("spec_generate here decodes greedily (temperature=0.0)")
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate takes one sequence (input_ids of shape [1, n])")
        n_layers = target.config.get_text_config().num_hidden_layers
        if max(self.target_layer_ids) >= n_layers - 1:
            raise ValueError(f"target_layer_ids {self.target_layer_ids}: HF hidden_states[{n_layers}] is after the "
                             "target's final norm, not the output of its last layer")
        self.eval()
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        stops = set(stop_token_ids or [])
        prompt = input_ids.shape[1]
        out = target(input_ids, output_hidden_states=True)
        context = self.context_features(out.hidden_states)
        tokens = torch.cat([input_ids, out.logits[:, -1:].argmax(-1)], dim=1)
        while tokens.shape[1] - prompt < max_new_tokens and int(tokens[0, -1]) not in stops:
            T = context.shape[1]
            block = torch.full((1, self.block_size), self.mask_token_id, dtype=tokens.dtype, device=tokens.device)
            block[:, 0] = tokens[:, -1]
            positions = torch.arange(T + self.block_size, device=tokens.device).unsqueeze(0)
            hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=context)
            draft = head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)
            out = target(torch.cat([tokens, draft], dim=1), output_hidden_states=True)
            verified = out.logits[:, T:].argmax(-1)                  # the target's token after each position
            accepted = int((draft == verified[:, :-1]).int().cumprod(-1).sum())
            tokens = torch.cat([tokens, verified[:, :accepted + 1]], dim=1)
            context = self.context_features(out.hidden_states)[:, :T + accepted + 1]
        new = tokens[0, prompt:].tolist()[:max_new_tokens]
        for i, token in enumerate(new):
            if token in stops:
                new = new[:i + 1]
                break
        return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
