"""What the memory model needs to know about a target and a drafter, read without loading any weight.

    TargetShape   the frozen target: parameters in total and per decoder layer, embedding and LM head rows,
                  width, MLP width, tapped layers; from a model directory's config.json (`target_shape_from_dir`)
                  or a named preset (`PRESETS`: "27b" is Qwen3.5-27B's text model, "demo" the built-in demo's)
    DrafterShape  the drafter: its parameter count and the largest FSDP unit (one decoder layer), counted
                  from the real module built on the meta device (no memory, no init cost)

Parameter counts come from the modules themselves (transformers' model class built from the config on
the meta device; dflash.model.drafter.Drafter likewise), never from a hand formula, so a new
architecture is counted as exactly as the ones known today.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import functools

import torch

from dflash.errors import ConfigError, TargetError
from dflash.kinds import DEFAULT


@dataclass(frozen=True)
class TargetShape:
    name: str
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_params: tuple[int, ...]   # parameters of each decoder layer
    embed_params: int               # input embedding
    head_params: int                # LM head (0 when tied to the embedding)
    other_params: int               # final norm and anything else outside the layers
    full_attention_layers: int
    # An FP8 target (fine-grained, 128 x 128 blocks): each decoder layer's parameters held in FP8 (1 byte)
    # and its float32 block scales; empty for a bf16 target. Parameters outside the layers stay unquantised.
    fp8_layer_params: tuple[int, ...] = ()
    fp8_layer_scales: tuple[int, ...] = ()

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.embed_params + self.head_params + self.other_params

    @property
    def fp8(self) -> bool:
        return bool(self.fp8_layer_params)

    def layer_bytes(self, e: int) -> list[int]:
        """Each decoder layer's weight bytes at `e` bytes per unquantised parameter (FP8: 1 byte per quantised
        parameter + 4 per block scale)."""
        if not self.fp8:
            return [n * e for n in self.layer_params]
        return [(n - q) * e + q + 4 * s for n, q, s in zip(self.layer_params, self.fp8_layer_params,
                                                            self.fp8_layer_scales)]

    def weight_bytes(self, e: int) -> int:
        """The target's weight bytes: its layers (layer_bytes) + embedding, LM head and the rest at `e`."""
        return sum(self.layer_bytes(e)) + (self.embed_params + self.head_params + self.other_params) * e


@dataclass(frozen=True)
class DrafterShape:
    layers: int
    hidden: int
    tapped: int          # target layers concatenated into the context (k)
    block_size: int
    params: int
    unit_params: int     # the largest FSDP unit: one decoder layer
    config: object       # the DrafterConfig it was counted from (FLOPs read it)
    layer_surplus: float = 0.0  # its kind's layer_activation_surplus (dflash.kinds.kind)
    recomputed: int = 0  # layers that keep only their input for the backward (dflash-train --recompute-layers)


def _meta_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _fp8_counts(model, skip: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per decoder layer: the parameters of the linear layers transformers' FP8 quantizer converts (skip:
    modules_to_not_convert, matched as transformers matches it), and their 128 x 128 block scales."""
    import math

    from transformers.quantizers.quantizers_utils import should_convert_module

    layers = model.get_decoder().layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    params, scales = [], []
    for i, layer in enumerate(layers):
        linears = [m for sub, m in layer.named_modules() if type(m) is torch.nn.Linear
                   and should_convert_module(f"{prefix}.{i}.{sub}", list(skip))]
        params.append(sum(m.weight.numel() for m in linears))
        scales.append(sum(math.ceil(m.out_features / 128) * math.ceil(m.in_features / 128) for m in linears))
    return tuple(params), tuple(scales)


def _with_fp8(shape: TargetShape, model, skip: list[str] | None) -> TargetShape:
    """`shape` as an FP8 target: skip None is the list Qwen's FP8 releases use (dflash.model.fp8_checkpoint)."""
    from dataclasses import replace

    from dflash.model.fp8_checkpoint import default_modules_to_not_convert

    skip = default_modules_to_not_convert(model) if skip is None else skip
    params, scales = _fp8_counts(model, skip)
    return replace(shape, fp8_layer_params=params, fp8_layer_scales=scales)


def _shape_of_model(name: str, model) -> TargetShape:
    """A TargetShape of a transformers causal LM (built on the meta device)."""
    cfg = model.config.get_text_config()
    decoder = model.get_decoder()
    layers = [_meta_params(layer) for layer in decoder.layers]
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    embed_n, head_n = _meta_params(embed), (0 if tied or head is None else _meta_params(head))
    total = _meta_params(model)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers)
    heads = int(cfg.num_attention_heads)
    return TargetShape(name=name, hidden=int(cfg.hidden_size), layers=len(layers), vocab=int(embed.weight.shape[0]),
                       intermediate=int(cfg.intermediate_size), heads=heads,
                       kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                       head_dim=int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads),
                       layer_params=tuple(layers), embed_params=embed_n, head_params=head_n,
                       other_params=total - sum(layers) - embed_n - head_n,
                       full_attention_layers=sum(1 for t in types if t == "full_attention"))


