"""Which keys a drafter's config.json may hold: the strict reading of `dflash.io.drafter_dir`.

Every key is one this project implements (_READ), one that changes nothing the drafter computes
(_INERT), or one that changes what vLLM, SGLang or the reference DFlashDraftModel compute; such a key is
accepted only at the value that computes what this project's drafter does (_SEMANTIC, _DFLASH_SEMANTIC).
`unsupported_keys` names every other one, so a drafter the project cannot run as the engines would is
refused before a weight is read.
"""

from __future__ import annotations

# Reading is strict: every key of a drafter's config.json is one this project implements (_READ), one
# that changes nothing the drafter computes (_INERT), or one that changes what vLLM, SGLang or the
# reference DFlashDraftModel compute; such a key is accepted only at the value that computes what this
# project's drafter does (_SEMANTIC, _DFLASH_SEMANTIC). Anything else is refused, named.
_READ = {
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta",
    "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size", "layer_types", "sliding_window",
    "use_sliding_window", "max_window_layers", "block_size", "num_target_layers", "dflash_config",
    "initializer_range", "target_fingerprint", "eagle_aux_hidden_state_layer_ids", "attention_bias", "format",
}
_INERT = {  # transformers' bookkeeping, token ids of a tokenizer the drafter has none of, no-LM-head options
    "auto_map", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "attention_dropout",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params", "use_bfloat16",
}


def _one_of(*values):
    return lambda value, data: value in values


def _absent_or(key):
    return lambda value, data: value is None or value == data.get(key)


# key -> (does the value compute what this project computes?, what the key changes and where).
_SEMANTIC = {
    "is_neox_style": (_one_of(None, True), "vLLM's RoPE layout (qwen3_dflash.py; false = interleaved pairs)"),
    "rope_is_neox_style": (_one_of(None, True), "SGLang's RoPE layout (models/dflash.py)"),
    "partial_rotary_factor": (_one_of(None, 1, 1.0), "how many head dims SGLang rotates (models/dflash.py)"),
    "use_gemma_norm": (_one_of(None, False), "SGLang's norms: Gemma's (1 + weight) RMSNorm (models/dflash.py)"),
    "is_causal": (_one_of(None), "causality of every layer in vLLM, SGLang and the reference model"),
    "logit_scale": (_one_of(None, 1, 1.0), "vLLM's logits scale (qwen3_dflash.py LogitsProcessor)"),
    "draft_vocab_size": (_absent_or("vocab_size"), "vLLM's draft vocabulary and draft-to-target id map"),
    "target_hidden_size": (_absent_or("hidden_size"), "the width of the fc input in vLLM (qwen3_dflash.py)"),
    "has_own_lm_head": (_one_of(None, False), "whether vLLM uses a drafter LM head instead of the target's"),
    "has_lm_head": (_one_of(None, False), "SGLang's drafter-owned LM head (Nemotron 3.5 layout)"),
    "has_embed_tokens": (_one_of(None, False), "SGLang's drafter-owned embedding (Nemotron 3.5 layout)"),
    "use_aux_hidden_state": (_one_of(None, True), "whether vLLM builds fc over tapped target states at all"),
    "add_swa_attention_sink_bias": (_one_of(None, False), "per-head attention sinks in vLLM"),
    "eagle_config": (_one_of(None, {}), "vLLM merges it into dflash_config (qwen3_dflash.py)"),
    "quantization_config": (_one_of(None), "quantized drafter weights, which this project does not read"),
    "mask_token": (_one_of(None, "<|MASK|>"), "the token SGLang resolves the mask id against (dflash_utils.py)"),
    "input_embedding_scale": (_one_of(None, 1, 1.0), "the reference model's scale of block embeddings"),
    "output_multiplier": (_one_of(None, 1, 1.0), "the reference model's logits multiplier"),
    "final_logit_softcapping": (_one_of(None, 0, 0.0), "the reference model's logit soft-capping"),
    "target_layer_ids": (lambda v, d: v is None or v == (d.get("dflash_config") or {}).get("target_layer_ids"),
                         "the tapped layers the reference model, vLLM and SGLang fall back to"),
    "mask_token_id": (lambda v, d: v is None or v == (d.get("dflash_config") or {}).get("mask_token_id"),
                      "the mask id vLLM and SGLang fall back to"),
}
# Keys inside dflash_config that this project implements, and those it accepts at one value only
# (vLLM qwen3_dflash.py _resolve_layer_attention and load, SGLang dflash_utils.py parse_dflash_draft_config).
DFLASH_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "num_target_layers"}
_DFLASH_SEMANTIC = {
    "causal": (_one_of(None), "causality of every layer (vLLM)"),
    "use_swa": (_one_of(None, False), "sliding attention on every layer (vLLM)"),
    "swa_window_size": (_one_of(None), "the sliding window, before the top-level sliding_window (vLLM)"),
    "attention_sink_bias": (_one_of(None, False), "per-head attention sinks (vLLM, SGLang)"),
    "attention_value_scale": (_one_of(None, 1, 1.0), "a scale on V (vLLM, SGLang)"),
    "use_aux_hidden_state": (_one_of(None, True), "whether vLLM builds fc over tapped target states"),
    "mask_token": (_one_of(None, "<|MASK|>"), "the token SGLang resolves the mask id against"),
    "output_multiplier": (_one_of(None, 1, 1.0), "a logits multiplier (SGLang, reference model)"),
    "final_logit_softcapping": (_one_of(None, 0, 0.0), "logit soft-capping (SGLang, reference model)"),
    "input_embedding_scale": (_one_of(None, 1, 1.0), "the reference model's scale of block embeddings"),
    "conv_kernel_size": (_one_of(None, 0), "DFlash2's grouped convolutions (SGLang)"),
    "conv_group_size": (_one_of(None, 0), "DFlash2's grouped convolutions (SGLang)"),
    "selector_rank": (_one_of(None, 0), "DFlash2's candidate selector (SGLang)"),
    "selector_top_k": (_one_of(None, 0), "DFlash2's candidate selector (SGLang)"),
    "projector_type": (_one_of(None), "a Domino projector head (SGLang)"),
    "sample_from_anchor": (_one_of(None, False), "the query layout: vLLM refuses true, SGLang's Nemotron layout"),
    "layer_ids": (_one_of(None), "vLLM's tapped layers when target_layer_ids is absent"),
}
_ROPE_KEYS = {"rope_theta", "rope_type", "type"}


