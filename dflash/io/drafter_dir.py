"""The drafter on disk, in the reference DFlash layout that serving engines and published drafters use.

    DIR/config.json          Qwen3 keys + DFlash keys (below); AutoConfig reads it as a Qwen3Config
    DIR/model.safetensors    the drafter's tensors, bf16 by default, names without a "model." prefix
                             (a sharded model.safetensors.index.json + shards is read as well)
    DIR/modeling_dflash.py   a self-contained DFlashDraftModel (dflash/kinds/dflash/remote_dflash.py) that config.json's
                             auto_map names: AutoModel.from_pretrained(DIR, trust_remote_code=True) loads it
                             (each drafter kind names its own: a DFlash2 drafter's is modeling_dflash2.py and its
                             DFlash2DraftModel, dflash.kinds.dflash2)

config.json, as `reference_config` writes it (one key per DrafterConfig field, except the two that nest):

    model_type "qwen3", architectures ["DFlashDraftModel"]        vLLM registry.py maps the architecture
                                                                  to qwen3_dflash; SGLang models/dflash.py
    auto_map {"AutoModel": "modeling_dflash.DFlashDraftModel"}   transformers' trust_remote_code path
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    hidden_act "silu", rms_norm_eps, attention_bias false, max_position_embeddings, vocab_size,
    rope_theta + rope_parameters {rope_theta, rope_type "default"}    both: transformers 5 reads the
                                                                  second, older readers the first
    layer_types, sliding_window, use_sliding_window, max_window_layers   AutoConfig drops sliding_window
                                                                  unless use_sliding_window is true
    block_size, num_target_layers
    dflash_config {target_layer_ids, mask_token_id}              id l = output of target decoder layer l,
                                                                  i.e. HF hidden_states[l + 1] for l < L-1
                                                                  (dflash/io/engines.py: L-1 is refused)
    dtype, tie_word_embeddings false, use_cache, attention_dropout, initializer_range
    target_fingerprint                                           this project only; engines ignore it

Tensors: fc, hidden_norm, norm, layers.N.{input_layernorm, post_attention_layernorm},
layers.N.self_attn.{q,k,v,o}_proj, layers.N.self_attn.{q,k}_norm, layers.N.mlp.{gate,up,down}_proj
(all `.weight`): exactly the module tree of `dflash.model.drafter.Drafter`, so `expected_tensors` asks the model.
No embedding and no LM head: the target's are used.

Reading checks everything it can before a weight is loaded: the config (model type, architecture, DFlash keys,
and every other key: `unsupported_keys` refuses, by name, an unknown key and one whose value makes an
engine compute something else; every size >= 1, block_size >= 2, rms_norm_eps and rope_theta > 0, each
copy of a key written twice equal), then the tensor names, shapes and dtypes from the safetensors header
(one dtype for all: bfloat16, or float32 as training checkpoints keep it; config.json's dtype names it),
then (dflash.io.fit: `check_fits_target`) the target. Loading then refuses a NaN or infinite weight,
naming the tensor. Every failure is a DrafterError naming the problem and the fix. (`dflash.io.legacy`
converts the project's older "dflash-drafter/1" directories.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from common.fsutil import atomic_write

from dflash.errors import DrafterError
from dflash.io.config_keys import DFLASH_KEYS, unsupported_keys
from dflash.kinds.config_values import as_float as _float, as_int as _int, as_int_list as _int_list, as_mapping as _mapping
from dflash.kinds import DFLASH, KINDS, DrafterKind, build_drafter, by_architecture, kind_of
from dflash.model.drafter import FULL, LAYER_TYPES, SLIDING, Drafter, DrafterConfig
# the file names and dtype tables live beside the tensor checks; other modules read them from here too
from dflash.io.drafter_tensors import CONFIG_NAME, DTYPE_NAMES, DTYPES, WEIGHTS_NAME, expected_tensors  # noqa: F401
from dflash.io.drafter_tensors import check_declared_dtype, check_dtypes, check_finite, check_tensors, stored_tensors

log = logging.getLogger(__name__)

WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
MODEL_TYPE = "qwen3"
ARCHITECTURE = DFLASH.architecture  # the reference kind's; each kind names its own (dflash.kinds)
LEGACY_FORMAT = "dflash-drafter/1"  # the project's own layout before this one

# --- writing -----------------------------------------------------------------------------------------
def reference_config(config: DrafterConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json of `config` in the reference layout (keys sorted when written)."""
    sliding, kind = SLIDING in config.layer_types, kind_of(config)
    data = {
        "architectures": [kind.architecture],
        "model_type": MODEL_TYPE,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": kind.auto_map,
        "block_size": config.block_size,
        "dflash_config": {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id,
                          **kind.write_keys(config)},
        "dtype": DTYPE_NAMES[dtype],
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "layer_types": list(config.layer_types),
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "num_target_layers": config.num_target_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "rope_theta": config.rope_theta,
        "sliding_window": config.sliding_window if sliding else None,
        "target_fingerprint": config.target_fingerprint,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": sliding,
        "vocab_size": config.vocab_size,
    }
    return data


