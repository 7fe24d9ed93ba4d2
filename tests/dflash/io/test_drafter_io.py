"""The drafter on disk in the reference DFlash layout: what vLLM and SGLang read, exact round trips,
hand-written reference directories, the older layout's conversion, and every bad input named."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from dflash.io.drafter_dir import expected_tensors, load_drafter, read_drafter_config, save_drafter
from dflash.io.fit import check_fits_target, target_shape
from dflash.io.legacy import convert_legacy
from dflash.errors import DrafterError
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target

H, BS = 32, 4


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, vocab_size=96, block_size=BS, num_target_layers=6,
                  target_layer_ids=[1, 2, 3], mask_token_id=3, target_fingerprint="abc")
    values.update(overrides)
    return DrafterConfig(**values)


def sliding_config(**overrides) -> DrafterConfig:
    return tiny_config(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                       sliding_window=3, **overrides)


def inputs(config, seed=0, B=2, T=10, anchors=((2, 6), (0, 8))):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor(anchors)
    N = anchors.shape[1]
    width = len(config.target_layer_ids) * config.hidden_size
    return torch.randn(B, T, width, generator=g), torch.randn(B, N * config.block_size, H, generator=g), anchors


def make_drafter(config, seed=0) -> Drafter:
    torch.manual_seed(seed)
    return Drafter(config).eval()


# --- what the engines read -------------------------------------------------------------------------------
# Each config key the loaders read, with the file of the pinned release that reads it (vllm 0.34.0 and
# sglang 0.5.23 wheels, tests/data/serving/engine-pins.txt); the `serving` tier runs that code on drafters
# written by dflash-train (test_serving_engines.py).
VLLM_KEYS = {
    "architectures": "vllm/model_executor/models/registry.py (_SPECULATIVE_DECODING_MODELS: -> qwen3_dflash)",
    "dflash_config.target_layer_ids": "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py "
                                      "(get_eagle3_aux_layers_from_config: ids + 1)",
    "dflash_config.mask_token_id": "vllm/v1/worker/gpu/spec_decode/utils.py (get_parallel_drafting_token_id); "
                                   "vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3Model)",
    "hidden_size": "vllm/model_executor/models/qwen3_dflash.py",
    "num_hidden_layers": "vllm/model_executor/models/qwen3_dflash.py",
    "num_attention_heads": "vllm/model_executor/models/qwen3_dflash.py",
    "num_key_value_heads": "vllm/model_executor/models/qwen3_dflash.py",
    "head_dim": "vllm/model_executor/models/qwen3_dflash.py",
    "intermediate_size": "vllm/model_executor/models/qwen3_dflash.py",
    "hidden_act": "vllm/model_executor/models/qwen2.py (Qwen2MLP: silu only)",
    "rms_norm_eps": "vllm/model_executor/models/qwen3_dflash.py",
    "attention_bias": "vllm/model_executor/models/qwen3_dflash.py",
    "max_position_embeddings": "vllm/model_executor/models/qwen3_dflash.py",
    "rope_parameters.rope_theta": "vllm/model_executor/models/qwen3_dflash.py (set_default_rope_theta, get_rope)",
    "vocab_size": "vllm/model_executor/models/qwen3_dflash.py",
    "layer_types": "vllm/model_executor/models/qwen3_dflash.py (_resolve_layer_attention, _dflash_layer_causal)",
    "sliding_window": "vllm/model_executor/models/qwen3_dflash.py (_resolve_layer_attention)",
}
SGLANG_KEYS = {
    "architectures": "sglang/srt/models/dflash.py (EntryClass: DFlashDraftModel)",
    "num_hidden_layers": "sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config)",
    "num_target_layers": "sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config)",
    "block_size": "sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config)",
    "dflash_config.target_layer_ids": "sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config)",
    "dflash_config.mask_token_id": "sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config); "
                                   "sglang/srt/speculative/dflash_worker_v2.py (_resolve_mask_token_id)",
    "hidden_size": "sglang/srt/models/dflash.py",
    "num_attention_heads": "sglang/srt/models/dflash.py",
    "num_key_value_heads": "sglang/srt/models/dflash.py",
    "head_dim": "sglang/srt/models/dflash.py",
    "attention_bias": "sglang/srt/models/dflash.py",
    "rms_norm_eps": "sglang/srt/models/dflash.py",
    "rope_parameters.rope_theta": "sglang/srt/models/dflash.py (get_rope_config)",
    "max_position_embeddings": "sglang/srt/models/dflash.py",
    "intermediate_size": "sglang/srt/models/dflash.py",
    "hidden_act": "sglang/srt/models/dflash.py (DFlashMLP: silu or swigluoai)",
    "layer_types": "sglang/srt/speculative/dflash_utils.py (get_dflash_layer_types)",
    "sliding_window": "sglang/srt/speculative/dflash_utils.py (get_dflash_attention_sliding_window_size)",
}
# Keys the engines (or the reference DFlashDraftModel, dflash 0.1.0 model.py) read when present, each
# changing what they compute; dflash-train writes none of them, and reading refuses each at any value but
# the one that computes what this project's drafter does. key -> (a value that differs, who reads it).
OPTIONAL_KEYS = {
    "is_neox_style": (False, "vllm qwen3_dflash.py DFlashQwen3DecoderLayer"),
    "rope_is_neox_style": (False, "sglang models/dflash.py DFlashAttention"),
    "partial_rotary_factor": (0.5, "sglang models/dflash.py DFlashAttention"),
    "use_gemma_norm": (True, "sglang models/dflash.py (GemmaRMSNorm)"),
    "is_causal": (True, "vllm qwen3_dflash.py _dflash_layer_causal; sglang models/dflash.py; reference model"),
    "logit_scale": (2.0, "vllm qwen3_dflash.py DFlashQwen3ForCausalLM (LogitsProcessor)"),
    "draft_vocab_size": (64, "vllm qwen3_dflash.py DFlashQwen3ForCausalLM (draft_id_to_target_id)"),
    "target_hidden_size": (64, "vllm qwen3_dflash.py _get_dflash_fc_input_size"),
    "has_own_lm_head": (True, "vllm qwen3_dflash.py"),
    "use_aux_hidden_state": (False, "vllm qwen3_dflash.py DFlashQwen3Model (no fc)"),
    "add_swa_attention_sink_bias": (True, "vllm qwen3_dflash.py"),
    "eagle_config": ({"use_aux_hidden_state": False}, "vllm qwen3_dflash.py (merged into dflash_config)"),
    "quantization_config": ({"quant_method": "fp8"}, "vllm and sglang quantized loaders"),
    "has_embed_tokens": (True, "sglang dflash_utils.py is_nemotron_35_draft_config"),
    "input_embedding_scale": (2.0, "reference model.py dflash_generate"),
    "dflash_config.causal": (True, "vllm qwen3_dflash.py _dflash_layer_causal"),
    "dflash_config.use_swa": (True, "vllm qwen3_dflash.py _resolve_layer_attention"),
    "dflash_config.swa_window_size": (8, "vllm qwen3_dflash.py _resolve_layer_attention"),
    "dflash_config.attention_sink_bias": (True, "vllm qwen3_dflash.py; sglang dflash_utils.py"),
    "dflash_config.attention_value_scale": (0.5, "vllm qwen3_dflash.py; sglang dflash_utils.py"),
    "dflash_config.mask_token": ("<mask>", "sglang dflash_utils.py; dflash_worker_v2.py _resolve_mask_token_id"),
    "dflash_config.output_multiplier": (2.0, "sglang dflash_utils.py; reference model.py compute_logits"),
    "dflash_config.final_logit_softcapping": (30.0, "sglang dflash_utils.py; reference model.py compute_logits"),
    "dflash_config.conv_kernel_size": (4, "sglang dflash_utils.py (DFlash2 convolutions)"),
    "dflash_config.projector_type": ("domino", "sglang dflash_utils.py (Domino projector)"),
    "dflash_config.sample_from_anchor": (True, "vllm v1/worker/gpu/spec_decode/dflash/speculator.py (refuses it)"),
    "rope_parameters.partial_rotary_factor": (0.25, "sglang models/dflash.py get_rope (rope_scaling)"),
}
# Tensor names, per layer N: vLLM qwen3_dflash.py load_weights prepends "model." and its WeightsMapper
# stacks q/k/v -> qkv_proj, gate/up -> gate_up_proj (utils.py AutoWeightsLoader raises on a name it cannot
# place); SGLang models/dflash.py load_weights stacks on ".q_proj." etc. and SKIPS a name it cannot
# resolve (a wrong name would be an uninitialised layer). test_serving_engines.py runs both loaders.
ENGINE_TENSORS = {
    "fc.weight": "vllm qwen3_dflash.py DFlashQwen3Model.fc; sglang models/dflash.py (fc.weight shape check)",
    "hidden_norm.weight": "vllm qwen3_dflash.py DFlashQwen3Model.hidden_norm; sglang models/dflash.py",
    "norm.weight": "vllm qwen3_dflash.py DFlashQwen3Model.norm; sglang models/dflash.py",
    "layers.{n}.input_layernorm.weight": "vllm qwen3_dflash.py; sglang models/dflash.py",
    "layers.{n}.post_attention_layernorm.weight": "vllm qwen3_dflash.py; sglang models/dflash.py",
    "layers.{n}.self_attn.q_proj.weight": "stacked into qkv_proj: vllm qwen3_dflash.py, sglang models/dflash.py",
    "layers.{n}.self_attn.k_proj.weight": "stacked into qkv_proj: vllm qwen3_dflash.py, sglang models/dflash.py",
    "layers.{n}.self_attn.v_proj.weight": "stacked into qkv_proj: vllm qwen3_dflash.py, sglang models/dflash.py",
    "layers.{n}.self_attn.o_proj.weight": "vllm qwen3_dflash.py; sglang models/dflash.py",
    "layers.{n}.self_attn.q_norm.weight": "vllm qwen3_dflash.py; sglang models/dflash.py",
    "layers.{n}.self_attn.k_norm.weight": "vllm qwen3_dflash.py; sglang models/dflash.py",
    "layers.{n}.mlp.gate_proj.weight": "stacked into mlp.gate_up_proj: vllm qwen3_dflash.py, sglang models/dflash.py",
    "layers.{n}.mlp.up_proj.weight": "stacked into mlp.gate_up_proj: vllm qwen3_dflash.py, sglang models/dflash.py",
    "layers.{n}.mlp.down_proj.weight": "vllm qwen3_dflash.py; sglang models/dflash.py",
}


def _lookup(data: dict, dotted: str):
    for part in dotted.split("."):
        assert isinstance(data, dict) and part in data, f"missing key {dotted}"
        data = data[part]
    return data


@pytest.mark.parametrize("make", [tiny_config, sliding_config], ids=["full", "sliding"])
def test_written_drafter_carries_every_key_and_name_the_engines_read(tmp_path, make):
    from safetensors import safe_open

    config = make()
    save_drafter(make_drafter(config), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    data = json.loads((tmp_path / "config.json").read_text())
    for key, source in {**VLLM_KEYS, **SGLANG_KEYS}.items():
        assert _lookup(data, key) is not None or key == "sliding_window", f"{key} (read by {source})"
    assert data["model_type"] == "qwen3" and data["architectures"] == ["DFlashDraftModel"]
    assert data["hidden_act"] == "silu" and data["attention_bias"] is False and data["dtype"] == "bfloat16"
    ids = data["dflash_config"]["target_layer_ids"]
    assert ids == sorted(ids) and max(ids) < data["num_target_layers"]  # engines concat in layer order
    assert data["rope_theta"] == data["rope_parameters"]["rope_theta"]
    assert "eagle_aux_hidden_state_layer_ids" not in data
    assert data["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    for dotted in OPTIONAL_KEYS:  # absent: each engine's default, which is what this project computes
        head, _, tail = dotted.partition(".")
        assert (data.get(head, {}).get(tail) if tail else data.get(head)) is None, dotted
    assert len(data["layer_types"]) == data["num_hidden_layers"]
    if "sliding_attention" in data["layer_types"]:
        assert data["use_sliding_window"] is True and data["sliding_window"] == 3
    else:
        assert data["use_sliding_window"] is False and data["sliding_window"] is None

    expected = {p.format(n=n) for p in ENGINE_TENSORS for n in range(config.num_hidden_layers)}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert names == expected
    # SGLang stacks on ".q_proj." / ".gate_proj." etc. and vLLM prepends "model.": no prefix may be there.
    assert not any(n.startswith("model.") for n in names)
    assert all(".mlp." in n for n in names if "_proj" in n and ".self_attn." not in n)


@pytest.mark.parametrize("make", [tiny_config, sliding_config], ids=["full", "sliding"])
def test_autoconfig_parses_it_as_qwen3_with_the_dflash_keys(tmp_path, make):
    from transformers import AutoConfig, Qwen3Config

    config = make()
    save_drafter(make_drafter(config), tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert type(hf) is Qwen3Config and hf.model_type == "qwen3"
    assert hf.architectures == ["DFlashDraftModel"]
    assert hf.dflash_config == {"target_layer_ids": [1, 2, 3], "mask_token_id": 3}
    assert hf.block_size == BS and hf.num_target_layers == 6
    assert hf.num_hidden_layers == config.num_hidden_layers and hf.head_dim == 8
    assert hf.layer_types == config.layer_types
    assert hf.sliding_window == config.sliding_window  # kept only because use_sliding_window is written
    assert hf.rope_parameters["rope_theta"] == config.rope_theta and hf.dtype == torch.bfloat16


# --- round trips -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_config, sliding_config], ids=["full", "sliding"])
def test_bf16_save_load_round_trip_is_exact(tmp_path, make):
    drafter = make_drafter(make()).to(torch.bfloat16)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, dtype=torch.bfloat16).eval()
    assert loaded.config == drafter.config
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    context, blocks, anchors = inputs(drafter.config)
    with torch.no_grad():
        assert torch.equal(loaded(context, blocks, anchors), drafter(context, blocks, anchors))


def test_fp32_training_checkpoint_round_trip_is_exact_and_says_float32(tmp_path):
    drafter = make_drafter(sliding_config())
    save_drafter(drafter, tmp_path, dtype=None)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    loaded = load_drafter(tmp_path).eval()
    context, blocks, anchors = inputs(drafter.config)
    with torch.no_grad():
        assert torch.equal(loaded(context, blocks, anchors), drafter(context, blocks, anchors))


def test_bf16_weights_on_a_cpu_are_upcast_exactly_with_a_note(tmp_path, caplog):
    drafter = make_drafter(tiny_config()).to(torch.bfloat16)
    save_drafter(drafter, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash.io.drafter_dir"):
        loaded = load_drafter(tmp_path, device="cpu").eval()
    assert loaded.fc.weight.dtype == torch.float32
    assert "bfloat16 weights; upcast to float32" in caplog.text
    context, blocks, anchors = inputs(drafter.config)
    with torch.no_grad():
        assert torch.equal(loaded(context, blocks, anchors), drafter.float()(context, blocks, anchors))


def reference_tensors(L=2, hidden=H, heads=4, kv=2, hd=8, inter=48, taps=3, seed=0) -> dict[str, torch.Tensor]:
    """A reference-layout state dict written out by hand (names and shapes from the published drafters)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    tensors = {"fc.weight": rand(hidden, taps * hidden), "hidden_norm.weight": 1 + rand(hidden),
               "norm.weight": 1 + rand(hidden)}
    for n in range(L):
        p = f"layers.{n}."
        tensors.update({
            p + "input_layernorm.weight": 1 + rand(hidden), p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * hd, hidden), p + "self_attn.k_proj.weight": rand(kv * hd, hidden),
            p + "self_attn.v_proj.weight": rand(kv * hd, hidden), p + "self_attn.o_proj.weight": rand(hidden, heads * hd),
            p + "self_attn.q_norm.weight": 1 + rand(hd), p + "self_attn.k_norm.weight": 1 + rand(hd),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })
    return tensors


