"""The `serving` tier: drafters written by dflash-train, read by the engines' own code from their pinned
released wheels (tests/data/serving/engine-pins.txt), and by the reference DFlash package.

What runs, unchanged, from the wheels: vLLM's draft config wrapper (EAGLEConfig), model registry entry,
tapped-layer rule (get_eagle3_aux_layers_from_config), mask-id lookup, the DFlash model's construction
from the config (DFlashQwen3ForCausalLM, its decoder layers' attention resolution, Qwen2MLP) and its
load_weights through the WeightsMapper and AutoWeightsLoader; SGLang's parse_dflash_draft_config,
get_dflash_layer_types and get_dflash_attention_sliding_window_size, the DFlashDraftModel's construction
and load_weights, the mask token resolution of its DFlash worker and its Qwen3.5 tapped-layer rule; the
reference package's
DFlashDraftModel, forward and spec_generate. What does not: GPU layers, kernels and distributed state,
which tests/support/engine_import_double.py stands in for with layers of the same parameter shapes whose
weight loaders check and record every shard. Any missing key, unmapped tensor, parameter left unloaded
or shape mismatch fails a test.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dflash.io.drafter_dir import load_drafter, read_drafter_config
from dflash.io.engines import last_layer_problem, mask_token_problem
from tests.support import engine_import_double as double
from tests.support.serving_wheels import wheel

pytestmark = pytest.mark.serving

KINDS = ["full", "sliding"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """dflash-train's <out>/drafter of a 2-layer full-attention and a 3-layer sliding-window drafter."""
    from dflash.cli import train_main
    from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

    root = tmp_path_factory.mktemp("serving")
    target, data = save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=8)
    runs = {"full": dict(drafter_layers=2), "sliding": dict(drafter_layers=3, sliding_window=3)}
    out = {}
    for kind, extra in runs.items():
        argv = train_args(target, data, root / kind, max_steps=1, target_layer_ids="0,1,2", **extra)
        assert train_main(argv) == 0
        out[kind] = root / kind / "drafter"
    return out


