"""Drafter: attention semantics seen from the outputs, shapes, config checks, checkpoint round trip."""

import json

import pytest
import torch

from dflash.io.drafter_dir import load_drafter, save_drafter
from dflash.errors import DrafterError
from dflash.model.drafter import Drafter, DrafterConfig

H, K, BS = 32, 3, 4


def tiny_config(**overrides):
    values = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, vocab_size=50, block_size=BS, num_target_layers=6,
                  target_layer_ids=[1, 2, 3], mask_token_id=3, target_fingerprint="abc")
    values.update(overrides)
    return DrafterConfig(**values)


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(0)
    return Drafter(tiny_config()).eval()


def inputs(seed=0, B=2, T=10, anchors=((2, 6), (0, 8))):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor(anchors)
    N = anchors.shape[1]
    return torch.randn(B, T, K * H, generator=g), torch.randn(B, N * BS, H, generator=g), anchors


def test_shapes_and_dtype(drafter):
    context, blocks, anchors = inputs()
    out = drafter(context, blocks, anchors)
    assert out.shape == (2, 2 * BS, H) and out.dtype == torch.float32 and torch.isfinite(out).all()


def block(out, b, n):
    return out[b, n * BS:(n + 1) * BS]


def test_context_at_or_after_anchor_is_invisible(drafter):
    context, blocks, anchors = inputs()
    base = drafter(context, blocks, anchors)
    changed = context.clone()
    changed[0, 2:] += torch.randn_like(changed[0, 2:])  # positions >= anchor 2 of block (0, 0)
    out = drafter(changed, blocks, anchors)
    assert torch.equal(block(out, 0, 0), block(base, 0, 0))
    assert not torch.allclose(block(out, 0, 1), block(base, 0, 1))  # anchor 6 sees positions 2..5


def test_context_before_anchor_is_visible(drafter):
    context, blocks, anchors = inputs()
    base = drafter(context, blocks, anchors)
    changed = context.clone()
    changed[0, 1] += 1.0
    out = drafter(changed, blocks, anchors)
    assert not torch.allclose(block(out, 0, 0), block(base, 0, 0))
    assert torch.equal(out[1], base[1])  # other sequences of the batch are untouched


def test_other_blocks_are_invisible(drafter):
    context, blocks, anchors = inputs()
    base = drafter(context, blocks, anchors)
    changed = blocks.clone()
    changed[0, BS:2 * BS] += 1.0  # tokens of block 1
    out = drafter(context, changed, anchors)
    assert torch.equal(block(out, 0, 0), block(base, 0, 0))
    assert not torch.allclose(block(out, 0, 1), block(base, 0, 1))


def test_attention_inside_a_block_is_bidirectional(drafter):
    context, blocks, anchors = inputs()
    base = drafter(context, blocks, anchors)
    changed = blocks.clone()
    changed[0, BS - 1] += 1.0  # the last token of block 0 ...
    out = drafter(context, changed, anchors)
    assert not torch.allclose(out[0, 0], base[0, 0])  # ... changes its first token


def test_invalid_context_is_ignored(drafter):
    context, blocks, anchors = inputs()
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, 4] = False
    base = drafter(context, blocks, anchors, context_valid=valid)
    changed = context.clone()
    changed[0, 4] += 5.0
    assert torch.equal(drafter(changed, blocks, anchors, context_valid=valid), base)


def test_block_output_does_not_depend_on_its_slot(drafter):
    """The same block at the same anchor gives the same output whichever other blocks ride along."""
    context, blocks, anchors = inputs(anchors=((2, 6), (0, 8)))
    base = drafter(context, blocks, anchors)
    swapped = drafter(context, torch.cat([blocks[:, BS:], blocks[:, :BS]], 1), anchors.flip(1))
    assert torch.allclose(block(swapped, 0, 1), block(base, 0, 0), atol=1e-5)


def test_bad_inputs_are_named(drafter):
    context, blocks, anchors = inputs()
    with pytest.raises(ValueError, match="tapped layers"):
        drafter(context[..., :-1], blocks, anchors)
    with pytest.raises(ValueError, match=r"expected \[B,N\*bs,H\]"):
        drafter(context, blocks[:, :-1], anchors)


def test_config_checks_and_dict_round_trip():
    config = tiny_config()
    assert DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        tiny_config(num_attention_heads=3)
    with pytest.raises(ValueError, match="distinct and ascending"):
        tiny_config(target_layer_ids=[2, 1, 3])
    with pytest.raises(ValueError, match=r"must lie in 0..5 \(num_target_layers 6\)"):
        tiny_config(target_layer_ids=[1, 6])
    with pytest.raises(ValueError, match="need sliding_window >= 1"):
        tiny_config(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="must name 2 layers"):
        tiny_config(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="did you mean block_size"):
        DrafterConfig.from_dict({**config.to_dict(), "blok_size": 8})


def test_save_load_is_bit_exact(tmp_path, drafter):
    save_drafter(drafter, tmp_path / "ckpt", dtype=None)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["config.json", "model.safetensors", "modeling_dflash.py"]
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config == drafter.config
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    context, blocks, anchors = inputs()
    assert torch.equal(loaded.eval()(context, blocks, anchors), drafter(context, blocks, anchors))


