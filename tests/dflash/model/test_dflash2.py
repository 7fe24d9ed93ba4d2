"""The DFlash2 drafter: a new one computes what DFlash computes; its convolutions stay inside a block;
its config reads and writes through the reference layout, and bad values are refused by name."""

import json

import pytest
import torch

from dflash.errors import DrafterError
from dflash.io.drafter_dir import load_drafter, read_drafter_config, save_drafter
from dflash.kinds import build_drafter
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config, DFlash2Drafter, block_conv
from dflash.model.drafter import Drafter, DrafterConfig

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=48, vocab_size=96, block_size=4, num_target_layers=6, target_layer_ids=[1, 3],
             mask_token_id=3)


def config(**extra) -> DFlash2Config:
    return DFlash2Config(**{**SHAPE, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5, **extra})


def inputs(c, n_blocks=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(1, T, len(c.target_layer_ids) * c.hidden_size, generator=g)
    blocks = torch.randn(1, n_blocks * c.block_size, c.hidden_size, generator=g)
    return context, blocks, torch.tensor([[3, 7][:n_blocks]])


def test_a_new_dflash2_drafter_computes_what_the_dflash_drafter_computes():
    c = config()
    torch.manual_seed(0)
    second = DFlash2Drafter(c)
    first = Drafter(DrafterConfig(**SHAPE))
    first.load_state_dict({k: v for k, v in second.state_dict().items() if k in first.state_dict()})
    with torch.no_grad():
        torch.testing.assert_close(second(*inputs(c)), first(*inputs(c)), rtol=0, atol=0)
    head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
    hidden = torch.randn(2, 3, c.hidden_size)
    with torch.no_grad():  # zero successor codebook: the walk is the unary argmax
        assert torch.equal(second.propose(hidden, torch.tensor([5, 6]), head), head(hidden).argmax(-1))


def test_the_convolution_never_reads_across_a_block_boundary():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3 * 4, 16, generator=g)
    delta, base = torch.randn(2, 12, 3, 4, generator=g), torch.randn(3, 16, generator=g)
    whole = block_conv(x, delta, base, 4)
    for n in range(3):
        part = slice(4 * n, 4 * n + 4)
        torch.testing.assert_close(whole[:, part], block_conv(x[:, part], delta[:, part], base, 4), rtol=0, atol=0)
    # Slot 0 reads itself only; slot 1 itself and slot 0 (two of three taps in reach).
    groups = delta[..., 0, :].repeat_interleave(4, -1)
    torch.testing.assert_close(whole[:, 0], (base[0] + groups[:, 0]) * x[:, 0])


def test_written_and_read_back_it_is_the_same_drafter(tmp_path):
    torch.manual_seed(0)
    drafter = DFlash2Drafter(config(output_multiplier=2.0, final_logit_softcapping=30.0))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    directory = save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    data = json.loads((directory / "config.json").read_text())
    assert data["architectures"] == ["DFlash2DraftModel"]
    assert data["auto_map"] == {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}  # trust_remote_code's module
    assert {k: data["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k", "output_multiplier", "final_logit_softcapping")} \
        == dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5, output_multiplier=2.0,
                final_logit_softcapping=30.0)
    assert not (directory / "modeling_dflash.py").exists() and (directory / "modeling_dflash2.py").is_file()
    back = load_drafter(directory)
    assert isinstance(back, DFlash2Drafter) and back.config == drafter.config
    with torch.no_grad():
        torch.testing.assert_close(back(*inputs(back.config)), drafter(*inputs(back.config)), rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["dflash_config"].pop("selector_rank"), "needs dflash_config.selector_rank"),
    (lambda d: d["dflash_config"].update(conv_group_size=5), "conv_group_size 5 must divide hidden_size 32"),
    (lambda d: d["dflash_config"].update(selector_top_k="8"), "selector_top_k is '8'"),
    (lambda d: d["dflash_config"].update(input_embedding_scale=2.0), "input_embedding_scale"),
])
def test_a_bad_dflash2_config_is_refused_by_name(tmp_path, change, message):
    directory = save_drafter(DFlash2Drafter(config()), tmp_path / "d")
    data = json.loads((directory / "config.json").read_text())
    change(data)
    (directory / "config.json").write_text(json.dumps(data))
    with pytest.raises(DrafterError, match=message):
        read_drafter_config(directory)


def test_a_dflash_drafter_keeps_its_layout(tmp_path):
    directory = save_drafter(build_drafter(DrafterConfig(**SHAPE)), tmp_path / "d")
    data = json.loads((directory / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"] and "selector_rank" not in data["dflash_config"]
    assert type(load_drafter(directory)) is Drafter


def test_a_dflash2_shape_that_misfits_the_target_is_a_config_error(tmp_path):
    from dflash.errors import ConfigError
    from dflash.kinds import check_kind, named
    from dflash.model.target import Target
    from tests.support.dflash_tiny import save_tiny_target

    target = Target.load(save_tiny_target(tmp_path / "t", "qwen3"))
    made = named("dflash2").new_config(target, 3, 4, sliding_window=2)
    assert made.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (made.conv_group_size, made.conv_kernel_size, made.selector_rank, made.selector_top_k) == (16, 2, 256, 16)
    with pytest.raises(ConfigError, match="conv_group_size 5 must divide hidden_size 32"):
        named("dflash2").new_config(target, 2, 4, conv_group_size=5)
    check_kind(made, "dflash2", "here")
    with pytest.raises(ConfigError, match="here is a dflash2 drafter and --drafter-kind is dflash"):
        check_kind(made, "dflash", "here")