def _tensors(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def _stacked_equal(param, parts) -> bool:
    return torch.equal(param.data, torch.cat([p.float() for p in parts]).to(param.dtype))


# --- vLLM ----------------------------------------------------------------------------------------------------
def _vllm_config(hf, directory, target_layers: int, vocab: int):
    draft = SimpleNamespace(hf_config=hf, model=str(directory), revision=None, quantization=None)
    return SimpleNamespace(
        speculative_config=SimpleNamespace(draft_model_config=draft), load_config=None, cache_config=None,
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: target_layers, get_vocab_size=lambda: vocab,
                                     dtype=torch.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_builds_the_drafter_from_its_config_and_loads_every_tensor(trained, kind):
    from transformers import AutoConfig

    directory = trained[kind]
    ours = read_drafter_config(directory)
    w = wheel("vllm")
    registry = double.literal_assignment(w, "vllm/model_executor/models/registry.py", "_SPECULATIVE_DECODING_MODELS")
    assert registry["DFlashDraftModel"] == ("qwen3_dflash", "DFlashQwen3ForCausalLM")
    current = {}
    with double.vllm(w, current) as engine:
        eagle = engine.load("vllm.transformers_utils.configs.eagle")
        hf = eagle.EAGLEConfig(AutoConfig.from_pretrained(directory), method="dflash", model_type="eagle")
        assert hf.architectures == ["DFlashDraftModel"]  # not renamed: the registry entry above is the one used
        spec = _vllm_config(hf, directory, ours.num_target_layers, ours.vocab_size)
        current["config"] = spec
        aux = engine.load("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils")
        assert aux.get_eagle3_aux_layers_from_config(spec.speculative_config) == tuple(
            i + 1 for i in ours.target_layer_ids)
        mask_id = double.real_function(w, "vllm/v1/worker/gpu/spec_decode/utils.py", "get_parallel_drafting_token_id")
        assert mask_id(hf) == ours.mask_token_id

        dflash = engine.load("vllm.model_executor.models.qwen3_dflash")
        model = dflash.DFlashQwen3ForCausalLM(vllm_config=spec, prefix="")
        tensors = _tensors(directory)
        model.load_weights(list(tensors.items()))
        # Everything the drafter brings is loaded, every shard once; the embedding and head are the target's.
        assert double.check_all_loaded(model, skip=("model.embed_tokens.", "lm_head.", "model.mask_embedding")) == []
        assert model.draft_id_to_target_id is None and not model.model.has_separate_mask_embedding
        assert tuple(model.model.fc.weight.shape) == (ours.hidden_size, len(ours.target_layer_ids) * ours.hidden_size)
        for n, (layer, kind_n) in enumerate(zip(model.model.layers, ours.layer_types, strict=True)):
            p = f"layers.{n}."
            attn = layer.self_attn
            assert _stacked_equal(attn.qkv_proj.weight, [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            assert _stacked_equal(layer.mlp.gate_up_proj.weight,
                                  [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
            # What the project's masks.py computes: full layers non-causal, sliding ones causal in a window.
            sliding = kind_n == "sliding_attention"
            assert (attn.sliding_window, attn.causal) == ((ours.sliding_window, True) if sliding else (None, False))
            assert attn.attn.kwargs["per_layer_sliding_window"] == (ours.sliding_window if sliding else None)
            assert attn.rotary_emb.kwargs["is_neox_style"] is True
            assert attn.rotary_emb.kwargs["rope_parameters"]["rope_theta"] == ours.rope_theta
            assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (
                ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim)


def test_vllm_refuses_a_tensor_it_cannot_place(trained):
    """The tier fails on an unmapped tensor: vLLM's loader raises on it."""
    from transformers import AutoConfig

    directory = trained["full"]
    ours = read_drafter_config(directory)
    current = {}
    with double.vllm(wheel("vllm"), current) as engine:
        eagle = engine.load("vllm.transformers_utils.configs.eagle")
        hf = eagle.EAGLEConfig(AutoConfig.from_pretrained(directory), method="dflash", model_type="eagle")
        current["config"] = spec = _vllm_config(hf, directory, ours.num_target_layers, ours.vocab_size)
        model = engine.load("vllm.model_executor.models.qwen3_dflash").DFlashQwen3ForCausalLM(vllm_config=spec)
        tensors = _tensors(directory)
        tensors["layers.0.gate_proj.weight"] = tensors.pop("layers.0.mlp.gate_proj.weight")  # the older layout
        with pytest.raises(ValueError, match="no module or parameter named 'layers.0.gate_up_proj'"):
            model.load_weights(list(tensors.items()))


# --- SGLang --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_sglang_builds_the_drafter_from_its_config_and_loads_every_tensor(trained, kind):
    from transformers import AutoConfig

    directory = trained[kind]
    ours = read_drafter_config(directory)
    with double.sglang(wheel("sglang")) as engine:
        dflash = engine.load("sglang.srt.models.dflash")
        utils = sys.modules["sglang.srt.speculative.dflash_utils"]
        hf = AutoConfig.from_pretrained(directory)
        parsed = utils.parse_dflash_draft_config(draft_hf_config=hf)
        assert (parsed.num_hidden_layers, parsed.num_target_layers, parsed.block_size) == (
            ours.num_hidden_layers, ours.num_target_layers, ours.block_size)
        assert parsed.target_layer_ids == ours.target_layer_ids and parsed.mask_token_id == ours.mask_token_id
        assert parsed.resolve_target_layer_ids(target_num_layers=ours.num_target_layers) == ours.target_layer_ids
        assert (parsed.conv_kernel_size, parsed.selector_rank, parsed.projector_type, parsed.output_multiplier,
                parsed.final_logit_softcapping, parsed.attention_sink_bias, parsed.attention_value_scale) == (
                    0, 0, None, 1.0, None, False, None)
        assert "DFlashDraftModel" in [c.__name__ for c in dflash.EntryClass]

        model = dflash.DFlashDraftModel(hf)
        tensors = _tensors(directory)
        model.load_weights(list(tensors.items()))
        # SGLang skips a name it cannot resolve, so "all loaded" is checked here, parameter by parameter.
        assert double.check_all_loaded(model) == []
        assert torch.equal(model.fc.weight.data, tensors["fc.weight"].float())
        window = utils.get_dflash_attention_sliding_window_size(hf)
        assert window == (ours.sliding_window - 1 if ours.sliding_window else None)  # SGLang stores window - 1
        for n, (layer, kind_n) in enumerate(zip(model.layers, ours.layer_types, strict=True)):
            p = f"layers.{n}."
            attn = layer.self_attn
            assert _stacked_equal(attn.qkv_proj.weight, [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            assert _stacked_equal(layer.mlp.gate_up_proj.weight,
                                  [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
            sliding = kind_n == "sliding_attention"
            assert (attn.sliding_window_size, attn.attn_type) == (
                (window, "decoder") if sliding else (-1, "encoder_only"))
            assert not attn.use_gemma_norm and attn.v_scale is None and attn.attention_sink_bias is None
            rope = attn.rotary_emb.kwargs
            assert (rope["rotary_dim"], rope["is_neox_style"], rope["partial_rotary_factor"], rope["base"]) == (
                ours.head_dim, True, 1.0, ours.rope_theta)


def test_sglang_skips_a_tensor_it_cannot_place_and_the_tier_catches_it(trained):
    from transformers import AutoConfig

    directory = trained["full"]
    with double.sglang(wheel("sglang")) as engine:
        model = engine.load("sglang.srt.models.dflash").DFlashDraftModel(AutoConfig.from_pretrained(directory))
        tensors = _tensors(directory)
        tensors["layers.1.post_attn_norm.weight"] = tensors.pop("layers.1.post_attention_layernorm.weight")
        model.load_weights(list(tensors.items()))  # no error from SGLang itself
        assert double.check_all_loaded(model) == ["layers.1.post_attention_layernorm.weight (loaded nothing of "
                                                  "['None'])"]


def _tokenizer_worker(tokenizer, vocab_size):
    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab_size))
    return SimpleNamespace(target_worker=SimpleNamespace(model_runner=runner, tokenizer=tokenizer))


def test_sglang_mask_token_rule_agrees_with_the_training_check():
    from tests.support.dflash_tiny import build_tokenizer

    w = wheel("sglang")
    resolve = double.real_function(w, "sglang/srt/speculative/dflash_worker_v2.py",
                                   "DFlashWorkerV2._resolve_mask_token_id",
                                   {"Optional": object, "get_parallel": lambda: SimpleNamespace(tp_rank=0),
                                    "logger": double.logger_double()})
    tokenizer = build_tokenizer()  # <|MASK|> is id 3
    worker = _tokenizer_worker(tokenizer, 96)
    assert resolve(worker, mask_token="<|MASK|>", mask_token_id=3) == 3
    assert mask_token_problem(tokenizer, 3) is None
    with pytest.raises(ValueError, match="conflicts with tokenizer vocab id"):
        resolve(worker, mask_token="<|MASK|>", mask_token_id=5)
    assert mask_token_problem(tokenizer, 5) is not None


def test_sglang_qwen3_5_tapped_layer_rule_agrees_with_the_training_check():
    set_layers = double.real_function(wheel("sglang"), "sglang/srt/models/qwen3_5_text.py",
                                      "Qwen3_5ForCausalLM.set_dflash_layers_to_capture")
    captured = []
    fake = SimpleNamespace(pp_group=SimpleNamespace(world_size=1, is_last_rank=True),
                           model=SimpleNamespace(layers=[None] * 8, set_dflash_layers_to_capture=captured.append))
    set_layers(fake, [1, 3, 6])
    assert captured == [[2, 4, 7]] and last_layer_problem([1, 3, 6], 8) is None
    with pytest.raises(ValueError, match=r"in \[0, 7\)"):
        set_layers(fake, [1, 3, 7])
    assert "last layer" in last_layer_problem([1, 3, 7], 8)


# --- the reference DFlash package ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_model():
    """dflash 0.1.0's model.py (the reference DFlashDraftModel), executed from its wheel under its own name."""
    import importlib.util
    import zipfile

    with zipfile.ZipFile(wheel("dflash")) as z:
        source = z.read("dflash/model.py")
    spec = importlib.util.spec_from_loader("reference_dflash_model", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # transformers resolves the class's annotations through its module
    try:
        exec(compile(source, "dflash-0.1.0.whl/dflash/model.py", "exec"), module.__dict__)
        _follow_the_installed_cache_api(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _follow_the_installed_cache_api(module) -> None:
    """dflash 0.1.0 pins transformers 5.15 and calls `cache.activate_past_recording()` with no count. From
    transformers 5.25 a GatedDeltaNet cache layer keeps the recurrent states a later `crop` rolls back to only when
    given `recurrent_states_to_keep`; without it Qwen3.5's layer fails at `min(None, seq_len)`. Under such a
    transformers the reference's own cache helper is given the count its rollback needs (at most a block, here
    far fewer than 64 tokens); everything else the test runs is the reference's code as shipped."""
    import inspect

    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    if "recurrent_states_to_keep" not in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters:
        return

    def make_cache(config):
        cache = DynamicCache(config=config)
        cache.activate_past_recording(recurrent_states_to_keep=64)
        return cache

    module._make_cache = make_cache


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_class_loads_the_drafter_and_computes_the_same(trained, reference_model, kind):
    directory = trained[kind]
    model = reference_model.DFlashDraftModel.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_drafter(directory).eval()
    assert model.target_layer_ids == ours.config.target_layer_ids and model.block_size == ours.config.block_size
    assert model.mask_token_id == ours.config.mask_token_id
    H, T, bs = ours.config.hidden_size, 7, ours.config.block_size
    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, T, len(ours.config.target_layer_ids) * H, generator=g)
    block = torch.randn(1, bs, H, generator=g)
    with torch.no_grad():
        expected = ours(context, block, torch.tensor([[T]]))
        got = model(position_ids=torch.arange(T + bs).unsqueeze(0), noise_embedding=block, target_hidden=context)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_reference_spec_generate_with_a_trained_drafter_is_lossless(trained, reference_model):
    from transformers import AutoModelForCausalLM

    directory = trained["sliding"]
    target_dir = directory.parent.parent / "target"
    model = reference_model.DFlashDraftModel.from_pretrained(directory, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    stop = json.loads((target_dir / "config.json").read_text()).get("eos_token_id")
    out = model.spec_generate(target=target, input_ids=prompt, max_new_tokens=10, stop_token_ids=None)
    greedy = target.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=stop)
    assert out[:, :greedy.shape[1]].tolist() == greedy.tolist()


# --- what the docs and the key lists cite ------------------------------------------------------------------------
def _citations(text: str):
    """(path, [identifiers]) for each "path/to/file.py (name, name: note)" in a citation string."""
    import re

    for m in re.finditer(r"((?:vllm|sglang)/[\w/]+\.py)(?: \(([^)]*)\))?", text):
        names = re.findall(r"\b_?[A-Za-z]\w*(?=[,;:)]|$)", m[2] or "")
        yield m[1], [n for n in names if "_" in n or n[0].isupper()]


def test_every_engine_file_and_function_the_key_lists_cite_is_in_the_pinned_release():
    import zipfile

    from tests.dflash.io.test_drafter_io import ENGINE_TENSORS, OPTIONAL_KEYS, SGLANG_KEYS, VLLM_KEYS

    cited = [*VLLM_KEYS.values(), *SGLANG_KEYS.values(), *(r for _, r in OPTIONAL_KEYS.values()),
             *ENGINE_TENSORS.values()]
    with zipfile.ZipFile(wheel("vllm")) as v, zipfile.ZipFile(wheel("sglang")) as s:
        files = {**{n: v for n in v.namelist()}, **{n: s for n in s.namelist()}}
        checked = 0
        for text in cited:
            for path, names in _citations(text.replace("vllm qwen3_dflash.py", "vllm/model_executor/models/"
                                                       "qwen3_dflash.py")):
                assert path in files, f"{path} (cited: {text}) is not in the pinned wheels"
                source = files[path].read(path).decode()
                for name in names:
                    assert name in source, f"{name} is not in {path} (cited: {text})"
                checked += 1
    assert checked > 30


def test_every_vllm_environment_variable_the_docs_name_exists_in_the_pinned_release():
    import re
    import zipfile
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "evaluation-and-serving.md").read_text()
    with zipfile.ZipFile(wheel("vllm")) as v:
        envs = v.read("vllm/envs.py").decode()
    for name in set(re.findall(r"\bVLLM_[A-Z0-9_]+", docs)):
        assert f'"{name}"' in envs, f"docs name {name}, which vllm {wheel('vllm').name} does not read"
