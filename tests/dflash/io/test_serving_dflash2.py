"""The `serving` tier for DFlash2 drafters: what dflash-train writes, read and computed by the engines' own
code from the pinned wheels (tests/data/serving/engine-pins.txt) and by the reference DFlash2DraftModel.

Run from the wheels, unchanged: vLLM's qwen3_dflash2.py (DFlash2Qwen3ForCausalLM's construction from the
config and load_weights; its CPU convolution `_grouped_conv` and selector scoring
`_score_edges_reference`), SGLang's models/dflash.py (DFlash2DraftModel's construction and load_weights,
its `_grouped_conv` and `_score_edges`, its config parsing) and the reference package's model.py
(DFlash2DraftModel: forward, propose). GPU layers, Triton kernels and distributed state are the
doubles of tests/support/engine_import_double.py, as for DFlash.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dflash.io.drafter_dir import load_drafter, read_drafter_config, save_drafter
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config, DFlash2Drafter
from tests.dflash.io.test_serving_engines import reference_model  # noqa: F401  (the fixture)
from tests.support import engine_import_double as double
from tests.support.serving_wheels import wheel

pytestmark = pytest.mark.serving


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """dflash-train's <out>/drafter of a 3-layer DFlash2 drafter with sliding-window layers."""
    from dflash.cli import train_main
    from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

    root = tmp_path_factory.mktemp("serving2")
    target, data = save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=8)
    argv = train_args(target, data, root / "run", max_steps=1, target_layer_ids="0,1,2", drafter_layers=3,
                      sliding_window=3, drafter_kind="dflash2")
    assert train_main(argv) == 0
    return root / "run" / "drafter"


def random_dflash2(tmp_path, **overrides):
    """A DFlash2 drafter with every tensor random (no identity convolution, no zero codebook), float32."""
    values = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, vocab_size=96, block_size=4, num_target_layers=6, target_layer_ids=[1, 3],
                  mask_token_id=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                  sliding_window=5, conv_group_size=8, conv_kernel_size=2, selector_rank=6, selector_top_k=5,
                  output_multiplier=1.5, final_logit_softcapping=3.0)
    torch.manual_seed(0)
    drafter = DFlash2Drafter(DFlash2Config(**{**values, **overrides}))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return save_drafter(drafter, tmp_path / "dflash2", dtype=torch.float32)


# --- vLLM ------------------------------------------------------------------------------------------------------
def _vllm_engine(current):
    engine = double.vllm(wheel("vllm"), current)
    engine.real.add("vllm.model_executor.models.qwen3_dflash2")
    jit = SimpleNamespace(jit=double.identity_decorator, cdiv=lambda a, b: -(-a // b))
    engine.doubles.update({
        "vllm.triton_utils": {"triton": jit, "tl": SimpleNamespace(constexpr=int)},
        "vllm.compilation.backends": {"set_model_tag": lambda tag: __import__("contextlib").nullcontext()},
    })
    return engine


def test_vllm_registry_maps_the_architecture_to_its_dflash2_model():
    registry = double.literal_assignment(wheel("vllm"), "vllm/model_executor/models/registry.py",
                                         "_SPECULATIVE_DECODING_MODELS")
    assert registry["DFlash2DraftModel"] == ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM")


def test_vllm_builds_the_dflash2_drafter_from_its_config_and_loads_every_tensor(trained):
    from transformers import AutoConfig

    ours = read_drafter_config(trained)
    current = {}
    with _vllm_engine(current) as engine:
        eagle = engine.load("vllm.transformers_utils.configs.eagle")
        hf = eagle.EAGLEConfig(AutoConfig.from_pretrained(trained), method="dflash", model_type="eagle")
        assert hf.architectures == ["DFlash2DraftModel"]
        draft = SimpleNamespace(hf_config=hf, model=str(trained), revision=None, quantization=None)
        current["config"] = spec = SimpleNamespace(
            speculative_config=SimpleNamespace(draft_model_config=draft, num_speculative_tokens=ours.block_size - 1),
            load_config=None, cache_config=None,
            model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: ours.num_target_layers,
                                         get_vocab_size=lambda: ours.vocab_size, dtype=torch.float32))
        module = engine.load("vllm.model_executor.models.qwen3_dflash2")
        model = module.DFlash2Qwen3ForCausalLM(vllm_config=spec, prefix="")
        tensors = load_file(str(trained / "model.safetensors"))
        model.load_weights(list(tensors.items()))
        assert double.check_all_loaded(model, skip=("model.embed_tokens.", "lm_head.", "model.mask_embedding")) == []
        selector = model.model.candidate_selector
        assert (selector.top_k, tuple(selector.predecessor_codebook.shape)) == (
            ours.selector_top_k, (ours.vocab_size, ours.selector_rank))
        assert torch.equal(selector.successor_codebook.data, tensors["candidate_selector.successor_codebook"].float())
        candidates = model.candidate_logits_processor.kwargs
        assert (candidates["scale"], candidates["soft_cap"]) == (ours.output_multiplier, ours.final_logit_softcapping)
        for n, layer in enumerate(model.model.layers):
            for name in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, name)
                assert (conv.block_size, conv.taps, conv.group_size) == (
                    ours.block_size, ours.conv_kernel_size, ours.conv_group_size)
                assert torch.equal(conv.base_kernel.data, tensors[f"layers.{n}.{name}.base_kernel"].float())


