"""Packed target passes: every sequence of a pack gets the tapped states it has alone (dflash.model.segments).

The pack below puts sequences of different lengths back to back in two rows, each row ending in padding;
sequences run across the delta rule's 64-token chunks and start inside them. The negative controls show
the comparison catches a leak: the same pack without segments, or with the convolution's or the delta
rule's sequence routing switched off, fails it.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dflash.model.packed_attention import ATTENTION
from dflash.model.segment_kernels import conv1d_by_segment, delta_rule_by_segment
from dflash.model.segments import Segments
from dflash.model.target import Target, TargetError
from tests.support.dflash_tiny import save_tiny_target

T = 130
LENGTHS = [[70, 5, 1, 40], [3, 90, 17]]  # 14 and 20 padding tokens at the rows' ends
TOL = 1e-5


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Both tiny targets tapping every layer (the hybrid's full-attention layers are 3 and 7)."""
    out = {}
    for kind, layers in (("qwen3_5", 8), ("qwen3", 6)):
        path = save_tiny_target(tmp_path_factory.mktemp(kind), kind)
        out[kind] = Target.load(path, layer_ids=list(range(layers)))
    return out


def _pack(device="cpu"):
    ids = torch.randint(4, 96, (len(LENGTHS), T), generator=torch.Generator().manual_seed(0))
    return ids.to(device), Segments.from_lengths(LENGTHS, T, device=device)


def _deviations(target, ids, packed) -> dict[tuple[int, int], torch.Tensor]:
    """{(row, sequence): [layers] max |packed - alone|} over each real sequence's tokens."""
    H, k = target.hidden_size, len(target.layer_ids)
    out, scale = {}, {}
    for b, row in enumerate(LENGTHS):
        at = 0
        for n_seq, n in enumerate(row):
            alone = target.context(ids[b:b + 1, at:at + n]).float()
            diff = (packed[b:b + 1, at:at + n].float() - alone).abs().view(n, k, H)
            out[b, n_seq] = diff.amax(dim=(0, 2))
            scale[b, n_seq] = alone.abs().view(n, k, H).amax(dim=(0, 2))
            at += n
    return out, scale


def _worst(deviations) -> float:
    return max(float(d.max()) for d in deviations.values())


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_each_packed_sequence_has_the_states_it_has_alone(kind, targets):
    target = targets[kind]
    ids, segments = _pack()
    deviations, _ = _deviations(target, ids, target.context(ids, segments=segments))
    assert _worst(deviations) < TOL, deviations


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_without_segments_a_later_sequence_sees_the_ones_before_it(kind, targets):
    """The negative control: the same pack run as one sequence a row (positions running on)."""
    target = targets[kind]
    ids, _ = _pack()
    deviations, _ = _deviations(target, ids, target.context(ids))
    assert float(deviations[0, 0].max()) < TOL and float(deviations[1, 0].max()) < TOL  # the first is causal
    assert float(deviations[0, 3].max()) > 100 * TOL and float(deviations[1, 1].max()) > 100 * TOL


@pytest.mark.parametrize("leak", ["causal_conv1d_fn", "chunk_gated_delta_rule"])
def test_a_convolution_or_delta_rule_state_leaking_across_a_boundary_fails_the_comparison(leak, targets,
                                                                                          monkeypatch):
    """With one kernel function's sequence routing switched off (the plain torch reference, which ignores
    seq_idx / cu_seqlens), the hybrid's packed states move away from the sequences' own."""
    from dflash.model.kernels import kernel_functions

    target = targets["qwen3_5"]
    module = sys.modules[type(target.model).__module__]
    fn = next(f for f in kernel_functions(module) if f.name == leak)
    monkeypatch.setattr(module, fn.attr, fn.torch_function)
    ids, segments = _pack()
    deviations, _ = _deviations(target, ids, target.context(ids, segments=segments))
    assert float(deviations[0, 0].max()) < TOL      # the first sequence of a row has nothing to leak from
    # the delta rule's state decays fast in the random tiny model: its leak is ~1e-4, still 10x over TOL
    assert _worst(deviations) > 5 * TOL, deviations


def test_the_full_attention_mask_is_block_diagonal_causal(targets):
    """With segments and no attention mask, transformers finds the packed sequences from the restarting
    position ids (masking_utils.find_packed_sequence_indices): token i of a row sees j iff
    start(i) <= j <= i."""
    from transformers.masking_utils import create_causal_mask

    target = targets["qwen3_5"]
    ids, segments = _pack()
    config = target.model.config.get_text_config()
    assert config._attn_implementation == ATTENTION  # sdpa's mask; its flash varlen kernel on a GPU
    mask = create_causal_mask(config=config, inputs_embeds=target.embed(ids), attention_mask=None, cache=None,
                              position_ids=segments.position_ids)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    expected = (j <= i) & (j >= segments.starts[:, :, None])
    assert mask.dtype == torch.bool and torch.equal(mask[:, 0], expected)