def _build_on_meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# The config.json keys the memory model sizes its terms from, each a count of at least 1 (transformers builds a
# model of width 0 without a word, and the plan of it is nonsense: a 0.8 GB peak, millions of tokens/s).
SHAPE_KEYS = {"hidden_size": "width", "num_hidden_layers": "decoder layer count", "vocab_size": "vocabulary size",
              "intermediate_size": "MLP width", "num_attention_heads": "attention head count",
              "num_key_value_heads": "key/value head count", "head_dim": "attention head width"}


def _is_count(value) -> bool:
    """A whole number >= 1, or a non-empty list of them (a per-layer value, as Gemma 3n's intermediate_size)."""
    if isinstance(value, list):
        return bool(value) and all(map(_is_count, value))
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_counts(file: Path, values: dict, prefix: str = "") -> None:
    """TargetError naming the first of SHAPE_KEYS in `values` that is not a count (absent: the architecture's
    default, left to transformers)."""
    for key, what in SHAPE_KEYS.items():
        value = values.get(key)
        if value is not None and not _is_count(value):
            raise TargetError(f'{file}: "{prefix}{key}" is {json.dumps(value)}; the target\'s {what} must be a whole '
                              "number of at least 1. Restore the config.json that came with the model (huggingface-cli "
                              "download ORG/NAME config.json --local-dir DIR)")


def _check_config_counts(path: Path) -> None:
    """config.json's SHAPE_KEYS, and its text_config's, checked before transformers reads it (it would fail
    on some with a message that names no key, and accept others). A file that is no JSON object is left to
    read_target_config, which names that fault."""
    file = path / "config.json"
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return
    if isinstance(data, dict):
        _check_counts(file, data)
        if isinstance(data.get("text_config"), dict):
            _check_counts(file, data["text_config"], "text_config.")


def target_shape_from_dir(path, precision: str = "auto") -> TargetShape:
    """The shape of the model directory `path` from its config.json alone (TargetError naming the fix).
    precision: auto (FP8 when config.json's quantization_config is fine-grained FP8), bf16, or fp8 (an FP8
    release of this model: Qwen's modules_to_not_convert)."""
    from dflash.model.fp8_checkpoint import read_fp8_quantization
    from dflash.model.target import read_target_config

    path = Path(path)
    if not path.is_dir():
        raise TargetError(f"--target {path}: no such directory; pass the local model directory that holds "
                          "config.json (or a preset: --target 27b or --target demo)")
    _check_config_counts(path)
    config = read_target_config(path)  # TargetError for a missing or damaged config.json
    text = config.get_text_config()  # the same counts under an architecture's own names (GPT-2's n_embd, ...)
    _check_counts(path / "config.json", {key: getattr(text, key, None) for key in SHAPE_KEYS})
    try:
        model = _build_on_meta(config)
    except Exception as exc:  # an architecture transformers cannot build
        raise TargetError(f"{path / 'config.json'}: transformers cannot build this model ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); the memory model counts the "
                          "parameters of the real module, so the target must be one transformers knows") from None
    shape = _shape_of_model(path.name, model)
    quant = read_fp8_quantization(path)
    if precision == "fp8" or (precision == "auto" and quant):
        return _with_fp8(shape, model, quant.get("modules_to_not_convert") if quant else None)
    return shape


def _preset(shape: dict):
    from transformers import Qwen3_5ForCausalLM

    from dflash.model.shapes import qwen35_config

    with torch.device("meta"):
        return Qwen3_5ForCausalLM(qwen35_config(shape))


@functools.lru_cache(maxsize=8)
def preset_shape(name: str, layers: int | None = None, fp8: bool = False) -> TargetShape:
    """A named target shape: '27b' (Qwen3.5-27B's text model) or 'demo' (the built-in demo's target).
    `layers` shortens a preset to that many decoder layers (same width: what a validation run loads); `fp8`
    makes it the FP8 release of that model (Qwen's modules_to_not_convert)."""
    from dflash.model.shapes import QWEN35_27B

    if name == "27b":
        shape = dict(QWEN35_27B, layers=layers or QWEN35_27B["layers"])
        model = _preset(shape)
        found = _shape_of_model("27b" if layers is None else f"27b-{layers}l", model)
    elif name == "demo":
        model = _preset(DEMO)
        found = _shape_of_model("demo", model)
    else:
        raise ConfigError(f"--target {name}: not a model directory and not a preset; pass a local model directory "
                          f"with config.json, or one of the presets: {', '.join(PRESETS)}")
    return _with_fp8(found, model, None) if fp8 else found


