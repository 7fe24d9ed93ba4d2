"""The DFlash2 drafter: DFlash (dflash.model.drafter) plus block-local dynamic convolutions and a candidate
selector (dflash.kinds.dflash2.selector), as vLLM (qwen3_dflash2.py), SGLang (models/dflash.py) and the reference
DFlash2DraftModel compute it. docs/dflash2.md describes each part and its sources.

Every decoder layer wraps its attention and its MLP in one grouped dynamic convolution each:

    h          = input_layernorm(x)
    h, delta   = attention_conv.prepare(h)     conv with taps base_kernel[0] + delta_0(h)
    h          = self_attn(h, ...)
    h          = attention_conv.finish(h, delta)   conv with taps base_kernel[1] + delta_1(h)
    x          = x + h                          (and the same around the MLP with mlp_conv)

The convolution is causal with `conv_kernel_size` taps along the block and never crosses a block
boundary: block slot p reads slots p, p-1, ..., p-taps+1 of its own block only (the engines' "position
>= tap" mask, the block being [anchor, MASK x (bs-1)]). The tap coefficient of channel c at slot p is
base_kernel[side, tap, c] + delta[p, side, tap, c // conv_group_size], delta = kernel_projection(h)
[2 x taps x groups], both sides predicted from the sublayer's input. Initialised as the identity (unit
self-tap, zero projection), so a new DFlash2 drafter computes what the DFlash drafter computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.drafter import Drafter, DrafterConfig, DrafterLayer
from dflash.kinds.dflash2.selector import CandidateSelector, unary_logits

@dataclass(kw_only=True)
class DFlash2Config(DrafterConfig):
    """DrafterConfig plus DFlash2's keys (written into config.json's dflash_config under these names)."""

    conv_kernel_size: int = 2          # causal taps of each block-local convolution
    conv_group_size: int = 16          # channels sharing one dynamic coefficient
    selector_rank: int = 256           # rank r of the selector's codebooks
    selector_top_k: int = 16           # candidates K per slot the selector reranks
    output_multiplier: float = 1.0     # unary logits = lm_head(h) * output_multiplier ...
    final_logit_softcapping: float | None = None  # ... then softcap * tanh(x / softcap) (None: off)

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            problems.append(f"conv_kernel_size {self.conv_kernel_size} must lie in 1..block_size {self.block_size}")
        if self.selector_rank < 1:
            problems.append(f"selector_rank {self.selector_rank} must be >= 1")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            problems.append(f"selector_top_k {self.selector_top_k} must lie in 1..vocab_size {self.vocab_size}")
        if not self.output_multiplier > 0:
            problems.append(f"output_multiplier {self.output_multiplier} must be positive")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            problems.append(f"final_logit_softcapping {self.final_logit_softcapping} must be positive (or None)")
        if problems:
            raise ValueError("bad DFlash2Config: " + "; ".join(problems))


DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                "final_logit_softcapping")


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [B,L,H] (L = N*block_size, blocks back to back), delta [B,L,taps,G], base [taps,H] -> [B,L,H]:
    out[p, c] = sum_tap (base[tap, c] + delta[p, tap, c // (H/G)]) * x[p - tap, c], zero where p - tap
    falls before its block's first slot."""
    B, L, H = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    blocks = x.view(B, L // block_size, block_size, groups, H // groups)
    delta = delta.reshape(B, L // block_size, block_size, taps, groups, 1)
    out = None
    for tap in range(taps):
        shifted = blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        term = (base[tap].view(groups, H // groups).to(delta.dtype) + delta[:, :, :, tap]) * shifted
        out = term if out is None else out + term
    return out.reshape(B, L, H)


class BlockConv(nn.Module):
    """One sublayer's pair of convolutions (before: side 0, after: side 1); tensors base_kernel
    [2, taps, H] and kernel_projection.weight [2*taps*G, H], the engines' names and shapes."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.kernel_projection(h).view(*h.shape[:-1], 2, self.taps, self.groups)
        return block_conv(h, delta[..., 0, :, :], self.base_kernel[0], self.block_size), delta[..., 1, :, :]

    def finish(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(h, delta, self.base_kernel[1], self.block_size)


class DFlash2Layer(DrafterLayer):
    def __init__(self, c: DFlash2Config):
        super().__init__(c)
        self.attention_conv = BlockConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)
        self.mlp_conv = BlockConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)

    def attend(self, x: torch.Tensor, attention) -> torch.Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        return x + self.attention_conv.finish(attention(h), delta)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class DFlash2Drafter(Drafter):
    """Drafter with DFlash2Layers and a candidate_selector; forward is Drafter's (hidden states after the
    final norm); `unary` and `propose` turn hidden states into the engines' scores and proposals."""

    layer_class = DFlash2Layer

    def __init__(self, config: DFlash2Config, attention: str = "sdpa"):
        if not isinstance(config, DFlash2Config):
            raise TypeError(f"DFlash2Drafter needs a DFlash2Config, got {type(config).__name__}")
        super().__init__(config, attention=attention)
        c = config
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)
        nn.init.normal_(self.candidate_selector.hidden_projection.weight, std=c.initializer_range)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        return unary_logits(logits, self.config.output_multiplier, self.config.final_logit_softcapping)

    def candidates(self, hidden: torch.Tensor, lm_head, head_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary values, candidate ids) [B,n,K] of hidden [B,n,H] (`head_dtype`: what lm_head takes)."""
        logits = lm_head(hidden.to(head_dtype or hidden.dtype)).float()
        return self.unary(logits).topk(self.candidate_selector.top_k, dim=-1)

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head, head_dtype=None) -> torch.Tensor:
        """Greedy proposal of one block: hidden [B,n,H] of slots 1..n, anchor_ids [B] -> tokens [B,n]."""
        values, candidates = self.candidates(hidden, lm_head, head_dtype)
        return self.candidate_selector.greedy_walk(hidden, values, candidates, anchor_ids)

    def propose_sampled(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head, temperature: float,
                        generator: torch.Generator | None, head_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's proposal at temperature > 0: (tokens [n], q [n,V]) (CandidateSelector.sampled_walk)."""
        values, candidates = self.candidates(hidden, lm_head, head_dtype)
        return self.candidate_selector.sampled_walk(hidden, values, candidates, anchor_ids, temperature, generator,
                                                    self.config.vocab_size)


def dflash2_extra_params(hidden: int, vocab: int, layers: int, taps: int = 2, group: int = 16,
                         rank: int = 256) -> int:
    """Parameters a DFlash2 drafter (DFlash2Config's defaults) has beyond a DFlash drafter of the same shape:
    per layer two BlockConvs (base_kernel [2,taps,H], kernel_projection [2*taps*H/group, H]), and the selector
    (two [V, rank] codebooks, hidden_projection [rank, H])."""
    conv = 2 * taps * hidden + 2 * taps * (hidden // group) * hidden
    return layers * 2 * conv + 2 * vocab * rank + rank * hidden
