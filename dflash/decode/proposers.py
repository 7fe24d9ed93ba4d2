"""What proposes the bs-1 tokens after the anchor: a drafter, or a baseline that a drafter must beat.

A proposer sees the accepted tokens (the last one is the anchor, at position a) and, since its last
call, the tapped target states of the newly accepted positions; it returns the draft d1..d(bs-1) for
positions a+1 .. a+bs-1 and, when it sampled them, the probabilities q it sampled from ([bs-1,V]).

The drafter's context is kept incrementally (`DrafterContextCache`): the tapped states of each accepted
position go through fc + hidden_norm once, and every drafter layer keeps their keys and values (after
k_norm and RoPE at their fixed positions). A step then runs the drafter over the bs block tokens only,
attending to the cached context keys, instead of re-projecting the whole context every block;
`Drafter.forward` (the training path) is the reference it is tested against.

Each layer's own halves (DrafterLayer.attend, feed_forward) run around the cached attention, so a DFlash2
drafter's block-local convolutions run the same way. How the block's hidden states become tokens is the
drafter kind's (dflash.kinds: DFlash's LM-head argmax or sample, DFlash2's selector walk over its top-K
candidates, with q the realized rows' distributions: what the engines verify against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dflash.kinds import kind_of
from dflash.model.masks import drafter_attention_mask
from dflash.model.drafter import SLIDING, Drafter, apply_rope, rope_cos_sin


@dataclass
class Draft:
    tokens: list[int]                   # d1 .. d(bs-1)
    probs: torch.Tensor | None = None   # [bs-1,V] float32 q each token was sampled from; None: a point mass


@dataclass
class Sampler:
    """temperature 0: argmax; > 0: sample from softmax(logits / temperature) with `generator`."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[...,V] logits -> [...,V] float32 probabilities at this temperature (temperature > 0)."""
        return F.softmax(logits.float() / self.temperature, dim=-1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[N,V] logits -> [N] tokens (argmax, or one sample per row)."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits).cpu(), 1, generator=self.generator)[:, 0]


class Proposer(Protocol):
    """Anything that guesses the bs-1 tokens after the anchor (a drafter, a baseline, an oracle)."""

    block_size: int

    def propose(self, target, token_ids: list[int], new_context: torch.Tensor, sampler: Sampler):
        """token_ids: accepted tokens, the last one is the anchor; new_context [1,m,k*H]: the tapped
        states of the m positions accepted since the last call (the whole prompt on the first).
        Returns a Draft, or a plain list of block_size-1 token ids (a point mass)."""


class DrafterContextCache:
    """Per drafter layer, the context keys/values [1,kv_heads,L,head_dim] of positions 0..L-1."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.length = 0

    def extend(self, new_context: torch.Tensor) -> None:
        """Append positions L .. L+m-1 from their tapped target states [1,m,k*H]."""
        d, c = self.drafter, self.drafter.config
        m = new_context.shape[1]
        if m == 0:
            return
        ctx = d.hidden_norm(d.fc(new_context.to(d.fc.weight.dtype)))                     # [1,m,H]
        positions = torch.arange(self.length, self.length + m, device=ctx.device).unsqueeze(0)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, ctx.dtype)
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            k = apply_rope(attn.k_norm(attn._heads(attn.k_proj(ctx), c.num_key_value_heads)), cos, sin)
            v = attn._heads(attn.v_proj(ctx), c.num_key_value_heads)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.length += m

    def block_hidden(self, block_embeds: torch.Tensor, anchor: int) -> torch.Tensor:
        """[1,bs,H] embeddings of [anchor token, MASK x (bs-1)] -> [1,bs,H] after the final norm;
        the same as Drafter.forward(context[:, :anchor], block_embeds, [[anchor]])."""
        d, c = self.drafter, self.drafter.config
        if self.length != anchor:
            raise ValueError(f"the drafter's context holds {self.length} positions; the anchor at {anchor} "
                             "needs exactly the positions before it")
        bs = block_embeds.shape[1]
        x = block_embeds.to(d.fc.weight.dtype)
        positions = torch.arange(anchor, anchor + bs, device=x.device).unsqueeze(0)
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        masks = {}  # full_attention: everything visible (None); sliding: masks.py's window rule
        for kind in dict.fromkeys(c.layer_types):
            masks[kind] = None if kind != SLIDING else drafter_attention_mask(
                torch.tensor([[anchor]], device=x.device), anchor, bs, sliding_window=c.sliding_window).unsqueeze(1)
        for i, (layer, kind) in enumerate(zip(d.layers, c.layer_types)):
            x = layer.feed_forward(layer.attend(x, lambda h: self._attention(i, layer.self_attn, h, rope, masks[kind])))
        return d.norm(x)

    def _attention(self, i: int, attn, h: torch.Tensor, rope, mask) -> torch.Tensor:
        """Layer i's attention of the normed block h [1,bs,H] over the cached context and the block itself."""
        c, bs = self.drafter.config, h.shape[1]
        q = apply_rope(attn.q_norm(attn._heads(attn.q_proj(h), c.num_attention_heads)), *rope)
        k = apply_rope(attn.k_norm(attn._heads(attn.k_proj(h), c.num_key_value_heads)), *rope)
        v = attn._heads(attn.v_proj(h), c.num_key_value_heads)
        if self.keys[i] is not None:
            k, v = torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                    # [1,h,bs,hd]
        return attn.o_proj(out.transpose(1, 2).reshape(1, bs, c.num_attention_heads * c.head_dim))


class DrafterProposer:
    """A trained (or untrained) Drafter as a Proposer: one drafter pass over one block per step.

    incremental=True keeps the context in a DrafterContextCache; False re-runs Drafter.forward over
    the whole context every step (the uncached reference)."""

    def __init__(self, drafter: Drafter, incremental: bool = True):
        self.drafter = drafter.eval()
        self.kind = kind_of(drafter)  # how it turns a block's hidden states into tokens
        self.block_size = drafter.config.block_size  # the one it learned its masked positions for
        self.incremental = incremental
        self.begin()

    def begin(self) -> None:
        """A new sequence starts: forget the context."""
        self._cache = DrafterContextCache(self.drafter)
        self._context: torch.Tensor | None = None

    @torch.no_grad()
    def propose(self, target, token_ids: list[int], new_context: torch.Tensor, sampler: Sampler) -> Draft:
        anchor = len(token_ids) - 1
        block = torch.tensor([[token_ids[-1]] + [target.mask_token_id] * (self.block_size - 1)],
                             device=target.device)
        if self.incremental:
            self._cache.extend(new_context)
            hidden = self._cache.block_hidden(target.embed(block), anchor)                   # [1,bs,H]
        else:
            self._context = new_context if self._context is None else torch.cat([self._context, new_context], 1)
            hidden = self.drafter(self._context, target.embed(block), torch.tensor([[anchor]], device=target.device))
        return Draft(*self.kind.propose(self.drafter, hidden, token_ids[-1], target, sampler))


class RepeatLastProposer:
    """Baseline: guess that the anchor token repeats bs-1 times (what a drafter must clearly beat)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def propose(self, target, token_ids: list[int], new_context: torch.Tensor, sampler: Sampler) -> list[int]:
        return [token_ids[-1]] * (self.block_size - 1)


def as_proposer(drafter, incremental: bool = True) -> Proposer:
    if isinstance(drafter, Drafter):
        return DrafterProposer(drafter, incremental)
    if hasattr(drafter, "propose") and hasattr(drafter, "block_size"):
        return drafter
    raise TypeError(f"expected a Drafter or a proposer (.propose, .block_size), got {type(drafter).__name__}")