def unsupported_keys(data: dict, implemented=()) -> list[str]:
    """Each key of a config.json that this project cannot run as the engines would, with its value and
    what it changes (an empty list: the drafter computes what the engines compute). `implemented`: the
    dflash_config keys the drafter kind read implements beyond DFlash's (dflash.kinds.kind.DrafterKind.own_keys)."""
    problems = []
    for key, value in data.items():
        if key in _READ or key in _INERT:
            continue
        if key in _SEMANTIC:
            same, effect = _SEMANTIC[key]
            if not same(value, data):
                problems.append(f"{key} = {value!r} (changes {effect})")
        else:
            problems.append(f"{key} (unknown to this project's reader; it may change what an engine computes)")
    for key, value in (data.get("dflash_config") or {}).items():
        if key in DFLASH_KEYS or key in implemented:
            continue
        if key in _DFLASH_SEMANTIC:
            same, effect = _DFLASH_SEMANTIC[key]
            if not same(value, data):
                problems.append(f"dflash_config.{key} = {value!r} (changes {effect})")
        else:
            problems.append(f"dflash_config.{key} (unknown to this project's reader; it may change what an "
                            "engine computes)")
    for name in ("rope_parameters", "rope_scaling"):
        params = data.get(name)
        if isinstance(params, dict):
            problems += [f"{name}.{k} = {v!r} (changes the RoPE the engines apply; this project's drafter "
                         "implements plain RoPE, rope_type 'default')" for k, v in params.items()
                         if k not in _ROPE_KEYS or (k != "rope_theta" and v != "default")]
    if data.get("attention_bias"):
        problems.append("attention_bias = true (q/k/v/o biases in vLLM and SGLang)")
    if data.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {data['hidden_act']!r} (the MLP activation)")
    return problems
