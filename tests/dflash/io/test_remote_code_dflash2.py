"""A DFlash2 drafter this project wrote loads through AutoModel.from_pretrained(DIR, trust_remote_code=True) as
a DFlash one does: the modeling_dflash2.py written beside config.json gives a DFlash2DraftModel that takes every
stored tensor (none missing, none unexpected), whose hidden states and greedy proposals are the project's
DFlash2Drafter's, and whose spec_generate is the target's greedy continuation."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dflash.io.drafter_dir import load_drafter, save_drafter
from dflash.kinds import DFLASH, DFLASH2
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config, DFlash2Drafter
from dflash.model.masks import drafter_attention_mask
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target

H, BS, V = 32, 4, 96


def config(sliding: bool, **overrides) -> DFlash2Config:
    values = dict(hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, vocab_size=V, block_size=BS, num_target_layers=6, target_layer_ids=[1, 3],
                  mask_token_id=3, conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5,
                  output_multiplier=2.0, final_logit_softcapping=30.0)
    if sliding:
        values.update(layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=3)
    values.update(overrides)
    return DFlash2Config(**values)


def trained_like(drafter: DFlash2Drafter) -> DFlash2Drafter:
    """Move every weight off its initial value (identity convolutions and a zero successor codebook would
    hide a wrong convolution or selector), the codebooks far enough for the selector to change the walk."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if "codebook" in name else 0.1))
    return drafter.eval()


def auto_model(directory):
    """AutoModel with trust_remote_code, failing on any key it did not take and on any loading warning."""
    from transformers import AutoModel

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, info = AutoModel.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32,
                                                output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert {k: list(v) for k, v in info.items() if v} == {}
    assert [r.getMessage() for r in records if "key" in r.getMessage().lower()] == []
    return model.eval()


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_automodel_with_remote_code_computes_what_the_dflash2_drafter_computes(tmp_path, sliding):
    directory = save_drafter(trained_like(DFlash2Drafter(config(sliding))), tmp_path / "drafter")
    assert (directory / DFLASH2.model_file).is_file() and not (directory / DFLASH.model_file).exists()
    assert json.loads((directory / "config.json").read_text())["auto_map"] == {
        "AutoModel": "modeling_dflash2.DFlash2DraftModel"}
    model = auto_model(directory)
    assert type(model).__name__ == "DFlash2DraftModel" and type(model).__module__.endswith("modeling_dflash2")
    assert model.target_layer_ids == [1, 3] and model.mask_token_id == 3 and model.block_size == BS
    ours = load_drafter(directory).eval()  # bf16 on disk, upcast exactly to float32 on the CPU

    g = torch.Generator().manual_seed(1)
    T = 9
    context, block = torch.randn(2, T, 2 * H, generator=g), torch.randn(2, BS, H, generator=g)
    with torch.no_grad():
        # The block anchored right after the context: it sees all of it, as when decoding.
        expected = ours(context, block, torch.full((2, 1), T))
        got = model(position_ids=torch.arange(T + BS), noise_embedding=block, target_hidden=context)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # float32 rounding, nothing more

        head = torch.nn.Linear(H, V, bias=False)
        anchor_ids = torch.tensor([5, 17])
        tokens = model.propose(got[:, 1:], anchor_ids, head)
        assert torch.equal(tokens, ours.propose(expected[:, 1:], anchor_ids, head))
        values, _ = model.candidates(got[:, 1:], head)
        torch.testing.assert_close(values, ours.candidates(expected[:, 1:], head)[0], rtol=1e-5, atol=1e-5)
        # The selector is in play: its walk is not the unary argmax.
        assert not torch.equal(tokens, ours.unary(head(expected[:, 1:])).argmax(-1))


def test_two_blocks_in_one_call_keep_their_convolutions_apart(tmp_path):
    """Blocks back to back in noise_embedding, with the project's attention mask and positions: each block's
    convolutions read its own slots only, as the project's drafter computes."""
    directory = save_drafter(trained_like(DFlash2Drafter(config(False))), tmp_path / "drafter")
    model, ours = auto_model(directory), load_drafter(directory).eval()
    g = torch.Generator().manual_seed(2)
    T, anchors = 9, torch.tensor([[3, 7]])
    context, blocks = torch.randn(1, T, 2 * H, generator=g), torch.randn(1, 2 * BS, H, generator=g)
    positions = torch.cat([torch.arange(T), (anchors.unsqueeze(-1) + torch.arange(BS)).reshape(-1)])
    mask = drafter_attention_mask(anchors, T, BS, None, None).unsqueeze(1)
    with torch.no_grad():
        got = model(position_ids=positions, attention_mask=mask, noise_embedding=blocks, target_hidden=context)
        torch.testing.assert_close(got, ours(context, blocks, anchors), rtol=1e-5, atol=1e-5)


def test_spec_generate_of_the_dflash2_remote_code_model_is_the_target_greedy_continuation(tmp_path):
    from transformers import AutoModelForCausalLM

    target_dir = save_tiny_target(tmp_path / "target", "qwen3")
    target = Target.load(target_dir)
    drafter = DFlash2Drafter(DFlash2Config.from_target(target, num_hidden_layers=2, block_size=BS,
                                                       conv_group_size=8, selector_rank=6, selector_top_k=5))
    save_drafter(trained_like(drafter), tmp_path / "drafter")
    model = auto_model(tmp_path / "drafter")
    lm = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 40, 8, 23, 61]])
    out = model.spec_generate(target=lm, input_ids=prompt, max_new_tokens=14, stop_token_ids=[1])
    greedy = lm.generate(prompt, max_new_tokens=14, do_sample=False, eos_token_id=1, pad_token_id=0)
    assert out.tolist() == greedy.tolist()
    with pytest.raises(NotImplementedError, match="greedily"):
        model.spec_generate(target=lm, input_ids=prompt, max_new_tokens=4, temperature=0.7)


def test_a_new_remote_code_model_starts_as_the_project_initialises_one(tmp_path):
    """AutoModel.from_config (no weights): identity convolutions, a zero successor codebook."""
    from transformers import AutoConfig, AutoModel

    directory = save_drafter(DFlash2Drafter(config(False)), tmp_path / "drafter")
    fresh = AutoModel.from_config(AutoConfig.from_pretrained(directory, trust_remote_code=True),
                                  trust_remote_code=True)
    conv = fresh.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, H)) and not conv.base_kernel[:, 1:].any()
    assert not conv.kernel_projection.weight.any() and not fresh.candidate_selector.successor_codebook.any()
    assert fresh.candidate_selector.predecessor_codebook.std() > 0
