"""DFlash2 drafter for `transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)`.

dflash-images writes this file beside a DFlash2 drafter's config.json as `modeling_dflash2.py` (config.json's
"auto_map" names it), so the drafter loads without this project installed. Like modeling_dflash.py
(dflash/kinds/dflash/remote_dflash.py) it imports only torch and transformers, and it stands alone: transformers copies
a remote-code file into its module cache, and this one needs no other file beside it.

    model = AutoModel.from_pretrained(DIR, trust_remote_code=True)      # a DFlash2DraftModel
    hidden = model(position_ids=..., noise_embedding=..., target_hidden=...)
    tokens = model.propose(hidden[:, 1:], anchor_ids, target.lm_head)   # the greedy selector walk
    out = model.spec_generate(target=target, input_ids=ids, max_new_tokens=64, stop_token_ids=[eos])

forward() takes what modeling_dflash.py's DFlashDraftModel takes: `target_hidden` [B,T,k*H], the target's
tapped layers at positions 0..T-1 (layer id l = the output of target layer l, HF hidden_states[l + 1]),
concatenated in dflash_config.target_layer_ids order; `noise_embedding` [B,Q,H], the target's embeddings of
the block [anchor, MASK x (Q-1)]; `position_ids` [B,T+Q]. It returns the hidden states of the block after the
final norm. What DFlash2 adds (docs/dflash2.md):

  - every attention and MLP sublayer sits between two block-local dynamic convolutions: block slot p reads
    slots p, p-1, ..., p-taps+1 of its own block (blocks of dflash_config's block_size, back to back in
    noise_embedding), tap coefficient base_kernel[side, tap, c] + kernel_projection(h)[p, side, tap, group
    of c], both sides predicted from the sublayer's input h;
  - unary logits = softcap(lm_head(hidden) * output_multiplier); the top selector_top_k are the candidates;
  - the candidate selector scores S_t(a, b) = U_t(b) + < P[a] * W h_t, Q[b] > and the greedy walk takes, slot
    by slot, the best candidate after the token just taken (the anchor before slot 1).

No KV cache: each call recomputes the context's keys and values. spec_generate() is greedy speculative
decoding with any causal-LM target (output = the target's greedy continuation); it shows what the drafter
proposes and what the target accepts, not serving speed.
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


def _fill(param: torch.Tensor, value: torch.Tensor) -> None:
    """Initialise `param` to `value` unless from_pretrained already loaded it (transformers 5 flags those)."""
    if not getattr(param, "_is_hf_initialized", False):
        with torch.no_grad():
            param.copy_(value)


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [B,Q,H], delta [B,Q,taps,G], base [taps,H] -> [B,Q,H]: out[p, c] = sum_tap (base[tap, c] +
    delta[p, tap, c // (H/G)]) * x[p - tap, c], zero where p - tap falls before its block's first slot.
    A last block shorter than block_size is padded and cut again (the convolution only reads back)."""
    B, Q, H = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    pad = -Q % block_size
    if pad:
        x, delta = F.pad(x, (0, 0, 0, pad)), F.pad(delta, (0, 0, 0, 0, 0, pad))
    L = Q + pad
    blocks = x.view(B, L // block_size, block_size, groups, H // groups)
    delta = delta.reshape(B, L // block_size, block_size, taps, groups, 1)
    out = None
    for tap in range(taps):
        shifted = blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        term = (base[tap].view(groups, H // groups).to(delta.dtype) + delta[:, :, :, tap]) * shifted
        out = term if out is None else out + term
    return out.reshape(B, L, H)[:, :Q]


class KernelProjection(nn.Linear):
    """The Linear that predicts the dynamic taps; its own class so that _init_weights zeroes it."""


class DFlash2Conv(nn.Module):
    """One sublayer's pair of convolutions (before: side 0, after: side 1): base_kernel [2, taps, H],
    kernel_projection.weight [2*taps*G, H] (G = H / conv_group_size)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = KernelProjection(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.kernel_projection(h).view(*h.shape[:-1], 2, self.taps, self.groups)
        return block_conv(h, delta[..., 0, :, :], self.base_kernel[0], self.block_size), delta[..., 1, :, :]

    def finish(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(h, delta, self.base_kernel[1], self.block_size)


class DFlash2Attention(nn.Module):
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


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_type: str, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlash2Attention(config, layer_type)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.attention_conv = DFlash2Conv(config.hidden_size, taps, group_size, block_size)
        self.mlp_conv = DFlash2Conv(config.hidden_size, taps, group_size, block_size)

    def forward(self, x, context, cos, sin, positions, attention_mask=None):
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, cos, sin, positions, attention_mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class DFlash2CandidateSelector(nn.Module):
    """S_t(a, b) = U_t(b) + < P[a] * W h_t, Q[b] >: P, Q the predecessor / successor codebooks [V, r] (no
    ".weight", as on disk), W = hidden_projection [r, H]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def lattice(self, hidden, unary, candidates, anchor_ids) -> torch.Tensor:
        """hidden [B,n,H], unary/candidates [B,n,K], anchor_ids [B] -> [B,n,K,K] (float32 or wider):
        [b,t,p,c] = S_t(predecessor p, candidate c), slot 0's predecessors all the anchor, slot t's the
        candidates of slot t-1."""
        K = candidates.shape[-1]
        preds = torch.cat([anchor_ids[:, None, None].expand(-1, 1, K), candidates[:, :-1]], dim=1)
        gate = self.predecessor_codebook[preds] * self.hidden_projection(hidden).unsqueeze(2)
        dt = torch.promote_types(gate.dtype, torch.float32)
        pair = torch.einsum("btpr,btcr->btpc", gate.to(dt), self.successor_codebook[candidates].to(dt))
        return unary.to(dt).unsqueeze(2) + pair

    def greedy_walk(self, hidden, unary, candidates, anchor_ids) -> torch.Tensor:
        """tokens [B,n]: slot 0 the best candidate after the anchor, slot t the best after slot t-1's pick."""
        lattice = self.lattice(hidden, unary, candidates, anchor_ids)
        index = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
        picks = []
        for t in range(hidden.shape[1]):
            row = lattice[:, t].gather(1, index[:, None, None].expand(-1, 1, lattice.shape[-1])).squeeze(1)
            index = row.argmax(-1)
            picks.append(index)
        return candidates.gather(-1, torch.stack(picks, dim=1).unsqueeze(-1)).squeeze(-1)


class DFlash2DraftModel(Qwen3PreTrainedModel):
    """The DFlash2 drafter: fc + RMSNorm over the tapped target states, Qwen3-style layers whose keys and
    values also read those states, each sublayer between two block-local convolutions, a final RMSNorm, and
    a candidate selector. No embedding and no LM head: the target's are used."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(getattr(config, "block_size", None) or dflash.get("block_size", 16))
        self.output_multiplier = float(dflash.get("output_multiplier") or 1.0)
        self.final_logit_softcapping = dflash.get("final_logit_softcapping") or None
        taps, group = int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
        types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config, t, taps, group, self.block_size) for t in types)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.candidate_selector = DFlash2CandidateSelector(config.vocab_size, config.hidden_size,
                                                           int(dflash["selector_rank"]), int(dflash["selector_top_k"]))
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """A new drafter's convolutions are the identity (unit self-tap, zero projection) and its selector a
        no-op (zero successor codebook), as this project and NeMo Automodel initialise them."""
        if isinstance(module, KernelProjection):
            _fill(module.weight, torch.zeros_like(module.weight))
        elif isinstance(module, DFlash2Conv):
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            _fill(module.base_kernel, identity)
        elif isinstance(module, DFlash2CandidateSelector):
            _fill(module.predecessor_codebook, torch.randn_like(module.predecessor_codebook) * 0.02)
            _fill(module.successor_codebook, torch.zeros_like(module.successor_codebook))
        else:
            super()._init_weights(module)

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

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits * output_multiplier, then softcap * tanh(x / softcap) when final_logit_softcapping is set."""
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def candidates(self, hidden: torch.Tensor, lm_head) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary values, candidate ids), each [B,n,K], of hidden [B,n,H] under the target's `lm_head`."""
        weight = getattr(lm_head, "weight", None)
        logits = lm_head(hidden.to(weight.dtype if weight is not None else hidden.dtype)).float()
        return self.unary_logits(logits).topk(self.candidate_selector.top_k, dim=-1)

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head) -> torch.Tensor:
        """The greedy proposal: hidden [B,n,H] of the block's slots 1..n, anchor_ids [B] -> tokens [B,n]."""
        values, candidates = self.candidates(hidden, lm_head)
        return self.candidate_selector.greedy_walk(hidden, values, candidates, anchor_ids)

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
            draft = self.propose(hidden[:, 1:], tokens[:, -1], head)
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