def test_segment_kernels_keep_each_sequence_and_its_final_state():
    """The per-sequence references directly: per-sequence outputs and fla's [N,...] final states."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from dflash.model.kernels import kernel_functions

    refs = {fn.name: fn.torch_function for fn in kernel_functions(qwen)}
    g = torch.Generator().manual_seed(1)
    segments = Segments.from_lengths([[5, 9], [14]], 16)
    x, w = torch.randn(2, 6, 16, generator=g), torch.randn(6, 4, generator=g)
    out = conv1d_by_segment(refs["causal_conv1d_fn"], x, w, None, "silu", segments.seq_idx)
    assert torch.equal(out[:1, :, 5:14], refs["causal_conv1d_fn"](x[:1, :, 5:14], w, None, activation="silu"))
    with pytest.raises(ValueError, match="seq_idx must be"):
        conv1d_by_segment(refs["causal_conv1d_fn"], x, w, None, "silu", segments.seq_idx[:, :8])

    q, k = torch.randn(2, 2, 16, 2, 8, generator=g).unbind(0)
    v = torch.randn(2, 16, 2, 8, generator=g)
    gate, beta = -torch.rand(2, 16, 2, generator=g), torch.rand(2, 16, 2, generator=g)
    rule = refs["chunk_gated_delta_rule"]
    out, final = delta_rule_by_segment(rule, q, k, v, gate, beta, cu_seqlens=segments.cu_seqlens,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    alone, alone_final = rule(q[:1, 5:14], k[:1, 5:14], v[:1, 5:14], g=gate[:1, 5:14], beta=beta[:1, 5:14],
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert final.shape == (5, 2, 8, 8)  # one state per segment: 5, 9, padding 2 | 14, padding 2
    assert torch.equal(out[:1, 5:14], alone) and torch.equal(final[1:2], alone_final)
    with pytest.raises(ValueError, match="rise from 0 to B\\*T=32"):
        delta_rule_by_segment(rule, q, k, v, gate, beta, cu_seqlens=torch.tensor([0, 5, 30]))


def test_segments_refuse_a_mask_a_cache_or_another_shape(targets):
    target = targets["qwen3"]
    ids, segments = _pack()
    with pytest.raises(TargetError, match="segments OR attention_mask"):
        target.context(ids, torch.ones_like(ids), segments=segments)
    with pytest.raises(TargetError, match=r"segments describe \(2, 130\) tokens, input_ids are \(2, 64\)"):
        target.context(ids[:, :64], segments=segments)
    with pytest.raises(TargetError, match="without a cache"):
        target._run(ids, segments=segments, use_cache=True)


def test_a_drafter_view_passes_the_segments_on(targets):
    from dflash.train.parallel.taps import TargetView

    target = targets["qwen3_5"]
    ids, segments = _pack()
    view = TargetView(target, [5, 2])
    H = target.hidden_size
    full = target.context(ids, segments=segments)
    assert torch.equal(view.context(ids, segments=segments),
                       torch.cat([full[..., 5 * H:6 * H], full[..., 2 * H:3 * H]], dim=-1))


@pytest.mark.gpu
def test_packed_sequences_match_alone_in_bf16_with_the_fast_kernels(tmp_path):
    """The hybrid in bf16 on the GPU: fla's varlen delta rule, causal-conv1d's seq_idx convolution (where
    it is installed; else the per-sequence reference on CUDA) and flash attention's varlen kernel. bf16 may
    round differently on a packed and an alone pass (other kernels and tilings), so the bound is relative:
    max |packed - alone| <= 1e-3 * max |alone| in every tapped layer (an H100 gave exactly 0); without segments
    the tiny model's later sequences are 1e-3 to 1e-2 away (an H100 gave up to 9.3e-3), above 5x the bound."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    target = Target.load(save_tiny_target(tmp_path, "qwen3_5"), device="cuda", dtype=torch.bfloat16,
                         layer_ids=list(range(8)))
    print("\nkernels:", target.kernel_report())
    ids, segments = _pack("cuda")
    deviations, scale = _deviations(target, ids, target.context(ids, segments=segments))
    unpacked, _ = _deviations(target, ids, target.context(ids))
    per_layer = torch.stack(list(deviations.values())).amax(0)
    rel = torch.stack([d / s for d, s in zip(deviations.values(), scale.values())]).amax(0)
    rel_unpacked = torch.stack([d / s for d, s in zip(unpacked.values(), scale.values())]).amax(0)
    for layer, (d, r, u) in enumerate(zip(per_layer.tolist(), rel.tolist(), rel_unpacked.tolist())):
        kind = target.config.layer_types[layer]
        print(f"layer {layer} ({kind}): max |packed - alone| {d:.3e}, relative {r:.3e}; without segments {u:.3e}")
    assert float(rel.max()) <= 1e-3, rel
    assert float(rel_unpacked.max()) > 5e-3, rel_unpacked


def test_long_bounds_is_one_int64_copy_per_cu_seqlens_tensor():
    """Every GatedDeltaNet layer of a pass gets the same int64 cu_seqlens (fla caches its chunk indices by
    that tensor's identity); a new or rewritten source gets a new copy with its values."""
    from dflash.model.segment_kernels import long_bounds

    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    first = long_bounds(cu)
    assert first.dtype == torch.long and first.tolist() == [0, 4, 9]
    assert long_bounds(cu) is first
    other = cu.clone()
    second = long_bounds(other)
    assert second is not first and long_bounds(other) is second
    other[1] = 5
    rewritten = long_bounds(other)
    assert rewritten is not second and rewritten.tolist() == [0, 5, 9]
    already = torch.tensor([0, 3], dtype=torch.long)
    assert long_bounds(already) is already
