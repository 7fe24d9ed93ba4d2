"""Target: tiny random Qwen3.5 hybrid and Qwen3 models saved to disk and loaded like real ones."""

import pytest
import torch

from dflash.model.target import Target, TargetError, default_layer_ids
from tests.support.dflash_tiny import save_tiny_target

GDN_FUNCTIONS = {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"}


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_default_layer_ids_follow_the_upstream_rule():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]
    assert default_layer_ids(10, 1) == [5]
    assert default_layer_ids(3, 1) == [1]
    assert default_layer_ids(2, 1) == [0]  # never the last layer, which the serving engines cannot tap
    with pytest.raises(TargetError, match="fewer than the 5 requested; ask for n <= 3"):
        default_layer_ids(6)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_context_is_the_tapped_layers_outputs(kind, qwen35_dir, qwen3_dir):
    target = Target.load(qwen35_dir if kind == "qwen3_5" else qwen3_dir)
    assert all(not p.requires_grad for p in target.model.parameters()) and not target.model.training
    ids = torch.randint(4, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    context = target.context(ids)
    H = target.hidden_size
    assert context.shape == (2, 9, len(target.layer_ids) * H)
    hidden = target.model(ids, output_hidden_states=True).hidden_states  # [0] = embeddings
    for slot, layer in enumerate(target.layer_ids):
        assert torch.allclose(context[..., slot * H:(slot + 1) * H], hidden[layer + 1], atol=1e-6)


def test_context_ends_the_pass_after_the_last_tapped_layer(qwen35_dir):
    """context() runs no layer after the last tapped one (nothing reads them); a full pass (greedy_next, the
    cached passes) runs them all, and both give the same tapped states."""
    target = Target.load(qwen35_dir, layer_ids=[0, 1])
    assert target.num_layers > 2
    ran = []
    handles = [layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k)) for k, layer in enumerate(target._layers)]
    ids = torch.randint(4, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    context = target.context(ids)
    assert ran == [0, 1]
    ran.clear()
    _, full = target.greedy_next(ids)
    assert ran == list(range(target.num_layers))
    assert torch.equal(context, full)
    for handle in handles:
        handle.remove()
    assert not any(layer._forward_hooks for layer in target._layers)  # the pass's own hooks went with it


def test_pipeline_stages_end_their_pass_where_nothing_downstream_reads(qwen35_dir):
    """--layout pipeline: a stage runs through its last layer (the next stage takes its output); the last
    stage passes nothing on and ends after its last tapped layer. The taps are context()'s."""
    from dflash.train.parallel.layouts import PipelineRoles
    from dflash.train.parallel.pipeline import StageTarget

    target = Target.load(qwen35_dir, layer_ids=[0, 1])
    roles = PipelineRoles(stages=((0, 1), (1, target.num_layers)), world_size=3)
    ran = []
    for k, layer in enumerate(target._layers):
        layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k))
    ids = torch.randint(4, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    context = target.context(ids)
    ran.clear()
    first, last = StageTarget(target, roles, 0, ids.device), StageTarget(target, roles, 1, ids.device)
    hidden, taps0 = first.run(ids, attn, None)
    assert ran == [0] and torch.equal(hidden, taps0)
    ran.clear()
    _, taps1 = last.run(ids, attn, None)  # every layer is real here: the stage runs from the embedding
    assert ran == [0, 1] and last.end == 1 < target.num_layers - 1
    H = target.hidden_size
    assert torch.equal(taps0, context[..., :H]) and torch.equal(taps1, context[..., H:])


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_greedy_next_matches_the_model_logits(kind, qwen35_dir, qwen3_dir):
    target = Target.load(qwen35_dir if kind == "qwen3_5" else qwen3_dir)
    ids = torch.randint(4, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    argmax, context = target.greedy_next(ids, chunk=3)  # chunking the head must not change anything
    assert torch.equal(argmax, target.model(ids).logits.argmax(-1))
    assert torch.equal(context, target.context(ids))


def test_embed_and_head_are_the_targets(qwen35_dir):
    target = Target.load(qwen35_dir)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(target.embed(ids), target.model.get_input_embeddings()(ids))
    hidden = torch.randn(2, 3, target.hidden_size)
    assert target.lm_head(hidden).shape == (2, 3, target.vocab_size) == (2, 3, 96)
    assert torch.equal(target.lm_head(hidden), hidden @ target.model.lm_head.weight.T)


def test_facts(qwen35_dir, qwen3_dir):
    hybrid, dense = Target.load(qwen35_dir), Target.load(qwen3_dir)
    assert (hybrid.num_layers, hybrid.hidden_size, hybrid.layer_ids) == (8, 32, [1, 2, 3, 4, 5])
    assert dense.layer_ids == [1, 2, 3]  # 6 layers: only 1..3 can be tapped, so three of them
    assert hybrid.mask_token_id == hybrid.tokenizer.convert_tokens_to_ids("<|MASK|>") == 3
    assert hybrid.device == torch.device("cpu") and hybrid.dtype == torch.float32
    assert Target.load(qwen35_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
    # the fingerprint names the architecture: stable across loads, different between models
    assert hybrid.fingerprint == Target.load(qwen35_dir).fingerprint
    assert hybrid.fingerprint != dense.fingerprint and len(hybrid.fingerprint) == 16


def test_kernel_report_on_cpu_is_all_fallback(qwen35_dir, qwen3_dir):
    report = Target.load(qwen35_dir).kernel_report()
    assert set(report) == GDN_FUNCTIONS and set(report.values()) == {"fallback"}
    assert Target.load(qwen3_dir).kernel_report() == {}


@pytest.mark.gpu
def test_kernel_report_on_gpu_names_the_fast_kernels(qwen35_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("fla.ops.gated_delta_rule")
    target = Target.load(qwen35_dir, device="cuda", dtype=torch.bfloat16)
    report = target.kernel_report()
    assert report["chunk_gated_delta_rule"] == "fast"
    ids = torch.randint(4, 96, (1, 64), device="cuda")
    assert target.context(ids).isfinite().all()


def test_explicit_layer_ids_and_their_errors(qwen35_dir):
    assert Target.load(qwen35_dir, layer_ids=[0, 7]).layer_ids == [0, 7]
    with pytest.raises(TargetError, match=r"layer ids \[8\] do not exist: the target has 8 layers"):
        Target.load(qwen35_dir, layer_ids=[1, 8])
    with pytest.raises(TargetError, match="repeat a layer"):
        Target.load(qwen35_dir, layer_ids=[2, 2])


def test_missing_mask_token_says_how_to_add_one(tmp_path):
    path = save_tiny_target(tmp_path, "qwen3", with_mask=False)
    with pytest.raises(TargetError, match=r"no mask token.*add_special_tokens\(\{'mask_token': '<\|MASK\|>'\}\)"):
        Target.load(path)
    assert Target.load(path, mask_token="w7").mask_token_id == 11
    assert Target.load(path, mask_token=42).mask_token_id == 42
    with pytest.raises(TargetError, match="'<nope>' is not in the target's vocabulary"):
        Target.load(path, mask_token="<nope>")
    with pytest.raises(TargetError, match="outside the target's embedding"):
        Target.load(path, mask_token=500)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        Target.load(tmp_path)


def test_known_family_mask_id_is_used_only_where_the_embedding_has_it():
    from dflash.model.target import _resolve_mask_token
    from tests.support.dflash_tiny import build_tokenizer

    tok = build_tokenizer(with_mask=False)
    assert _resolve_mask_token(tok, "qwen3", 151936, None) == 151669       # Qwen3-8B's embedding rows
    assert _resolve_mask_token(tok, "qwen3_5_text", 248320, None) == 248070
    with pytest.raises(TargetError, match="no mask token"):
        _resolve_mask_token(tok, "qwen3", 96, None)



def test_cpu_tensors_take_the_torch_reference_even_where_fla_resolved(qwen35_dir):
    """transformers (5.24, 5.25) resolves chunk_gated_delta_rule to fla when fla imports; CPU must not reach it."""
    import sys

    from dflash.model.kernels import kernel_functions

    target = Target.load(qwen35_dir)
    Target.load(qwen35_dir)  # routing a second time must not wrap twice
    module = sys.modules[type(target.model).__module__]
    resolved = {fn.name: fn for fn in kernel_functions(module)}
    assert set(resolved) == GDN_FUNCTIONS
    fn = resolved["chunk_gated_delta_rule"]
    routed = getattr(module, fn.attr)
    assert getattr(routed, "__dflash_routed__", False) == fn.fast
    assert not getattr(getattr(routed, "__wrapped__", None), "__dflash_routed__", False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
    kwargs = dict(g=-torch.rand(1, 5, 2, generator=g), beta=torch.rand(1, 5, 2, generator=g),
                  use_qk_l2norm_in_kernel=True)
    out, _ = routed(q, k, v, **kwargs)
    ref, _ = fn.torch_function(q, k, v, **kwargs)
    assert torch.equal(out, ref)
