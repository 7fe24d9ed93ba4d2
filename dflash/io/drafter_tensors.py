"""What a drafter's weight files hold, checked against its config.json before (and, for finiteness, as)
anything loads: tensor names and shapes, one dtype the engines serve, what config.json says that dtype
is, and no NaN or infinite weight. dflash.io.drafter_dir reads through these checks."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.errors import DrafterError
from dflash.kinds import build_drafter
from dflash.model.drafter import DrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# The dtypes a drafter's tensors may have, all of them one: bfloat16, what vLLM and SGLang serve (dflash-train's
# <out>/drafter), or float32, the training checkpoints' (save_drafter dtype=None). Keyed by config.json's name
# and by the safetensors header's. float16 is neither: it overflows where bf16 does not, and nothing here writes it.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HEADER_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}
_HEADER_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8",
                 "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8", "BOOL": "bool"}


def expected_tensors(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a drafter of this shape -> its shape (the module tree, built on `meta`)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in build_drafter(config).state_dict().items()}


def stored_tensors(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) from the safetensors headers, without reading a weight."""
    from safetensors import safe_open

    found = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    found[name] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as exc:  # SafetensorError (a truncated or foreign file) is not an OSError
            raise DrafterError(f"{path} is damaged: {type(exc).__name__}: {exc}; copy or write it again") from None
    return found


def check_tensors(config: DrafterConfig, stored: dict, directory: Path) -> None:
    expected = expected_tensors(config)
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    if missing or extra:
        hint = ""
        if any(n.startswith("model.") for n in extra):
            hint = " The file's names carry a \"model.\" prefix, which the reference layout has none of."
        elif any(".mlp." not in n and n.endswith(("gate_proj.weight", "up_proj.weight")) for n in extra):
            hint = (" MLP weights without \"mlp.\" are the older project layout: convert with "
                    f"dflash export {directory} NEW_DIR.")
        raise DrafterError(
            f"the tensors in {directory} do not match its {CONFIG_NAME} ({config.num_hidden_layers} layers): "
            f"missing {missing or 'none'}; extra {extra or 'none'}.{hint} Nothing was loaded: a drafter with "
            "uninitialised weights would decode garbage without an error")
    shapes = [f"{n}: file {stored[n][0]}, config {s}" for n, s in expected.items() if stored[n][0] != s]
    if shapes:
        raise DrafterError(f"the tensors in {directory} have other shapes than its {CONFIG_NAME} says: "
                           + "; ".join(shapes))


def _listed(items: list[str], most: int = 6) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def check_dtypes(stored: dict, directory: Path) -> torch.dtype:
    """The one dtype of a drafter's tensors (`stored`: name -> (shape, safetensors header dtype)), or a
    DrafterError naming each tensor of a dtype the engines do not serve (HEADER_DTYPES) or of another dtype
    than the rest."""
    def named(header: str) -> str:
        return f"{_HEADER_NAMES[header]} ({header})" if header in _HEADER_NAMES else header

    odd = {name: header for name, (_, header) in stored.items() if header not in HEADER_DTYPES}
    if odd:
        kinds = set(odd.values())
        listed = (f"every tensor is {named(kinds.pop())}" if len(odd) == len(stored) and len(kinds) == 1
                  else _listed(sorted(f"{name} is {named(header)}" for name, header in odd.items())))
        raise DrafterError(
            f"the tensors in {directory} have a dtype a drafter is not kept in: {listed}. A drafter's tensors are "
            "bfloat16 (what vLLM and SGLang serve, and dflash-train writes to <out>/drafter) or float32 (as its "
            "checkpoints keep them): cast every tensor to bfloat16 and set \"dtype\": \"bfloat16\" in "
            f"{CONFIG_NAME}, or use the drafter/ of a checkpoint of the run that trained it")
    headers = {header for _, header in stored.values()}
    if len(headers) > 1:
        common = max(sorted(headers), key=lambda h: sum(header == h for _, header in stored.values()))
        others = sorted(f"{name} is {named(header)}" for name, (_, header) in stored.items() if header != common)
        raise DrafterError(
            f"the tensors in {directory} mix dtypes: {_listed(others)}, the rest {named(common)}. A drafter is "
            "written in one dtype, so these tensors were edited or come from another file; write the drafter "
            f"again, or cast every tensor to {_HEADER_NAMES[common]}")
    return HEADER_DTYPES[headers.pop()]


def check_declared_dtype(data: dict, dtype: torch.dtype, where: Path) -> None:
    """config.json's dtype (and torch_dtype), where given, must name the dtype the tensors are stored in:
    transformers' from_pretrained(dtype="auto") loads the weights as the config says."""
    for key in ("dtype", "torch_dtype"):
        value = data.get(key)
        name = value.removeprefix("torch.") if isinstance(value, str) else value
        if value is not None and name != DTYPE_NAMES[dtype]:
            raise DrafterError(f"{where}: {key} is {value!r} but the tensors in {WEIGHTS_NAME} are "
                               f"{DTYPE_NAMES[dtype]}; transformers loads a drafter in the dtype its config names: "
                               f"set \"{key}\": \"{DTYPE_NAMES[dtype]}\"")


def check_finite(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Refuse a drafter with a NaN or infinite weight, naming each such tensor (one isfinite pass per
    tensor; the counts only for a bad one)."""
    bad = []
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan = int(torch.isnan(tensor).sum())
            inf = int(torch.isinf(tensor).sum())
            bad.append(f"{name} ({nan} NaN, {inf} inf of {tensor.numel()} values)")
    if bad:
        raise DrafterError(
            f"the drafter in {directory} has non-finite weights: {_listed(sorted(bad))}. It would draft from NaN "
            "logits, so every draft is rejected (or the engine fails). A training run that diverged writes such "
            "weights: use an earlier checkpoint's drafter/ (<out>/checkpoints/step-N/drafter), or train again "
            "with a lower --lr")
