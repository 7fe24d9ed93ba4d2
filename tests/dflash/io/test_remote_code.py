"""The reference README's entry point: AutoModel.from_pretrained(DIR, trust_remote_code=True) on a drafter
this project wrote gives a DFlashDraftModel (the modeling_dflash.py written beside config.json) whose
outputs are the project's Drafter's, and whose spec_generate is the target's greedy continuation."""

from __future__ import annotations

import pytest
import torch

from dflash.io.drafter_dir import load_drafter, save_drafter
from dflash.kinds import DFLASH
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target

H, BS = 32, 4


def config(sliding: bool, **overrides) -> DrafterConfig:
    values = dict(hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, vocab_size=96, block_size=BS, num_target_layers=6,
                  target_layer_ids=[1, 2, 3], mask_token_id=3)
    if sliding:
        values.update(layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=3)
    values.update(overrides)
    return DrafterConfig(**values)


def auto_model(directory):
    from transformers import AutoModel

    return AutoModel.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_automodel_with_remote_code_computes_what_the_drafter_computes(tmp_path, sliding):
    torch.manual_seed(0)
    save_drafter(Drafter(config(sliding)), tmp_path / "drafter")
    assert (tmp_path / "drafter" / DFLASH.model_file).is_file()
    model = auto_model(tmp_path / "drafter")
    assert type(model).__name__ == "DFlashDraftModel" and type(model).__module__.endswith("modeling_dflash")
    assert model.target_layer_ids == [1, 2, 3] and model.mask_token_id == 3 and model.block_size == BS
    ours = load_drafter(tmp_path / "drafter").eval()  # bf16 on disk, upcast exactly to float32 on the CPU

    g = torch.Generator().manual_seed(1)
    T = 9
    context, block = torch.randn(2, T, 3 * H, generator=g), torch.randn(2, BS, H, generator=g)
    with torch.no_grad():
        # The block anchored right after the context: it sees all of it, as when decoding.
        expected = ours(context, block, torch.full((2, 1), T))
        got = model(position_ids=torch.arange(T + BS), noise_embedding=block, target_hidden=context)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # float32 rounding, nothing more
    gap = torch.cat([torch.arange(T), torch.arange(T + 5, T + 5 + BS)])  # RoPE is relative: only gaps matter
    assert not torch.allclose(got, model(position_ids=gap, noise_embedding=block, target_hidden=context), atol=1e-4)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_spec_generate_of_the_remote_code_model_is_the_target_greedy_continuation(tmp_path, sliding):
    from transformers import AutoModelForCausalLM

    target_dir = save_tiny_target(tmp_path / "target", "qwen3")
    target = Target.load(target_dir)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target, num_hidden_layers=2, block_size=BS,
                                                layer_types=["sliding_attention", "full_attention"] if sliding else [],
                                                sliding_window=3 if sliding else None))
    save_drafter(drafter, tmp_path / "drafter")
    model = auto_model(tmp_path / "drafter")
    lm = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 40, 8, 23, 61]])
    out = model.spec_generate(target=lm, input_ids=prompt, max_new_tokens=14, stop_token_ids=[1])
    greedy = lm.generate(prompt, max_new_tokens=14, do_sample=False, eos_token_id=1, pad_token_id=0)
    assert out.tolist() == greedy.tolist()
    with pytest.raises(NotImplementedError, match="greedily"):
        model.spec_generate(target=lm, input_ids=prompt, max_new_tokens=4, temperature=0.7)
