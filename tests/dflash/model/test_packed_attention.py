"""The target's full attention over packs (dflash.model.packed_attention): flash attention's varlen kernel
on a GPU equals sdpa under the block-diagonal causal mask; everywhere else it is sdpa itself."""

from __future__ import annotations

import pytest
import torch

from dflash.model.packed_attention import ATTENTION, attention, use_packed_attention

LENGTHS = [300, 1, 450, 249]  # one row of 1,000 tokens: four sequences, one of a single token


def _qkv(device, dtype, heads=8, kv_heads=2, head_dim=256):
    g = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    q, k, v = (torch.randn(1, h, T, head_dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(LENGTHS, device=device))
    i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    mask = ((j <= i) & (j >= starts[:, None]))[None, None]  # [1,1,T,T] block-diagonal causal
    packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}
    return q, k, v, mask, packed


class _Module(torch.nn.Module):  # what transformers' sdpa reads from an attention layer
    is_causal = True
    num_key_value_groups = 4


def _sdpa(q, k, v, mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(_Module(), q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


def test_off_a_gpu_a_pack_runs_sdpa_under_its_mask():
    q, k, v, mask, packed = _qkv("cpu", torch.float32, head_dim=64)
    out, _ = attention(_Module(), q, k, v, mask, scaling=64 ** -0.5, **packed)
    assert torch.equal(out, _sdpa(q, k, v, mask))


def test_only_a_model_on_sdpa_is_switched(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.support.dflash_tiny import save_tiny_target

    path = save_tiny_target(tmp_path, "qwen3_5")
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    assert use_packed_attention(sdpa) and sdpa.config._attn_implementation == ATTENTION
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"


@pytest.mark.gpu
def test_on_a_gpu_a_pack_runs_the_varlen_kernel_and_equals_masked_sdpa(monkeypatch):
    """bf16, grouped-query heads 8/2, head_dim 256 (the 27B shape's): the varlen kernel against an fp32 sdpa
    under the block-diagonal mask, and bf16 masked sdpa against the same reference for scale."""
    import torch.nn.attention.varlen as varlen

    calls = []
    real = varlen.varlen_attn
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, mask, packed = _qkv("cuda", torch.bfloat16)
    out, _ = attention(_Module(), q, k, v, mask, scaling=256 ** -0.5, **packed)
    assert calls, "the varlen kernel did not run"
    reference = _sdpa(q.float(), k.float(), v.float(), mask)
    masked_bf16 = _sdpa(q, k, v, mask)
    err, err_sdpa = ((x.float() - reference).abs().max().item() for x in (out, masked_bf16))
    print(f"\nmax |varlen - fp32 masked sdpa| {err:.3e}; bf16 masked sdpa {err_sdpa:.3e}")
    assert err <= max(2 * err_sdpa, 1e-2)
