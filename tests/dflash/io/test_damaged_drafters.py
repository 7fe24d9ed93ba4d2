"""Single-edit damage to a drafter on disk: a tiny valid drafter written by the project's own writer
(save_drafter), then one edit at a time to its config.json or to one tensor of model.safetensors. Each
damaged copy must be refused by load_drafter with a DrafterError naming the key or tensor, the value seen
and what to do; the untouched drafter, and edits that change nothing an engine computes, must still load.

The edits are generated: every size key at 0 and -1, every positive float key at 0, -1 and NaN, every
tensor with a NaN and in float16; then a hand-written table for the cross-key rules (layer ids, mask id,
layer types, keys written twice, dtype names)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.errors import DrafterError
from dflash.io.drafter_dir import expected_tensors, load_drafter, read_drafter_config, save_drafter
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config, DFlash2Drafter
from dflash.model.drafter import Drafter, DrafterConfig

SLIDING, FULL = "sliding_attention", "full_attention"
SHAPE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=48, vocab_size=96, block_size=4, num_target_layers=6, target_layer_ids=[1, 2, 3],
             mask_token_id=3, layer_types=[SLIDING, SLIDING, FULL], sliding_window=3, target_fingerprint="abc")
CONFIG = DrafterConfig(**SHAPE)
DFLASH2 = DFlash2Config(**{**SHAPE, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5})
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """kind -> a drafter directory as save_drafter writes it (bf16; "fp32": a training checkpoint's)."""
    root = tmp_path_factory.mktemp("drafters")
    torch.manual_seed(0)
    return {"dflash": save_drafter(Drafter(CONFIG), root / "dflash"),
            "fp32": save_drafter(Drafter(CONFIG), root / "fp32", dtype=None),
            "dflash2": save_drafter(DFlash2Drafter(DFLASH2), root / "dflash2")}


def damaged_copy(pristine, tmp_path, kind="dflash", config=None, tensors=None):
    """A copy of the pristine `kind` drafter with `config(data)` applied to its config.json and
    `tensors(state)` to its tensors (each edits in place)."""
    directory = shutil.copytree(pristine[kind], tmp_path / kind)
    if config:
        data = json.loads((directory / "config.json").read_text())
        config(data)
        (directory / "config.json").write_text(json.dumps(data))  # NaN is written as NaN, as json.loads reads it
    if tensors:
        state = load_file(str(directory / "model.safetensors"))
        tensors(state)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def set_key(dotted: str, value):
    """An edit setting config key `dotted` (one level of nesting: "dflash_config.mask_token_id")."""
    def edit(data: dict) -> None:
        head, _, tail = dotted.partition(".")
        if tail:
            data[head] = {**(data.get(head) or {}), tail: value}
        else:
            data[head] = value
    return edit


def assert_refused(directory, words) -> None:
    with pytest.raises(DrafterError) as err:
        load_drafter(directory)
    message = str(err.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert err.value.exit_code == 7


# --- the untouched drafters load ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind, config, dtype", [("dflash", CONFIG, torch.bfloat16),
                                                 ("fp32", CONFIG, torch.float32),
                                                 ("dflash2", DFLASH2, torch.bfloat16)])
def test_the_untouched_drafter_loads(pristine, kind, config, dtype):
    assert read_drafter_config(pristine[kind]) == config
    loaded = load_drafter(pristine[kind], dtype=dtype)
    assert loaded.config == config and loaded.fc.weight.dtype == dtype
    assert all(torch.isfinite(t).all() for t in loaded.state_dict().values())


@pytest.mark.parametrize("dotted, value", [
    ("rope_theta", 1000000),                  # the same base, an int
    ("rope_parameters.rope_theta", 1e6),
    ("dflash_config.block_size", 4),          # both copies, equal
    ("dflash_config.num_target_layers", 6),
    ("dtype", "torch.bfloat16"),
    ("torch_dtype", "bfloat16"),
    ("transformers_version", "5.24.0"),
    ("max_window_layers", 0),
])
def test_an_edit_that_changes_nothing_computed_still_loads(pristine, tmp_path, dotted, value):
    directory = damaged_copy(pristine, tmp_path, config=set_key(dotted, value))
    assert load_drafter(directory).config == CONFIG


# --- config.json: generated edits --------------------------------------------------------------------------
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "max_position_embeddings", "num_target_layers", "block_size")
POSITIVE_KEYS = ("rms_norm_eps", "rope_theta", "rope_parameters.rope_theta", "initializer_range")
GENERATED = (
    [pytest.param(key, value, [f"{key} is {value}", "it must be an integer >="], id=f"{key}={value}")
     for key in SIZE_KEYS for value in (0, -1)]
    + [pytest.param(key, value, [f"{key} is {value!r}", "must be a finite number > 0"], id=f"{key}={value}")
       for key in POSITIVE_KEYS for value in (0, -1, NAN, "x")]
)


@pytest.mark.parametrize("dotted, value, words", GENERATED)
def test_a_nonsense_size_or_constant_is_refused_by_name(pristine, tmp_path, dotted, value, words):
    assert_refused(damaged_copy(pristine, tmp_path, config=set_key(dotted, value)), words)