PRESETS = ("27b", "demo")
# The built-in demo's target (dflash.demo.tiny_target.DemoSpec and its model: 768 tokens, 8 layers, width 64).
DEMO = dict(hidden=64, layers=8, vocab=768, intermediate=192, heads=4, kv_heads=2, head_dim=32,
            linear_k_heads=4, linear_v_heads=4, linear_head_dim=16)


TARGET_PRECISIONS = ("auto", "bf16", "fp8")
# The presets' contexts (max_position_embeddings): Qwen3.5-27B's config.json (262,144), the demo target's
# (dflash.demo.tiny_target). The meta-device build of a preset takes transformers' default instead; this is
# the model's own.
PRESET_CONTEXT = {"27b": 262_144, "demo": 2048}


def context_length(spec: str) -> int | None:
    """The most positions --target `spec` reads (max_position_embeddings: its text_config's, else its own), from
    a preset or from a model directory's config.json read as plain JSON (nothing built, no transformers), so
    `dflash plan` can refuse a --seq-len at once. None when it does not say (or config.json cannot be read:
    target_shape names that fault)."""
    if spec in PRESETS:
        return PRESET_CONTEXT[spec]
    try:
        data = json.loads((Path(spec).expanduser() / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    for values in (text, data):
        limit = values.get("max_position_embeddings")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
            return limit
    return None


def target_shape(spec: str, layers: int | None = None, precision: str = "auto") -> TargetShape:
    """--target of `dflash plan`: a preset name, or a model directory; precision (TARGET_PRECISIONS): auto
    reads a directory's quantization_config (a preset: bf16), fp8 / bf16 say which release."""
    if precision not in TARGET_PRECISIONS:
        raise ConfigError(f"target precision {precision!r}: choose one of {', '.join(TARGET_PRECISIONS)}")
    if spec in PRESETS:
        return preset_shape(spec, layers, precision == "fp8")
    path = Path(spec).expanduser()
    if not path.exists():
        raise TargetError(f"--target {spec}: no such directory and not a preset; pass a local model directory "
                          f"with config.json, or one of the presets: {', '.join(PRESETS)}")
    return target_shape_from_dir(path, precision)


def drafter_shape(target: TargetShape, layers: int = 5, block_size: int = 16, tapped: int | None = None,
                  sliding_window: int = 0, kind: str = DEFAULT, recompute: int = 0) -> DrafterShape:
    """The drafter dflash-train would build for `target` (DrafterConfig.from_target's shape: the target's
    attention shape, `tapped` layers, by default min(5, layers - 3) as Target taps them), counted: the
    model of drafter kind `kind` built on the meta device (a DFlash2 drafter's convolutions and selector too);
    `recompute`: its first layers recompute their activations in the backward (--recompute-layers)."""
    from dflash.kinds import named
    from dflash.model.drafter import FULL, SLIDING
    from dflash.model.target import default_layer_ids

    n = tapped if tapped is not None else min(5, max(1, target.layers - 3))
    if layers < 1 or block_size < 2 or not 1 <= n <= target.layers:
        raise ConfigError(f"drafter layers {layers}, block size {block_size}, tapped layers {n}: need layers >= 1, "
                          f"block size >= 2 and 1 to {target.layers} tapped layers")
    ids = default_layer_ids(target.layers, n) if n <= max(1, target.layers - 3) else list(range(n))
    drafter_kind = named(kind)
    config = drafter_kind.config_class(
        hidden_size=target.hidden, num_hidden_layers=layers, num_attention_heads=target.heads,
        num_key_value_heads=target.kv_heads, head_dim=target.head_dim, intermediate_size=target.intermediate,
        vocab_size=target.vocab, block_size=block_size, num_target_layers=target.layers, target_layer_ids=ids,
        mask_token_id=target.vocab - 1, layer_types=[SLIDING] * (layers - 1) + [FULL] if sliding_window else [],
        sliding_window=sliding_window or None)
    with torch.device("meta"):
        drafter = drafter_kind.build(config)
    return DrafterShape(layers=layers, hidden=target.hidden, tapped=len(ids), block_size=block_size,
                        params=_meta_params(drafter), unit_params=_meta_params(drafter.layers[0]), config=config,
                        layer_surplus=drafter_kind.layer_activation_surplus, recomputed=min(recompute, layers))