def reference_config_json(**overrides) -> dict:
    """A config.json as the published Qwen3 drafters have it (their key set; tiny numbers), by hand."""
    data = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": BS, "bos_token_id": 0,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2, 3]}, "dtype": "bfloat16",
        "eos_token_id": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": 48, "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 40960, "max_window_layers": 2, "model_type": "qwen3",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 6,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": 96,
    }
    data.update(overrides)
    return data


def write_reference_dir(path, config=None, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or reference_config_json()))
    save_file(tensors or reference_tensors(), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_a_hand_written_reference_directory_loads_to_the_same_outputs(tmp_path):
    tensors = reference_tensors()
    loaded = load_drafter(write_reference_dir(tmp_path, tensors=tensors), dtype=torch.bfloat16).eval()
    # The same drafter assembled attribute by attribute, without going through any name mapping.
    by_hand = Drafter(loaded.config).to(torch.bfloat16).eval()
    with torch.no_grad():
        by_hand.fc.weight.copy_(tensors["fc.weight"])
        by_hand.hidden_norm.weight.copy_(tensors["hidden_norm.weight"])
        by_hand.norm.weight.copy_(tensors["norm.weight"])
        for n, layer in enumerate(by_hand.layers):
            t = {k[len(f"layers.{n}."):]: v for k, v in tensors.items() if k.startswith(f"layers.{n}.")}
            layer.input_layernorm.weight.copy_(t["input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(t["post_attention_layernorm.weight"])
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                getattr(layer.self_attn, proj).weight.copy_(t[f"self_attn.{proj}.weight"])
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, proj).weight.copy_(t[f"mlp.{proj}.weight"])
    context, blocks, anchors = inputs(loaded.config)
    with torch.no_grad():
        assert torch.equal(loaded(context, blocks, anchors), by_hand(context, blocks, anchors))
    assert loaded.config.rope_theta == 1e6 and loaded.config.target_fingerprint == ""


# --- what target_layer_ids mean ------------------------------------------------------------------------------
def test_target_layer_id_l_is_the_output_of_decoder_layer_l(tmp_path):
    """The engines take id l as HF hidden_states[l + 1] (vLLM eagle3_utils.py and SGLang qwen3.py add 1
    to capture "before layer l + 1"); the ids a written drafter names must tap exactly those states."""
    target = Target.load(save_tiny_target(tmp_path / "target", "qwen3"))
    save_drafter(make_drafter(DrafterConfig.from_target(target, num_hidden_layers=1, block_size=BS)), tmp_path / "d")
    ids = json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert ids == target.layer_ids == [1, 2, 3]
    tokens = torch.randint(4, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    context = target.context(tokens)
    hidden = target.model(tokens, output_hidden_states=True).hidden_states  # [0] = the embeddings
    for slot, layer in enumerate(ids):
        tapped = context[..., slot * H:(slot + 1) * H]
        assert torch.allclose(tapped, hidden[layer + 1], atol=1e-6)
        assert not torch.allclose(tapped, hidden[layer], atol=1e-3)  # an off-by-one would land here


# --- bad input ---------------------------------------------------------------------------------------------
def test_weights_without_a_config(tmp_path):
    save_file(reference_tensors(), str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterError, match="holds weights but no config.json"):
        read_drafter_config(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama"), "model_type 'llama'; a DFlash drafter"),
    (dict(architectures=["DSparkDraftModel"]), "not \\[\"DFlashDraftModel\"\\]"),
    (dict(architectures=["DFlash2DraftModel"]), "a DFlash2DraftModel needs dflash_config.conv_kernel_size"),
    (dict(dflash_config=None), "has no dflash_config"),
    (dict(dflash_config={"target_layer_ids": [1, 2, 3]}), "lacks mask_token_id"),
    (dict(num_target_layers=None), "lacks num_target_layers"),
    (dict(dflash_config={"target_layer_ids": [1, 2, 3], "mask_token_id": 3, "causal": False}),
     "dflash_config.causal = False"),
    (dict(attention_bias=True), "attention_bias = true"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type = 'yarn'"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8), "use_sliding_window is False"),
    (dict(dflash_config={"target_layer_ids": [3, 1, 2], "mask_token_id": 3}), "ascending"),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "vLLM would tap"),
    (dict(format="dflash-drafter/1"), "dflash export"),
])
def test_bad_configs_are_named_before_any_weight_is_read(tmp_path, change, message):
    write_reference_dir(tmp_path, config=reference_config_json(**change))
    with pytest.raises(DrafterError, match=message):
        read_drafter_config(tmp_path)


def _with(data: dict, dotted: str, value) -> dict:
    head, _, tail = dotted.partition(".")
    if tail:
        data[head] = {**(data.get(head) or {}), tail: value}
    else:
        data[head] = value
    return data


@pytest.mark.parametrize("dotted", sorted(OPTIONAL_KEYS))
def test_a_key_that_changes_what_an_engine_computes_is_refused_by_name(tmp_path, dotted):
    """A third-party drafter the project cannot run as the engines would is refused, the key named."""
    value, reader = OPTIONAL_KEYS[dotted]
    write_reference_dir(tmp_path, config=_with(reference_config_json(), dotted, value))
    with pytest.raises(DrafterError) as err:
        read_drafter_config(tmp_path)
    assert f"{dotted} = {value!r}" in str(err.value), reader


@pytest.mark.parametrize("dotted, value", [
    ("is_neox_style", True), ("use_gemma_norm", False), ("partial_rotary_factor", 1.0), ("logit_scale", 1.0),
    ("draft_vocab_size", 96), ("target_hidden_size", H), ("is_causal", None), ("use_aux_hidden_state", True),
    ("dflash_config.attention_sink_bias", False), ("dflash_config.mask_token", "<|MASK|>"),
    ("target_layer_ids", [1, 2, 3]), ("transformers_version", "5.24.0"), ("torch_dtype", "bfloat16"),
])
def test_such_a_key_at_the_value_this_project_computes_is_accepted(tmp_path, dotted, value):
    write_reference_dir(tmp_path, config=_with(reference_config_json(), dotted, value))
    assert read_drafter_config(tmp_path).hidden_size == H


def test_an_unknown_key_is_refused_by_name(tmp_path):
    write_reference_dir(tmp_path, config=reference_config_json(mlp_bias=True,
                                                               dflash_config={"target_layer_ids": [1, 2, 3],
                                                                              "mask_token_id": 3, "noise": 1}))
    with pytest.raises(DrafterError) as err:
        read_drafter_config(tmp_path)
    assert "mlp_bias (unknown to this project's reader" in str(err.value)
    assert "dflash_config.noise (unknown" in str(err.value)


def test_tensor_names_that_do_not_match_are_listed(tmp_path):
    tensors = reference_tensors()
    tensors["layers.1.gate_proj.weight"] = tensors.pop("layers.1.mlp.gate_proj.weight")  # the older layout
    del tensors["norm.weight"]
    write_reference_dir(tmp_path, tensors=tensors)
    with pytest.raises(DrafterError) as err:
        load_drafter(tmp_path)
    message = str(err.value)
    assert "missing ['layers.1.mlp.gate_proj.weight', 'norm.weight']" in message
    assert "extra ['layers.1.gate_proj.weight']" in message and "dflash export" in message


def test_tensor_shapes_that_do_not_match_are_listed(tmp_path):
    write_reference_dir(tmp_path, config=reference_config_json(intermediate_size=64))
    with pytest.raises(DrafterError, match=r"layers.0.mlp.down_proj.weight: file \(32, 48\), config \(32, 64\)"):
        read_drafter_config(tmp_path)


def test_a_drafter_for_another_target_is_refused(tmp_path):
    config = read_drafter_config(write_reference_dir(tmp_path / "d"))
    check_fits_target(config, target_shape(save_tiny_target(tmp_path / "t6", "qwen3", num_layers=6)))
    with pytest.raises(DrafterError, match="num_target_layers 6 != the target's 8 layers"):
        check_fits_target(config, target_shape(save_tiny_target(tmp_path / "t8", "qwen3", num_layers=8)))
    with pytest.raises(DrafterError, match=r"trained for a different target: hidden_size 64 != the target.s 32"):
        check_fits_target(tiny_config(hidden_size=64, num_attention_heads=8), target_shape(tmp_path / "t6"))
    with pytest.raises(DrafterError, match="target_fingerprint abc != the target's"):
        check_fits_target(tiny_config(), Target.load(tmp_path / "t6"))


# --- the older layout --------------------------------------------------------------------------------------
def legacy_dir(path, drafter: Drafter) -> None:
    """A drafter as dflash-train wrote it before the reference layout: its own config keys, MLP
    tensors directly under the layer, float32."""
    path.mkdir(parents=True)
    c = drafter.config
    (path / "config.json").write_text(json.dumps({
        "format": "dflash-drafter/1", "target_hidden_size": c.hidden_size, "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers, "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "block_size": c.block_size,
        "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
        "target_fingerprint": c.target_fingerprint, "initializer_range": c.initializer_range}))
    state = {k.replace(".mlp.", "."): v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", "dflash": "dflash-drafter/1"})


def test_an_older_project_drafter_converts_to_the_reference_layout(tmp_path):
    drafter = make_drafter(tiny_config())
    legacy_dir(tmp_path / "old", drafter)
    with pytest.raises(DrafterError, match="older drafter of this project"):
        read_drafter_config(tmp_path / "old")
    convert_legacy(tmp_path / "old", tmp_path / "new", num_target_layers=6)
    assert read_drafter_config(tmp_path / "new") == drafter.config
    loaded = load_drafter(tmp_path / "new", dtype=torch.bfloat16).eval()
    context, blocks, anchors = inputs(drafter.config)
    with torch.no_grad():
        assert torch.equal(loaded(context, blocks, anchors), drafter.to(torch.bfloat16)(context, blocks, anchors))
    with pytest.raises(DrafterError, match="exists; pass a new directory"):
        convert_legacy(tmp_path / "old", tmp_path / "new", num_target_layers=6)
    with pytest.raises(DrafterError, match="already in the reference layout"):
        convert_legacy(tmp_path / "new", tmp_path / "newer", num_target_layers=6)


def test_expected_tensors_are_the_module_tree():
    shapes = expected_tensors(sliding_config())
    assert shapes["fc.weight"] == (H, 3 * H) and shapes["layers.2.mlp.down_proj.weight"] == (H, 48)
    assert len(shapes) == 3 + 3 * 11


# --- the command lines ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The tiny chat target (a 4-layer Qwen3.5 hybrid with a chat template) and chat data."""
    from tests.support.dflash_train_fixtures import save_chat_target, write_chat_jsonl

    root = tmp_path_factory.mktemp("chat")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=12)


def hand_written_drafter_for(target_dir, path, **overrides):
    """A reference-layout drafter for the chat target, written with json + safetensors only."""
    from transformers import AutoTokenizer

    target = json.loads((target_dir / "config.json").read_text())
    text = target.get("text_config", target)
    mask = AutoTokenizer.from_pretrained(target_dir).mask_token_id
    values = dict(vocab_size=text["vocab_size"], num_target_layers=text["num_hidden_layers"],
                  dflash_config={"target_layer_ids": [0, 1, 2], "mask_token_id": mask})
    config = reference_config_json(**{**values, **overrides})
    return write_reference_dir(path, config=config)


def test_dflash_eval_runs_a_hand_written_reference_drafter(chat, tmp_path, capsys):
    from dflash.cli import main

    target, data = chat
    drafter = hand_written_drafter_for(target, tmp_path / "drafter")
    argv = ["--target", str(target), "--drafter", str(drafter), "--data", str(data), "--limit", "2",
            "--max-new-tokens", "6", "--device", "cpu", "--json", "--no-baselines"]
    assert main(["eval", *argv]) == 0
    result = json.loads(capsys.readouterr().out)["drafter"]
    assert result["lossless"] is True and result["n_prompts"] == 2 and result["tau"] >= 1.0


@pytest.mark.parametrize("change, code, message", [
    (dict(num_target_layers=8), 7, "trained for a different target: num_target_layers 8 != the target's 4"),
    (dict(hidden_size=64, num_attention_heads=8), 7, "have other shapes than its config.json says"),
    (dict(model_type="qwen3_5"), 7, "model_type 'qwen3_5'"),
])
def test_dflash_eval_names_a_drafter_that_does_not_fit(chat, tmp_path, capsys, change, code, message):
    from dflash.cli import main

    target, data = chat
    drafter = hand_written_drafter_for(target, tmp_path / "drafter", **change)
    assert main(["eval", "--target", str(target), "--drafter", str(drafter), "--data", str(data),
                 "--device", "cpu"]) == code
    assert message in capsys.readouterr().err


def test_dflash_export_converts_an_older_drafter(chat, tmp_path, capsys):
    from dflash.cli import main

    target, _ = chat
    old = make_drafter(tiny_config(vocab_size=400, num_target_layers=4, target_layer_ids=[0, 1, 2]))
    legacy_dir(tmp_path / "old", old)
    assert main(["export", str(tmp_path / "old"), str(tmp_path / "new"), "--target", str(target)]) == 7
    assert "vocab_size 400 != the target's" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "old"), str(tmp_path / "new"), "--num-target-layers", "4"]) == 0
    assert "reference DFlash layout, bf16" in capsys.readouterr().out
    assert read_drafter_config(tmp_path / "new").num_target_layers == 4


def test_dflash_train_continues_a_reference_drafter_with_sliding_layers(chat, tmp_path):
    """--init-drafter: a hand-written drafter with sliding_attention layers trains, checkpoints and is
    written back in the reference layout (bf16) with the same layer types and the target's fingerprint."""
    from dflash.cli import train_main
    from tests.support.dflash_train_fixtures import train_args

    target, data = chat
    init = hand_written_drafter_for(
        target, tmp_path / "init", layer_types=["sliding_attention", "full_attention"], sliding_window=3,
        use_sliding_window=True)
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=2, init_drafter=init)) == 0
    written = json.loads((out / "drafter" / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"] and written["sliding_window"] == 3
    assert written["dtype"] == "bfloat16" and written["target_fingerprint"]
    trained = load_drafter(out / "drafter", dtype=torch.bfloat16)
    start = load_drafter(init, dtype=torch.bfloat16)
    assert not torch.equal(trained.fc.weight, start.fc.weight)  # it trained from there ...
    assert (trained.fc.weight.float() - start.fc.weight.float()).abs().max() < 0.1  # ... not from scratch
    assert train_main(train_args(target, data, tmp_path / "bad", max_steps=1, init_drafter=init,
                                 block_size=8)) == 2