def save_drafter(drafter: Drafter, directory, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write `drafter` to `directory` in the reference layout, its weights cast to `dtype` (None: as
    they are, e.g. float32 for a training checkpoint). Each file appears whole or not at all; the
    config goes last, so a directory with a config.json always has its weights beside it."""
    from safetensors.torch import save

    directory = Path(directory)
    dtype = dtype or drafter.fc.weight.dtype
    if dtype not in DTYPE_NAMES:
        raise DrafterError(f"cannot save a drafter as {dtype}; use one of {', '.join(DTYPE_NAMES.values())}")
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in drafter.state_dict().items()}
    atomic_write(directory / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
    kind = kind_of(drafter.config)
    atomic_write(directory / kind.model_file, kind.remote_code_source())  # the class config.json's auto_map names
    config = json.dumps(reference_config(drafter.config, dtype), indent=2, sort_keys=True) + "\n"
    atomic_write(directory / CONFIG_NAME, config)
    return directory


# --- reading: the config -------------------------------------------------------------------------------
def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; a too deep nest
        raise DrafterError(f"{path} is not valid JSON ({type(exc).__name__}: {exc}); restore the config.json that "
                           "came with the drafter") from None
    except OSError as exc:
        raise DrafterError(f"{path} cannot be read ({exc}); fix its permissions or copy the drafter again") from None
    if not isinstance(data, dict):
        raise DrafterError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def _rope_theta(data: dict, where: Path) -> float:
    """The RoPE base, > 0. A config may carry it twice (rope_parameters.rope_theta, which transformers 5 and
    the engines read, and the top-level rope_theta, which older readers do): the copies must agree."""
    rope = _mapping(data.get("rope_parameters"), "rope_parameters", where)
    scaling = _mapping(data.get("rope_scaling"), "rope_scaling", where)
    for name, params in (("rope_parameters", rope), ("rope_scaling", scaling)):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise DrafterError(f"{where}: {name} has rope_type {kind!r}; this project's drafter implements plain "
                               "RoPE only (rope_type 'default', as every published DFlash drafter uses)")
    copies = {key: value for key, value in (("rope_parameters.rope_theta", rope.get("rope_theta")),
                                            ("rope_scaling.rope_theta", scaling.get("rope_theta")),
                                            ("rope_theta", data.get("rope_theta"))) if value is not None}
    thetas = {key: _float(value, key, where, positive=True) for key, value in copies.items()}
    if len(set(thetas.values())) > 1:
        raise DrafterError(f"{where}: {' but '.join(f'{k} is {v!r}' for k, v in copies.items())}; transformers 5 "
                           "and the engines read rope_parameters.rope_theta, older readers rope_theta, so they would "
                           "rotate by different bases: set every copy to the base the drafter was trained with "
                           "(its target's)")
    # vLLM falls back to 1e6 (set_default_rope_theta); the key is present in every published config.
    return next(iter(thetas.values()), 1_000_000.0)


def _layer_types(data: dict, n_layers: int, where: Path) -> tuple[list[str], int | None]:
    window = data.get("sliding_window")
    if data.get("use_sliding_window") and window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise DrafterError(f"{where}: sliding_window is {window!r} while use_sliding_window is true; it must be the "
                           "window in tokens (an integer >= 1), or null with use_sliding_window false")
    start = data.get("max_window_layers")
    start = n_layers if start is None else _int(start, "max_window_layers", where, minimum=0)
    if "layer_types" in data and data["layer_types"] is not None:
        types = data["layer_types"]
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise DrafterError(f"{where}: layer_types is {types!r}; it must be a list naming each layer's attention, "
                               f"each one of {list(LAYER_TYPES)}")
    else:  # Qwen3Config's own default: sliding from max_window_layers on, when a window is in use
        in_use = bool(data.get("use_sliding_window")) and window is not None
        types = [SLIDING if in_use and i >= start else FULL for i in range(n_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise DrafterError(f"{where}: layer_types has {unknown}; a DFlash drafter layer is one of {list(LAYER_TYPES)}")
    if SLIDING not in types:
        return types, None
    if not data.get("use_sliding_window") or not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise DrafterError(
            f"{where}: layer_types has sliding_attention layers but use_sliding_window is "
            f"{data.get('use_sliding_window')!r} and sliding_window {window!r}. transformers' Qwen3Config drops the "
            "window unless use_sliding_window is true, and vLLM / SGLang then refuse the drafter: set "
            "\"use_sliding_window\": true and \"sliding_window\": <window in tokens>")
    return types, window


def _drafter_kind(data: dict, where: Path) -> DrafterKind:
    """The drafter kind config.json's architectures name, once it is a reference-layout drafter's config."""
    if data.get("format") == LEGACY_FORMAT:
        raise DrafterError(
            f"{where} is an older drafter of this project ({LEGACY_FORMAT}), which serving engines cannot read; "
            f"convert it: dflash export {where.parent} NEW_DIR --target TARGET_DIR")
    if data.get("model_type") != MODEL_TYPE:
        raise DrafterError(
            f"{where} has model_type {data.get('model_type')!r}; a DFlash drafter in the reference layout has "
            f"\"model_type\": \"{MODEL_TYPE}\" and \"architectures\": [\"{ARCHITECTURE}\"]. Pass the drafter's "
            "directory, not the target's")
    architectures = data.get("architectures")
    kind = by_architecture(architectures) if isinstance(architectures, list) else None
    if kind is None:
        named = ", ".join(map(str, architectures)) if isinstance(architectures, list) else repr(architectures)
        raise DrafterError(
            f"{where} has architectures {architectures!r}, not [\"{ARCHITECTURE}\"]: vLLM picks the "
            f"drafter model by this name, and other DFlash variants ({named}) "
            f"compute something else. This project reads {' and '.join(k.architecture for k in KINDS.values())} "
            "drafters only")
    return kind


def _dflash_config(data: dict, kind: DrafterKind, where: Path) -> dict:
    """config.json's dflash_config, once every required key is present and none that `kind` does not implement."""
    dflash = data.get("dflash_config")
    if not isinstance(dflash, dict):
        raise DrafterError(
            f"{where} has no dflash_config; a DFlash drafter needs \"dflash_config\": {{\"target_layer_ids\": "
            "[...], \"mask_token_id\": N}} (the target layers it reads and the MASK token of its blocks)")
    missing = [k for k in ("target_layer_ids", "mask_token_id") if dflash.get(k) is None]
    missing += [k for k in ("block_size", "num_target_layers", "hidden_size", "num_hidden_layers",
                            "num_attention_heads", "intermediate_size", "vocab_size")
                if data.get(k, dflash.get(k)) is None]
    if missing:
        raise DrafterError(f"{where} lacks {', '.join(missing)} (dflash_config holds target_layer_ids and "
                           "mask_token_id; the rest are top-level keys); add them from the drafter's training config")
    unsupported = unsupported_keys(data, implemented=kind.own_keys)
    if unsupported:
        raise DrafterError(f"{where} uses {'; '.join(unsupported)}. This project's drafter does not implement "
                           "that, so it would compute other outputs than the engines do; it reads DFlashDraftModel "
                           f"drafters with dflash_config keys {sorted(DFLASH_KEYS)} and the Qwen3 keys only")
    return dflash


def _target_layer_ids(data: dict, dflash: dict, where: Path) -> list[int]:
    """dflash_config.target_layer_ids; an eagle_aux_hidden_state_layer_ids beside them must name the same taps."""
    ids = _int_list(dflash["target_layer_ids"], "dflash_config.target_layer_ids", where)
    eagle_ids = data.get("eagle_aux_hidden_state_layer_ids")
    eagle = "eagle_aux_hidden_state_layer_ids"
    if eagle_ids is not None and _int_list(eagle_ids, eagle, where) != [i + 1 for i in ids]:
        # vLLM eagle3_utils.py prefers this key as-is over dflash_config.target_layer_ids (+1).
        raise DrafterError(f"{where}: eagle_aux_hidden_state_layer_ids {eagle_ids} disagrees with target_layer_ids "
                           f"{ids} (vLLM would tap {eagle_ids}, this project {[i + 1 for i in ids]}); remove the key")
    return ids


def _config_values(data: dict, dflash: dict, ids: list[int], kind: DrafterKind, where: Path) -> dict:
    """The DrafterConfig fields of config.json, each typed and range-checked, defaults where a key is absent."""
    def size(key: str, value=None, minimum: int = 1) -> int:
        return _int(data[key] if value is None else value, key, where, minimum)

    def given(key: str, default):  # a default for an absent (or null) key only: 0 is a bad value, not "unset"
        return default if data.get(key) is None else data[key]

    def agreed(key: str):  # the top-level key, else dflash_config's copy; readers differ in which they take
        top, nested = data.get(key), dflash.get(key)
        if top is not None and nested is not None and top != nested:
            raise DrafterError(f"{where}: {key} is {top!r} but dflash_config.{key} is {nested!r}; readers take one "
                               f"or the other, so the engines could run another {key}: keep one, or make them equal")
        return nested if top is None else top

    n_layers = size("num_hidden_layers")
    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    layer_types, window = _layer_types(data, n_layers, where)
    return dict(
        hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=size("num_key_value_heads", given("num_key_value_heads", heads)),
        head_dim=size("head_dim", given("head_dim", max(1, hidden // heads))),
        intermediate_size=size("intermediate_size"),
        rms_norm_eps=_float(given("rms_norm_eps", 1e-6), "rms_norm_eps", where, positive=True),
        rope_theta=_rope_theta(data, where),
        max_position_embeddings=size("max_position_embeddings", given("max_position_embeddings", 40960)),
        vocab_size=size("vocab_size"),
        block_size=size("block_size", agreed("block_size"), minimum=2),
        num_target_layers=size("num_target_layers", agreed("num_target_layers")),
        target_layer_ids=ids, mask_token_id=_int(dflash["mask_token_id"], "dflash_config.mask_token_id", where),
        layer_types=layer_types, sliding_window=window,
        initializer_range=_float(given("initializer_range", 0.02), "initializer_range", where, positive=True),
        target_fingerprint=str(data.get("target_fingerprint") or ""),
        **kind.read_keys(dflash, where),
    )


def parse_reference_config(data: dict, where: Path | str = CONFIG_NAME) -> DrafterConfig:
    """DrafterConfig of a reference-layout config.json, or a DrafterError naming what is wrong."""
    where = Path(where)
    kind = _drafter_kind(data, where)
    dflash = _dflash_config(data, kind, where)
    ids = _target_layer_ids(data, dflash, where)
    values = _config_values(data, dflash, ids, kind, where)
    try:  # DrafterConfig's own checks: head counts, layer ids, mask id, layer_types (each value is typed above)
        return kind.config_class(**values)
    except ValueError as exc:
        raise DrafterError(f"{where}: {exc}. Fix that key in {where.name}, or restore the {CONFIG_NAME} that came "
                           "with the drafter's weights") from exc


# --- reading: the weights ------------------------------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    if (directory / WEIGHTS_INDEX_NAME).is_file():
        shards = sorted(set(read_json(directory / WEIGHTS_INDEX_NAME).get("weight_map", {}).values()))
        absent = [s for s in shards if not (directory / s).is_file()]
        if not shards or absent:
            raise DrafterError(f"{directory / WEIGHTS_INDEX_NAME} names shards that are not there: "
                               f"{absent or 'none at all'}; download the drafter's files again")
        return [directory / s for s in shards]
    raise DrafterError(f"{directory} has a {CONFIG_NAME} but no {WEIGHTS_NAME}; the drafter's weights are missing")


def _read(directory) -> tuple[DrafterConfig, torch.dtype]:
    """(config, stored dtype) of a reference-layout directory, everything checked from config.json and the
    safetensors headers (no weight is read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DrafterError(f"drafter directory {directory} does not exist; pass a directory holding "
                           f"{CONFIG_NAME} + {WEIGHTS_NAME} (e.g. <out>/drafter of dflash-train)")
    if not (directory / CONFIG_NAME).is_file():
        what = "weights but" if any(directory.glob("*.safetensors")) else "nothing like a drafter:"
        raise DrafterError(f"{directory} holds {what} no {CONFIG_NAME}; a drafter needs the config.json that came "
                           "with its weights (model_type qwen3, architectures [DFlashDraftModel], dflash_config)")
    data = read_json(directory / CONFIG_NAME)
    config = parse_reference_config(data, directory / CONFIG_NAME)
    stored = stored_tensors(weight_files(directory))
    check_tensors(config, stored, directory)
    dtype = check_dtypes(stored, directory)
    check_declared_dtype(data, dtype, directory / CONFIG_NAME)
    return config, dtype


def read_drafter_config(directory) -> DrafterConfig:
    """The DrafterConfig of a reference-layout directory, after checking its tensor names, shapes and
    dtypes (from the file headers: no weight is read)."""
    return _read(directory)[0]


def load_drafter(directory, device="cpu", dtype: torch.dtype | None = None, attention: str = "sdpa") -> Drafter:
    """A Drafter from a reference-layout directory, checked first (read_drafter_config), then its weights
    checked finite (check_finite).

    dtype None keeps the stored dtype, except on a CPU, where bf16 weights are upcast to float32
    (exactly: every bf16 value is a float32 value) since CPU half-precision matmuls are slow and round
    differently from a GPU's.
    """
    from safetensors.torch import load_file

    directory, device = Path(directory), torch.device(device)
    config, stored = _read(directory)
    state = {}
    for path in weight_files(directory):
        state.update(load_file(str(path), device=str(device)))
    check_finite(state, directory)
    if dtype is None:
        dtype = stored
        if device.type == "cpu" and stored == torch.bfloat16:
            dtype = torch.float32
            log.warning("drafter %s holds %s weights; upcast to float32 for the CPU (exact)", directory,
                        DTYPE_NAMES[stored])
    with torch.device("meta"):
        drafter = build_drafter(config, attention=attention)
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return drafter