def test_bf16_checkpoint_loads_as_bf16_where_asked(tmp_path):
    save_drafter(Drafter(tiny_config()), tmp_path, dtype=torch.bfloat16)
    assert load_drafter(tmp_path, dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16
    assert load_drafter(tmp_path).fc.weight.dtype == torch.float32  # upcast for a CPU


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(DrafterError, match="holds nothing like a drafter: no config.json"):
        load_drafter(tmp_path)


def test_a_sliding_layer_sees_only_its_window():
    """One sliding layer alone: a block token at position p depends on context j only for
    p-W+1 <= j < anchor, and on block tokens at or before it (causal)."""
    torch.manual_seed(0)
    drafter = Drafter(tiny_config(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=3)).eval()
    context, blocks, _ = inputs(B=1)
    anchors = torch.tensor([[6, 8]])
    base = drafter(context, blocks, anchors)
    # Block 0 (anchor 6): token k sits at 6+k and sees context 4..5 (k=0), 5 (k=1), none (k>=2).
    far = context.clone()
    far[:, :4] += 5.0
    assert torch.equal(drafter(far, blocks, anchors)[0, :BS], base[0, :BS])
    near = context.clone()
    near[:, 5] += 5.0
    changed = (drafter(near, blocks, anchors)[0, :BS] - base[0, :BS]).abs().amax(-1) > 0
    assert changed.tolist() == [True, True, False, False]
    later = blocks.clone()
    later[:, 2] += 5.0  # block 0's token 2: tokens 0 and 1 must not see it
    changed = (drafter(context, later, anchors)[0, :BS] - base[0, :BS]).abs().amax(-1) > 0
    assert changed.tolist() == [False, False, True, True]


def test_flex_attention_equals_sdpa_with_sliding_layers():
    sdpa, flex = sdpa_and_flex(sliding=True)
    *args, _ = flex_case()
    with torch.no_grad():
        torch.testing.assert_close(flex(*args), sdpa(*args), rtol=1e-4, atol=1e-5)


def flex_case(device="cpu", B=2, T=150, N=40):
    """Inputs long enough for several 128-wide flex tiles, with padding and invalid anchors."""
    g = torch.Generator().manual_seed(1)
    context = torch.randn(B, T, K * H, generator=g)
    blocks = torch.randn(B, N * BS, H, generator=g)
    anchors = torch.sort(torch.randint(0, T - BS, (B, N), generator=g), dim=1).values
    context_valid = torch.ones(B, T, dtype=torch.bool)
    context_valid[1, 120:] = False                      # the second sequence is padded
    anchor_valid = torch.ones(B, N, dtype=torch.bool)
    anchor_valid[1, -5:] = False                        # and has fewer anchors
    weight = torch.randn(B, N * BS, H, generator=g)
    return [t.to(device) for t in (context, blocks, anchors, context_valid, anchor_valid, weight)]


def sdpa_and_flex(device="cpu", sliding=False):
    torch.manual_seed(0)
    layers = dict(num_hidden_layers=3, sliding_window=40,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"]) if sliding else {}
    config = tiny_config(head_dim=16, **layers)  # flex's compiled kernels need heads >= 16 wide
    sdpa = Drafter(config).to(device)
    flex = Drafter(config, attention="flex").to(device)
    flex.load_state_dict(sdpa.state_dict())
    return sdpa, flex


def test_flex_attention_equals_sdpa():
    """The block-sparse flex path computes the same function as the dense SDPA path, padding and
    invalid anchors included (flex's eager reference here; it has no CPU backward, so the gradients
    are compared on a GPU in test_gpu.py)."""
    sdpa, flex = sdpa_and_flex()
    *args, _ = flex_case()
    with torch.no_grad():
        torch.testing.assert_close(flex(*args), sdpa(*args), rtol=1e-4, atol=1e-5)


def test_a_flex_drafter_takes_sdpa_below_the_query_rows_compiled_flex_takes(monkeypatch):
    """Fewer drafter query rows (anchors x block) than FLEX_MIN_QUERY_ROWS: compiled flex has no kernel for them
    on a GPU, so that forward takes sdpa with the same mask (a padded batch of short answers); at or above it the
    flex path runs."""
    import dflash.model.drafter as drafter_module

    sdpa, flex = sdpa_and_flex()
    short = drafter_module.FLEX_MIN_QUERY_ROWS // BS - 1
    *args, _ = flex_case(N=short)

    def no_flex(mask):
        raise AssertionError("the flex path ran")

    monkeypatch.setattr(drafter_module, "flex_block_mask", no_flex)
    with torch.no_grad():
        torch.testing.assert_close(flex(*args), sdpa(*args), rtol=1e-4, atol=1e-5)
        *args, _ = flex_case(N=drafter_module.FLEX_MIN_QUERY_ROWS // BS)
        with pytest.raises(AssertionError, match="the flex path ran"):
            flex(*args)


def test_unknown_attention_is_named():
    with pytest.raises(ValueError, match="attention must be one of sdpa, flex"):
        Drafter(tiny_config(), attention="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_compiled_flex_equals_sdpa_outputs_and_gradients_on_the_gpu(sliding):
    """The compiled flex kernels (what training runs on a GPU) against dense SDPA, forward and backward,
    for full_attention layers and for a sliding_attention / full_attention mix."""
    sdpa, flex = sdpa_and_flex("cuda", sliding)
    *args, weight = flex_case("cuda")
    results = []
    for model in (sdpa, flex):
        out = model(*args)
        (out * weight).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out_s, grads_s), (out_f, grads_f) = results
    torch.testing.assert_close(out_f, out_s, rtol=1e-3, atol=1e-4)
    for name, grad in grads_s.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-2, atol=1e-4, msg=name)