# --- config.json: the cross-key rules ----------------------------------------------------------------------
CONFIG_EDITS = [
    ("block_size", 1, ["block_size is 1", ">= 2"]),
    ("head_dim", 7, ["head_dim 7 must be even"]),
    ("num_key_value_heads", 3, ["num_attention_heads 4 is not a multiple of num_key_value_heads 3"]),
    ("num_hidden_layers", 2, ["layer_types", "must name 2 layers"]),
    ("num_target_layers", 3, ["target_layer_ids [1, 2, 3] must lie in 0..2"]),
    ("vocab_size", 3, ["mask_token_id 3 is outside the vocabulary (0..2)"]),
    ("hidden_size", 64, ["other shapes", "fc.weight"]),
    ("intermediate_size", 64, ["other shapes", "layers.0.mlp.down_proj.weight"]),
    ("num_attention_heads", 8, ["other shapes", "layers.0.self_attn.q_proj.weight"]),
    ("dflash_config.target_layer_ids", [1, 2, 6], ["target_layer_ids [1, 2, 6] must lie in 0..5"]),
    ("dflash_config.target_layer_ids", [-1, 2, 3], ["target_layer_ids [-1, 2, 3] must lie in 0..5"]),
    ("dflash_config.target_layer_ids", [3, 2, 1], ["target_layer_ids [3, 2, 1] must be distinct and ascending"]),
    ("dflash_config.target_layer_ids", [1, 1, 2], ["target_layer_ids [1, 1, 2] must be distinct and ascending"]),
    ("dflash_config.target_layer_ids", [], ["target_layer_ids is empty"]),
    ("dflash_config.target_layer_ids", "1,2,3", ["dflash_config.target_layer_ids is '1,2,3'"]),
    ("dflash_config.mask_token_id", 96, ["mask_token_id 96 is outside the vocabulary (0..95)"]),
    ("dflash_config.mask_token_id", -1, ["mask_token_id -1 is outside the vocabulary"]),
    ("dflash_config.block_size", 8, ["block_size is 4 but dflash_config.block_size is 8"]),
    ("dflash_config.num_target_layers", 8, ["num_target_layers is 6 but dflash_config.num_target_layers is 8"]),
    ("rope_theta", 10000.0, ["rope_parameters.rope_theta is 1000000.0 but rope_theta is 10000.0"]),
    ("rope_parameters.rope_theta", 10000.0, ["rope_parameters.rope_theta is 10000.0 but rope_theta is 1000000.0"]),
    ("layer_types", [SLIDING, FULL], ["layer_types", "must name 3 layers"]),
    ("layer_types", [SLIDING, "banana", FULL], ["layer_types has ['banana']"]),
    ("layer_types", "full_attention", ["layer_types is 'full_attention'"]),
    ("sliding_window", 0, ["sliding_window is 0", "an integer >= 1"]),
    ("sliding_window", -3, ["sliding_window is -3", "an integer >= 1"]),
    ("sliding_window", 2.5, ["sliding_window is 2.5", "an integer >= 1"]),
    ("use_sliding_window", False, ["use_sliding_window is False", "\"use_sliding_window\": true"]),
    ("max_window_layers", -1, ["max_window_layers is -1"]),
    ("dtype", "float16", ["dtype is 'float16' but the tensors in model.safetensors are bfloat16",
                          "\"dtype\": \"bfloat16\""]),
    ("dtype", "int8", ["dtype is 'int8'"]),
    ("torch_dtype", "float32", ["torch_dtype is 'float32' but the tensors in model.safetensors are bfloat16"]),
    ("model_type", "llama", ["model_type 'llama'"]),
    ("architectures", ["Qwen3ForCausalLM"], ["architectures ['Qwen3ForCausalLM']"]),
    ("hidden_act", "gelu", ["hidden_act = 'gelu'"]),
    ("attention_bias", True, ["attention_bias = true"]),
    ("rope_parameters.rope_type", "yarn", ["rope_parameters.rope_type = 'yarn'"]),
]


@pytest.mark.parametrize("dotted, value, words", CONFIG_EDITS, ids=[f"{k}={v!r}" for k, v, _ in CONFIG_EDITS])
def test_a_config_edit_is_refused_by_name(pristine, tmp_path, dotted, value, words):
    assert_refused(damaged_copy(pristine, tmp_path, config=set_key(dotted, value)), words)


def test_every_config_refusal_says_what_to_do(pristine, tmp_path):
    """A DrafterConfig rule (layer ids, mask id, layer types) ends with the fix, not only the rule."""
    directory = damaged_copy(pristine, tmp_path, config=set_key("dflash_config.mask_token_id", 96))
    assert_refused(directory, ["Fix that key in config.json", "restore the config.json that came with"])