def test_vllm_convolution_and_selector_scores_equal_ours(tmp_path):
    """vLLM's CPU paths (the reference its Triton kernels are checked against) on our tensors, float64."""
    ours = load_drafter(random_dflash2(tmp_path, conv_kernel_size=3)).double()
    c, conv = ours.config, ours.layers[0].attention_conv
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3 * c.block_size, c.hidden_size, generator=g, dtype=torch.float64)     # three blocks
    with _vllm_engine({}) as engine:
        module = engine.load("vllm.model_executor.models.qwen3_dflash2")
        with torch.no_grad():
            mine, delta = conv.prepare(x)
            raw = conv.kernel_projection(x[0]).view(-1, 2, conv.taps, conv.groups)  # vLLM's prepare, unbatched
            theirs = module._grouped_conv(x[0], raw[:, 0], conv.base_kernel[0], c.block_size, conv.groups,
                                          c.conv_group_size, conv.taps)
            torch.testing.assert_close(theirs, mine[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(module._grouped_conv(x[0], delta[0], conv.base_kernel[1], c.block_size,
                                                            conv.groups, c.conv_group_size, conv.taps),
                                       conv.finish(x, delta)[0], rtol=0, atol=1e-12)
            # The selector: K x K lattice scores of vLLM against ours, slot by slot.
            n, K = c.block_size - 1, c.selector_top_k
            hidden = torch.randn(2, n, c.hidden_size, generator=g, dtype=torch.float64)
            unary = torch.randn(2, n, K, generator=g, dtype=torch.float64)
            candidates = torch.randint(0, c.vocab_size, (2, n, K), generator=g)
            anchors = torch.tensor([5, 7])
            sel = ours.candidate_selector
            lattice = module._score_edges_reference(sel.predecessor_codebook, sel.successor_codebook, candidates,
                                                    unary, sel.hidden_projection(hidden), anchors, K)
            torch.testing.assert_close(lattice, sel.lattice(hidden, unary, candidates, anchors), rtol=0, atol=1e-6)
            for t in range(n):
                previous = anchors[:, None].expand(-1, K) if t == 0 else candidates[:, t - 1]
                for p in range(K):
                    mine = sel.scores(hidden[:, t], unary[:, t], candidates[:, t], previous[:, p])
                    torch.testing.assert_close(lattice[:, t, p].double(), mine.double(), rtol=0, atol=1e-6)


# --- SGLang ----------------------------------------------------------------------------------------------------
def test_sglang_builds_the_dflash2_drafter_from_its_config_and_loads_every_tensor(trained):
    from transformers import AutoConfig

    ours = read_drafter_config(trained)
    with double.sglang(wheel("sglang")) as engine:
        dflash = engine.load("sglang.srt.models.dflash")
        utils = sys.modules["sglang.srt.speculative.dflash_utils"]
        hf = AutoConfig.from_pretrained(trained)
        parsed = utils.parse_dflash_draft_config(draft_hf_config=hf)
        assert (parsed.conv_kernel_size, parsed.conv_group_size, parsed.selector_rank, parsed.selector_top_k,
                parsed.output_multiplier, parsed.final_logit_softcapping) == (
                    ours.conv_kernel_size, ours.conv_group_size, ours.selector_rank, ours.selector_top_k,
                    ours.output_multiplier, ours.final_logit_softcapping)
        assert "DFlash2DraftModel" in [c.__name__ for c in dflash.EntryClass]
        model = dflash.DFlash2DraftModel(hf)
        tensors = load_file(str(trained / "model.safetensors"))
        model.load_weights(list(tensors.items()))
        assert double.check_all_loaded(model) == []  # SGLang skips unknown names: every parameter is checked
        for name, param in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                assert torch.equal(param.data, tensors[name].float()), name


def test_sglang_convolution_and_selector_scores_equal_ours(tmp_path):
    ours = load_drafter(random_dflash2(tmp_path)).double()
    c, conv = ours.config, ours.layers[1].mlp_conv
    namespace = {"torch": torch, "F": torch.nn.functional}
    w = wheel("sglang")
    grouped = double.real_function(w, "sglang/srt/models/dflash.py", "_grouped_conv", namespace)
    edges = double.real_function(w, "sglang/srt/models/dflash.py", "_score_edges", namespace)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2 * c.block_size, c.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        mine, delta = conv.prepare(x)
        raw = conv.kernel_projection(x[0]).view(-1, 2, conv.taps, conv.groups)
        torch.testing.assert_close(grouped(x[0], raw[:, 0], conv.base_kernel[0], c.block_size, conv.groups,
                                           c.conv_group_size, conv.taps), mine[0], rtol=0, atol=1e-12)
        n, K, sel = c.block_size - 1, c.selector_top_k, ours.candidate_selector
        hidden = torch.randn(1, n, c.hidden_size, generator=g, dtype=torch.float64)
        unary = torch.randn(1, n, K, generator=g, dtype=torch.float64)
        candidates = torch.randint(0, c.vocab_size, (1, n, K), generator=g)
        lattice = edges(predecessor_table=sel.predecessor_codebook, successor_table=sel.successor_codebook,
                        candidate_ids=candidates, unary_logits=unary, hidden=sel.hidden_projection(hidden),
                        anchor_token_ids=torch.tensor([9]), top_k=K)
        for t in range(1, n):
            for p in range(K):
                torch.testing.assert_close(lattice[:, t, p], sel.scores(hidden[:, t], unary[:, t], candidates[:, t],
                                                                         candidates[:, t - 1, p]).double(),
                                           rtol=0, atol=1e-6)


# --- the reference DFlash2DraftModel ------------------------------------------------------------------------------
def test_the_reference_dflash2_model_computes_the_same_in_float64(tmp_path, reference_model):  # noqa: F811
    directory = random_dflash2(tmp_path)
    ours = load_drafter(directory).double().eval()
    model = reference_model.DFlash2DraftModel.from_pretrained(directory, dtype=torch.float64).eval()
    c = ours.config
    g = torch.Generator().manual_seed(3)
    T = 9
    context = torch.randn(1, T, len(c.target_layer_ids) * c.hidden_size, generator=g, dtype=torch.float64)
    blocks = torch.randn(1, 2 * c.block_size, c.hidden_size, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False).double()
    with torch.no_grad():
        # Two blocks in one pass (anchors 4 and 9); the reference runs each alone on the context before it.
        hidden = ours(context, blocks, torch.tensor([[4, T]]))
        for n, anchor in enumerate((4, T)):
            block = blocks[:, n * c.block_size:(n + 1) * c.block_size]
            expected = model(position_ids=torch.arange(anchor + c.block_size).unsqueeze(0), noise_embedding=block,
                             target_hidden=context[:, :anchor])
            mine = hidden[:, n * c.block_size:(n + 1) * c.block_size]
            assert (mine - expected).abs().max().item() <= 1e-6
            torch.testing.assert_close(ours.unary(head(mine)), model.compute_logits(expected, head), rtol=0,
                                       atol=1e-6)
            anchor_id = torch.tensor([11 + n])
            path, _, _ = model.propose(expected[:, 1:], anchor_id, head, 0.0)
            assert ours.propose(mine[:, 1:], anchor_id, head).tolist() == path.tolist()
