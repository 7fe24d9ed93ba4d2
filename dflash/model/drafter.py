"""The DFlash drafter: a few Qwen3-style layers that denoise a block [anchor, MASK x (bs-1)] in one pass.

The drafter has no embedding and no LM head of its own: block tokens come in as the target's frozen
embeddings, and `target.lm_head(drafter(...))` gives the logits. What it adds is "KV injection":

    context [B,T,k*H] --fc--> RMSNorm --> ctx [B,T,H]           (tapped target layers -> one feature)
    block   [B,Q,H]   (Q = N*bs)
    every layer:  Q   = q_proj(block)
                  K,V = k_proj/v_proj(concat(ctx, block))     -> attention under masks.drafter_attention_mask
    final RMSNorm -> hidden [B,Q,H]

RoPE positions: context position j sits at j; token k of the block anchored at a sits at a+k, so a block
"continues" the context exactly where the target would.

Layer types (`DrafterConfig.layer_types`): a full_attention layer sees its whole block and the context
before the anchor; a sliding_attention layer sees keys at positions p-W+1 .. p only, causal inside the
block (masks.py draws both). The module tree and the config fields are the reference DFlash layout's
(tensor names `layers.N.mlp.gate_proj.weight` etc., config keys `num_hidden_layers` etc.), so
`dflash.io.drafter_dir` writes and reads what vLLM and SGLang serve without renaming anything.

Attention runs one of two ways over the same mask (`Drafter(config, attention=...)`):
  sdpa  the dense boolean mask [B,1,Q,T+Q] through F.scaled_dot_product_attention: every query pays for
        all T+Q keys, although a block sees only the context before its anchor and its own bs tokens;
  flex  the mask as a flex_attention BlockMask (128x128 tiles; tiles with nothing visible are skipped)
        and flex_attention compiled to Triton kernels, GQA without expanding K/V. On a GPU this skips
        most of the work (README "Performance"); on a CPU it runs flex's eager reference (tests only).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash.model.masks import drafter_attention_mask
from dflash.model.segments import Segments

ATTENTION = ("sdpa", "flex")
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of a drafter plus what ties it to its target. Field names are the keys of the reference
    config.json (dflash.io.drafter_dir writes them; target_layer_ids and mask_token_id nest in dflash_config)."""

    hidden_size: int                  # the drafter's width = the target's H (it shares embed/lm_head)
    num_hidden_layers: int = 5        # drafter decoder layers
    num_attention_heads: int          # query heads
    num_key_value_heads: int          # key/value heads (GQA: num_attention_heads % num_key_value_heads == 0)
    head_dim: int                     # per-head width (even: RoPE rotates pairs)
    intermediate_size: int            # SwiGLU MLP width
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960  # longest sequence the engines size RoPE for (the target's)
    vocab_size: int                   # rows of the target's embedding / head
    block_size: int                   # tokens per block: the anchor + bs-1 masked positions (no default:
                                      # the trainer's --block-size is the one default)
    num_target_layers: int            # decoder layers of the target
    target_layer_ids: list[int] = field(default_factory=list)  # tapped target layers, ascending; id l =
                                      # output of decoder layer l (HF hidden_states[l + 1]; not the last)
    mask_token_id: int                # the MASK token filling positions 1..bs-1 of a block
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention or sliding_attention
                                      # (empty: all full_attention)
    sliding_window: int | None = None  # tokens a sliding_attention query sees, itself included
    initializer_range: float = 0.02   # std of the normal init of every Linear
    target_fingerprint: str = ""      # Target.fingerprint of the target trained for ("" when unknown)

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.layer_types = list(self.layer_types) or [FULL] * self.num_hidden_layers
        if SLIDING not in self.layer_types and self.sliding_window is not None:
            self.sliding_window = None  # no layer uses it; keep one spelling of "no window"
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} must be >= 2 (an anchor and a masked token)")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty; use Target.layer_ids")
        elif self.target_layer_ids != sorted(set(self.target_layer_ids)):
            # vLLM and SGLang collect the tapped states in layer order, whatever order the config lists.
            problems.append(f"target_layer_ids {self.target_layer_ids} must be distinct and ascending "
                            "(the engines concatenate the tapped layers in layer order)")
        if any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} must lie in 0..{self.num_target_layers - 1} "
                            f"(num_target_layers {self.num_target_layers})")
        if self.num_hidden_layers < 1:
            problems.append(f"num_hidden_layers {self.num_hidden_layers} must be >= 1")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            problems.append(f"layer_types {self.layer_types} must name {self.num_hidden_layers} layers, each one "
                            f"of {', '.join(LAYER_TYPES)}")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            problems.append(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if problems:
            raise ValueError("bad DrafterConfig: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, names, 1)) else k
                     for k in unknown]
            raise ValueError(f"unknown DrafterConfig keys: {', '.join(hints)}")
        return cls(**data)

    @classmethod
    def from_target(cls, target, **overrides) -> "DrafterConfig":
        """A drafter shaped like the target's attention layers; any field can be overridden."""
        cfg = target.config
        heads = int(cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        values = dict(
            hidden_size=target.hidden_size,
            num_attention_heads=heads, num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or target.hidden_size // heads),
            intermediate_size=int(cfg.intermediate_size), rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 1_000_000.0))),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 40960),
            vocab_size=target.vocab_size, num_target_layers=target.num_layers,
            target_layer_ids=list(target.layer_ids), mask_token_id=target.mask_token_id,
            target_fingerprint=target.fingerprint,
        )
        values.update(overrides)
        return cls(**values)


