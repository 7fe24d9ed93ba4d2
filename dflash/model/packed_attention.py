"""The target's full-attention layers over packed rows: flash attention's varlen kernel, sdpa otherwise.

transformers gives a pack's full-attention layers a block-diagonal causal mask built from the restarting
position ids. With any mask, sdpa cannot take its flash kernel (that one reads only `is_causal`), so on a
GPU a pack of 8,192 tokens ran the memory-efficient kernel over all 8,192 x 8,192 scores, masked ones
included: the 27B-shape step took 6 % longer on packs than on the fixed 2 x 4096 rows it was held to.
transformers' own varlen path needs the flash-attn package, which the image does not carry; torch ships
the same kernel as `torch.nn.attention.varlen.varlen_attn`, which reads the sequence starts (`cu_seqlens`)
the pack already passes, skips every tile across a boundary and takes grouped-query heads as they are.

    ATTENTION                      the name the target's config gets: registered with transformers'
                                   AttentionInterface and, with sdpa's mask, its AttentionMaskInterface
    attention(module, q, k, v, mask, **kwargs)
        kwargs with cu_seq_lens_q, q on CUDA in fp16/bf16, head_dim <= 256
                                   varlen_attn over the flattened B*T tokens, causal in every sequence
        anything else              transformers' sdpa_attention_forward, unchanged (CPU, fp32, a cached
                                   or padded pass)
    use_packed_attention(model)    set it on a loaded model whose attention is sdpa (others stay)
"""

from __future__ import annotations

import torch

ATTENTION = "sdpa_varlen"
_FLASH_HEAD_DIM = 256  # the widest head flash attention's kernels take


def _flash_varlen_fits(query: torch.Tensor, kwargs: dict, dropout: float) -> bool:
    return (kwargs.get("cu_seq_lens_q") is not None and query.is_cuda and dropout == 0.0
            and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] <= _FLASH_HEAD_DIM and query.shape[-1] % 8 == 0
            and torch.cuda.get_device_capability(query.device) >= (8, 0))


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [B,H,T,D], key/value [B,Hkv,T,D] -> ([B,T,H,D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _flash_varlen_fits(query, kwargs, dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    B, H, T, D = query.shape
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"])

    def flat(x):  # [B,h,T,D] -> [B*T,h,D]
        return x.transpose(1, 2).reshape(B * T, x.shape[1], D)

    out = varlen_attn(flat(query), flat(key), flat(value), cu_q.to(torch.int32), cu_k.to(torch.int32),
                      int(kwargs["max_length_q"]), int(kwargs.get("max_length_k", kwargs["max_length_q"])),
                      scale=scaling, window_size=(-1, 0))
    return out.view(B, T, H, D), None


def use_packed_attention(model) -> bool:
    """Route `model`'s sdpa attention through `attention` (registered once); True when it was switched.
    A model on another implementation (eager, flex, flash-attn) keeps it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return True