# --- model.safetensors: generated edits --------------------------------------------------------------------
def poison(name: str, value: float):
    def edit(state: dict) -> None:
        state[name].view(-1)[state[name].numel() // 2] = value
    return edit


def cast(name: str, dtype: torch.dtype):
    def edit(state: dict) -> None:
        state[name] = state[name].to(dtype)
    return edit


NAMES = sorted(expected_tensors(CONFIG))


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_in_any_tensor_is_refused_naming_it(pristine, tmp_path, name):
    directory = damaged_copy(pristine, tmp_path, tensors=poison(name, NAN))
    read_drafter_config(directory)  # the headers are sound: only reading the weights finds it
    assert_refused(directory, ["non-finite weights", f"{name} (1 NaN, 0 inf of", "use an earlier checkpoint"])


@pytest.mark.parametrize("name", NAMES)
def test_any_tensor_in_float16_is_refused_naming_it(pristine, tmp_path, name):
    directory = damaged_copy(pristine, tmp_path, tensors=cast(name, torch.float16))
    with pytest.raises(DrafterError, match=f"{name} is float16 \\(F16\\)"):
        read_drafter_config(directory)  # from the header, before a weight is read
    assert_refused(directory, [f"{name} is float16 (F16)", "cast every tensor to bfloat16"])


# --- model.safetensors: the other damage -------------------------------------------------------------------
def every(dtype: torch.dtype):
    def edit(state: dict) -> None:
        for name in state:
            state[name] = state[name].to(dtype)
    return edit


def drop(name: str):
    return lambda state: state.pop(name)


def rename(old: str, new: str):
    return lambda state: state.__setitem__(new, state.pop(old))


TENSOR_EDITS = [
    ("fc+inf", poison("fc.weight", INF), ["fc.weight (0 NaN, 1 inf of 3072 values)"]),
    ("norm-inf", poison("norm.weight", -INF), ["norm.weight (0 NaN, 1 inf of 32 values)"]),
    ("all-float16", every(torch.float16), ["every tensor is float16 (F16)"]),
    ("all-float64", every(torch.float64), ["every tensor is float64 (F64)"]),
    ("all-float32-config-says-bf16", every(torch.float32),
     ["dtype is 'bfloat16' but the tensors in model.safetensors are float32"]),
    ("one-float32", cast("norm.weight", torch.float32), ["mix dtypes: norm.weight is float32 (F32)", "bfloat16 (BF16)"]),
    ("one-int32", cast("layers.1.input_layernorm.weight", torch.int32),
     ["layers.1.input_layernorm.weight is int32 (I32)"]),
    ("one-int8", cast("fc.weight", torch.int8), ["fc.weight is int8 (I8)"]),
    ("missing", drop("layers.2.mlp.up_proj.weight"), ["missing ['layers.2.mlp.up_proj.weight']"]),
    ("extra", lambda state: state.__setitem__("lm_head.weight", torch.zeros(96, 32, dtype=torch.bfloat16)),
     ["extra ['lm_head.weight']"]),
    ("model-prefix", rename("norm.weight", "model.norm.weight"), ["\"model.\" prefix"]),
    ("transposed", lambda state: state.__setitem__("fc.weight", state["fc.weight"].t().contiguous()),
     ["fc.weight: file (96, 32), config (32, 96)"]),
]


@pytest.mark.parametrize("edit, words", [pytest.param(e, w, id=i) for i, e, w in TENSOR_EDITS])
def test_a_tensor_edit_is_refused_by_name(pristine, tmp_path, edit, words):
    assert_refused(damaged_copy(pristine, tmp_path, tensors=edit), words)


def test_a_float32_checkpoint_drafter_is_read_but_a_nan_in_it_is_not(pristine, tmp_path):
    """float32 is what training checkpoints keep (save_drafter dtype=None); their weights are checked too."""
    assert load_drafter(pristine["fp32"]).fc.weight.dtype == torch.float32
    assert_refused(damaged_copy(pristine, tmp_path, "fp32", tensors=poison("layers.0.self_attn.o_proj.weight", NAN)),
                   ["layers.0.self_attn.o_proj.weight (1 NaN"])


# --- DFlash2: its own keys and tensors ---------------------------------------------------------------------
@pytest.mark.parametrize("config, tensors, words", [
    (set_key("dflash_config.output_multiplier", NAN), None, ["dflash_config.output_multiplier is nan"]),
    (set_key("dflash_config.output_multiplier", INF), None, ["dflash_config.output_multiplier is inf"]),
    (set_key("dflash_config.output_multiplier", -1.0), None, ["output_multiplier -1.0 must be positive"]),
    (set_key("dflash_config.selector_top_k", 0), None, ["dflash_config.selector_top_k is 0"]),
    (None, poison("candidate_selector.predecessor_codebook", NAN), ["candidate_selector.predecessor_codebook (1 NaN"]),
    (None, cast("layers.1.mlp_conv.base_kernel", torch.float16), ["layers.1.mlp_conv.base_kernel is float16"]),
], ids=["multiplier-nan", "multiplier-inf", "multiplier-negative", "top-k-0", "codebook-nan", "conv-fp16"])
def test_a_dflash2_edit_is_refused_by_name(pristine, tmp_path, config, tensors, words):
    assert_refused(damaged_copy(pristine, tmp_path, "dflash2", config=config, tensors=tensors), words)