class RMSNorm(nn.Module):
    """Qwen-style RMSNorm: normalise in float32, scale, cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B,L] long -> (cos, sin) each [B,1,L,head_dim] (halves duplicated, as in Qwen3)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq                       # [B,L,hd/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)                # [B,1,L,hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,h,L,hd] rotated by (cos, sin) [B,1,L,hd]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


_compiled_flex = None


def flex_attention_fn(device: torch.device):
    """flex_attention, compiled for CUDA (eager flex is a dense reference, only fit for tests)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention  # inside a compiled layer it is traced into the layer's graph
    if _compiled_flex is None:
        # dynamic=None: the first shape compiles static kernels, a second shape one dynamic set, so
        # batches of varying length do not recompile every step.
        _compiled_flex = torch.compile(flex_attention, dynamic=None)
    return _compiled_flex


# flex_attention's backward tiles where bench/bench_flex.py measured a better choice than torch's default,
# by (compute capability, head_dim). SM 9.0, head_dim 256 (Qwen3.5's): torch picks 64x64 tiles, 2 stages,
# 4 warps; 8 warps on the same tiles ran the backward at the 27B shape in 19.6 ms a layer instead of
# 26.4 (1.35x), output and gradients identical. Elsewhere torch's default stands (None).
FLEX_BACKWARD_TILES = {
    ((9, 0), 256): {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                    "bwd_num_stages": 2, "bwd_num_warps": 8},
}


# Compiled flex_attention finds no kernel tile for fewer query rows (torch 2.11 on an H100: 96 rows failed with
# "No choices exist for backend" at head_dim 16 and 128; 128 and 192 ran). A forward of fewer drafter query
# rows (anchors x block size: a padded batch of short answers) takes sdpa with the same mask instead.
FLEX_MIN_QUERY_ROWS = 128


def flex_kernel_options(device: torch.device, head_dim: int) -> dict | None:
    """kernel_options for flex_attention on `device` at this head width (None: torch's defaults)."""
    if device.type != "cuda":
        return None
    return FLEX_BACKWARD_TILES.get((torch.cuda.get_device_capability(device), head_dim))


def flex_block_mask(mask: torch.Tensor):
    """A dense [B,Q,KV] boolean mask (True = may attend) as a flex_attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, Q, KV = mask.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, B, None, Q, KV, device=mask.device)


class DrafterAttention(nn.Module):
    """GQA attention: queries from the block, keys/values from concat(context features, block)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.c.head_dim).transpose(1, 2)                 # [B,n,L,hd]

    def forward(self, x, ctx, rope_q, rope_kv, mask) -> torch.Tensor:
        """x [B,Q,H], ctx [B,T,H], rope_q/rope_kv (cos, sin) for Q / T+Q positions, mask [B,1,Q,T+Q]
        (boolean, for SDPA) or (flex BlockMask, flex kernel options) -> [B,Q,H]."""
        c = self.c
        kv_in = torch.cat([ctx, x], dim=1)                                      # [B,T+Q,H]
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), c.num_attention_heads)), *rope_q)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(kv_in), c.num_key_value_heads)), *rope_kv)
        v = self._heads(self.v_proj(kv_in), c.num_key_value_heads)
        groups = c.num_attention_heads // c.num_key_value_heads
        if isinstance(mask, torch.Tensor):
            # Expanded K/V instead of enable_gqa: every SDPA backend takes a boolean mask this way.
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)       # [B,h,Q,hd]
        else:
            # flex_attention is no autocast op: give it one dtype (the projections' autocast dtype).
            q, k = q.to(v.dtype), k.to(v.dtype)
            block_mask, options = mask
            out = flex_attention_fn(q.device)(q, k, v, block_mask=block_mask, enable_gqa=groups > 1, kernel_options=options)
        B, _, Q, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, c.num_attention_heads * c.head_dim))


class DrafterMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), the `mlp` of a Qwen3 layer (its tensors: layers.N.mlp.*)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer with context injection into K/V."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DrafterAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DrafterMLP(c)

    def forward(self, x, ctx, rope_q, rope_kv, mask) -> torch.Tensor:
        return self.feed_forward(self.attend(x, lambda h: self.self_attn(h, ctx, rope_q, rope_kv, mask)))

    def attend(self, x: torch.Tensor, attention) -> torch.Tensor:
        """The attention half: x + attention(input_layernorm(x)). `attention` maps the normed block to the
        attention's output; decoding passes one that reads cached context keys (dflash.decode.proposers)."""
        return x + attention(self.input_layernorm(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half: x + mlp(post_attention_layernorm(x))."""
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """fc + RMSNorm over the tapped target states, `num_hidden_layers` DrafterLayers, a final RMSNorm."""

    layer_class = DrafterLayer  # a drafter kind with other layers (dflash.kinds.dflash2.dflash2_drafter) names its own
    # The first `recompute_layers` decoder layers keep only their input for the backward, which runs each of
    # them forward again (activation checkpointing, non-reentrant; a compiled layer reruns its compiled
    # graph): about 4 GB less per layer at the 27B shape with 1,024 anchors x block 16 (8 GB for DFlash2, by
    # dflash.plan.memory), for one more layer forward. How, not what: not part of the checkpoint; the same
    # numbers either way. Set per run from --recompute-layers (dflash.train.lane).
    recompute_layers: int = 0

    def __init__(self, config: DrafterConfig, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, not {attention!r}")
        self.config = config
        self.attention = attention  # how, not what: not part of the checkpoint
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=c.initializer_range)

    def forward(
        self,
        context: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        context_valid: torch.Tensor | None = None,
        anchor_valid: torch.Tensor | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        """Denoise N blocks per sequence in one pass.

        context:       [B,T,k*H] tapped target hidden states (Target.context)
        block_embeds:  [B,N*bs,H] target embeddings of [anchor, MASK x (bs-1)] for each block
        anchors:       [B,N] long, anchor positions (block n's token k sits at anchors[:, n] + k)
        context_valid: [B,T] bool or None;  anchor_valid: [B,N] bool or None
        segments:      the sequences of packed rows (dflash.model.segments), or None (one sequence a row):
                       RoPE positions restart at every sequence and a block sees its own sequence only
        returns        [B,N*bs,H] hidden states after the final norm; logits = target.lm_head(hidden)
        """
        c = self.config
        B, T, width = context.shape
        N, bs = anchors.shape[1], c.block_size
        if width != len(c.target_layer_ids) * c.hidden_size:
            raise ValueError(f"context is {width} wide, expected {len(c.target_layer_ids)} tapped layers x "
                             f"{c.hidden_size}; was the target loaded with layer_ids={c.target_layer_ids}?")
        if block_embeds.shape[:2] != (B, N * bs):
            raise ValueError(f"block_embeds is {tuple(block_embeds.shape)}, expected [B,N*bs,H] = "
                             f"[{B},{N * bs},{c.hidden_size}] for {N} anchors and block_size {bs}")
        ctx = self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))         # [B,T,H]
        x = block_embeds.to(ctx.dtype)

        if segments is None:  # an anchor may sit past the context (decoding: the last accepted token)
            ctx_pos, context_start, anchor_pos = torch.arange(T, device=anchors.device).expand(B, T), None, anchors
        else:
            if segments.shape != (B, T):
                raise ValueError(f"segments describe {segments.shape} tokens, the context is [{B},{T}]")
            ctx_pos, context_start = segments.position_ids, torch.gather(segments.starts, 1, anchors)
            anchor_pos = torch.gather(ctx_pos, 1, anchors)
        block_pos = (anchor_pos.unsqueeze(-1) + torch.arange(bs, device=anchors.device)).reshape(B, N * bs)
        rope_q = rope_cos_sin(block_pos, c.head_dim, c.rope_theta, x.dtype)
        rope_kv = rope_cos_sin(torch.cat([ctx_pos, block_pos], dim=1), c.head_dim, c.rope_theta, x.dtype)
        masks = {}  # one per layer type in use: full_attention, sliding_attention (masks.py)
        flex = self.attention == "flex" and N * bs >= FLEX_MIN_QUERY_ROWS
        for kind in dict.fromkeys(c.layer_types):
            window = c.sliding_window if kind == SLIDING else None
            mask = drafter_attention_mask(anchors, T, bs, context_valid, anchor_valid, sliding_window=window,
                                          context_start=context_start)
            masks[kind] = ((flex_block_mask(mask), flex_kernel_options(mask.device, c.head_dim))
                           if flex else mask.unsqueeze(1))

        for i, (layer, kind) in enumerate(zip(self.layers, c.layer_types)):
            if i < self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, ctx, rope_q, rope_kv, masks[kind], use_reentrant=False)
            else:
                x = layer(x, ctx, rope_q, rope_kv, masks[kind])
        return self.norm(x)

    def compile_layers(self) -> "Drafter":
        """Compile each decoder layer with torch.compile (regional compilation: the five layers share one
        compiled graph; norms, RoPE, SiLU x up and the residual adds fuse into a few kernels, flex
        attention is traced in). Module and tensor names are unchanged, so checkpoints are too.

        Static shapes (dynamic=False): packed rows (dflash.data.packs) have one shape, compiled once; padded
        batches compile each new shape (up to dynamo's recompile limit, then the layer runs uncompiled).
        Never dynamic: inductor's dynamic-shape backward of this layer fails on a GPU at the second shape
        (torch 2.11: "shape '[2048, 256]' is invalid for input of size 1024")."""
        for layer in self.layers:
            layer.compile(dynamic=False)
        return self
