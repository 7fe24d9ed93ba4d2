"""FP8 checkpoints on disk: the layout Qwen publishes, written from a bf16 one, and checked before loading.

A fine-grained FP8 model directory is the bf16 one with, for every converted linear layer,

    <module>.weight            [N, K] float8_e4m3fn
    <module>.weight_scale_inv  [ceil(N/128), ceil(K/128)] float32

and config.json's `quantization_config`:

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]}

Left in bf16 (modules_to_not_convert), as Qwen's FP8 releases list them: the embedding, the LM head, every
norm, and each GatedDeltaNet's convolution and small projections (in_proj_a, in_proj_b: one row per value
head). transformers reads the list with its own matching (quantizers_utils.should_convert_module).

    write_fp8_checkpoint(src, out)   bf16/fp32 directory -> FP8 directory (atomic: a temporary name, renamed)
    read_fp8_quantization(path)      config.json's quantization_config, or None; refuses other methods
    check_fp8_tensors(path, quant)   every FP8 weight has its scale tensor: the block grid's shape, a float dtype,
                                     finite and positive values; every scale tensor has its FP8 weight
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import torch

from dflash.errors import TargetError
from dflash.model.fp8 import BLOCK, fp8_capable, pick_gemm, quantize_weight, use_fp8_gemm

log = logging.getLogger(__name__)

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [BLOCK, BLOCK]}
# GatedDeltaNet parts left in bf16 in Qwen's FP8 releases (small: a few rows, or no matmul at all)
_GDN_KEPT = ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba", "linear_attn.conv1d",
             "linear_attn.norm")
_REWRITE_FIX = "write it again from the bf16 checkpoint (dflash fp8-write BF16_DIR FP8_DIR), or download it again"


def _build_on_meta(config_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def default_modules_to_not_convert(model) -> list[str]:
    """Qwen's list for `model` (built on the meta device): the embedding, the LM head, every norm and the
    GatedDeltaNet's small parts, as full module names."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if module is embed or module is head or "norm" in type(module).__name__.lower() \
                or name.endswith(_GDN_KEPT):
            names.append(name)
    return names


def _linear_names(model) -> set[str]:
    return {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}


def _weight_files(src: Path) -> list[str]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (src / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise TargetError(f"{src} holds no safetensors weights (model.safetensors or model.safetensors.index.json); "
                      "save the bf16 model with save_pretrained(..., safe_serialization=True) first")


def write_fp8_checkpoint(src, out, *, modules_to_not_convert: list[str] | None = None) -> dict:
    """Write the FP8 block-quantised copy of the bf16/fp32 model directory `src` to `out` (which must not
    exist): each shard quantised tensor by tensor, the other files copied, config.json given its
    quantization_config. Written under a temporary name beside `out`, renamed when complete. Returns a
    record: quantised layers, bf16 tensors, bytes before and after."""
    from safetensors.torch import load_file, save_file
    from transformers.quantizers.quantizers_utils import should_convert_module

    src, out = Path(src), Path(out)
    if out.exists():
        raise TargetError(f"{out} exists; the FP8 checkpoint is written to a new directory: remove it or pick another")
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise TargetError(f"{src / 'config.json'} already has a quantization_config "
                          f"({config['quantization_config'].get('quant_method')!r}); pass the bf16 checkpoint")
    model = _build_on_meta(src)
    skip = list(modules_to_not_convert) if modules_to_not_convert is not None else default_modules_to_not_convert(model)
    linears = _linear_names(model)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    record = {"quantized": 0, "kept": 0, "bytes_in": 0, "bytes_out": 0}
    weight_map = {}
    try:
        for name in sorted(os.listdir(src)):
            if not name.endswith(".safetensors") and name not in ("config.json", "model.safetensors.index.json") \
                    and (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        for file in _weight_files(src):
            tensors = load_file(src / file)
            written = {}
            for key, value in tensors.items():
                record["bytes_in"] += value.numel() * value.element_size()
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and value.dim() == 2 and module in linears \
                        and should_convert_module(module, skip):
                    q, s = quantize_weight(value)
                    written[key], written[module + ".weight_scale_inv"] = q, s
                    record["quantized"] += 1
                else:
                    written[key] = value.contiguous()
                    record["kept"] += 1
            save_file(written, tmp / file, metadata={"format": "pt"})
            record["bytes_out"] += sum(t.numel() * t.element_size() for t in written.values())
            weight_map.update({key: file for key in written})
            del tensors, written
        if (src / "model.safetensors.index.json").is_file():
            index = json.loads((src / "model.safetensors.index.json").read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            index.setdefault("metadata", {})["total_size"] = record["bytes_out"]
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": skip}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


# --------------------------------------------------------------------------------------------------
# Reading: what a target directory's quantization_config says, checked before any weight is read
# --------------------------------------------------------------------------------------------------
def read_fp8_quantization(path) -> dict | None:
    """config.json's quantization_config when it is fine-grained FP8 with 128 x 128 blocks and dynamic
    activations; None when there is none; a TargetError naming the file and the fix for anything else."""
    file = Path(path) / "config.json"
    try:
        quant = json.loads(file.read_bytes()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # read_target_config names a missing or damaged config.json
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise TargetError(f"{file}: quantization_config.quant_method is {method!r}; a target is loaded in bf16 or "
                          "as fine-grained FP8 (quant_method \"fp8\", the layout Qwen publishes). Pass the bf16 "
                          "checkpoint or its FP8 release, or write one: dflash fp8-write BF16_DIR FP8_DIR")
    block = quant.get("weight_block_size")
    if block is None or [int(b) for b in block] != [BLOCK, BLOCK]:
        raise TargetError(f"{file}: weight_block_size is {block}; only 128 x 128 weight blocks are supported "
                          "(Qwen's FP8 releases); write the checkpoint with dflash fp8-write")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise TargetError(f"{file}: activation_scheme {quant.get('activation_scheme')!r}; only dynamic activation "
                          "scales (computed per token at run time) are supported")
    return quant


def _headers(path: Path) -> dict[str, tuple[str, list[int], str]]:
    """Every tensor's (dtype, shape, file) from the safetensors headers (no tensor data is read)."""
    out = {}
    for file in _weight_files(path):
        try:
            with open(path / file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if size > os.fstat(f.fileno()).st_size:
                    raise ValueError(f"its header claims {size} bytes, more than the file holds")
                header = json.loads(f.read(size))
            out.update({k: (v["dtype"], v["shape"], file) for k, v in header.items() if k != "__metadata__"})
        except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:  # cut short, not safetensors
            raise TargetError(f"{path / file}: its safetensors header cannot be read ({type(exc).__name__}: {exc}); "
                              f"{_REWRITE_FIX}") from None
    return out


# safetensors dtypes a scale may have: transformers multiplies in float32 (a float8 scale would round to zero)
SCALE_DTYPES = ("F32", "BF16", "F16", "F64")


def _scale_problem(key: str, shape: list[int], scale_key: str, scale) -> str | None:
    """What is wrong with the header (dtype, shape, file) `scale` of the FP8 weight `key` [N, K]'s scale tensor
    `scale_key` (None: there is none), or None."""
    if scale is None:
        return f"the FP8 weight {key} {shape} has no scale tensor {scale_key}; the checkpoint is incomplete"
    want = [math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)] if len(shape) == 2 else None
    if want is None or list(scale[1]) != want:
        return (f"{scale_key} is {scale[1]}, the FP8 weight {key} {shape} needs {want} (one float32 scale per "
                "128 x 128 block)")
    if scale[0] not in SCALE_DTYPES:
        return (f"{scale_key} is {scale[0]}, not a float type that holds a scale ({', '.join(SCALE_DTYPES)}): the "
                f"weights of {key} would load as other numbers")
    return None


def _scale_values_problem(scale_key: str, values: torch.Tensor) -> str | None:
    """What is wrong with the values of a scale tensor (each is its block's max |W| / 448: finite and
    positive), or None."""
    values = values.float()
    counts = {("NaN", "NaN"): values.isnan(), ("infinite", "infinite"): values.isinf(),
              ("zero", "all-zero"): values == 0, ("negative", "sign-flipped"): values < 0}
    found = [(what, loads, int(mask.sum())) for (what, loads), mask in counts.items() if mask.any()]
    if not found:
        return None
    said = ", ".join(f"{n} {what}" for what, _, n in found)
    loads = " or ".join(loads for _, loads, _ in found)
    return (f"{scale_key} holds {said} of its {values.numel()} scales, so those blocks would load as {loads} "
            "weights (a scale is its block's max |W| / 448: finite and positive)")


def _orphan_scales(tensors: dict) -> list[str]:
    """Scale tensors with no float8 weight beside them (transformers fails on one with a traceback)."""
    return sorted(k for k in tensors if k.endswith(".weight_scale_inv")
                  and tensors.get(k.removesuffix("_scale_inv"), ("",))[0] != "F8_E4M3")


def _check_scale_values(path: Path, scales: dict[str, str]) -> None:
    """Read every scale tensor ({key: file}; small: one number per 128 x 128 block) and refuse bad values."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key, file in scales.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        with safe_open(path / file, "pt") as f:
            for key in sorted(keys):
                if problem := _scale_values_problem(key, f.get_tensor(key)):
                    raise TargetError(f"{path / file}: {problem}; {_REWRITE_FIX}")


def check_fp8_tensors(path, dequantize: bool) -> dict:
    """Every float8 weight of the FP8 directory `path` has `weight_scale_inv` of [ceil(N/128), ceil(K/128)], of a
    float dtype, finite and positive, and every scale tensor has its float8 weight; with `dequantize` (no FP8 GPU:
    transformers (5.24, 5.25) dequantizes at load, deriving the block from the scale grid, so a dimension over 128
    that is not a multiple of 128 would be cut into wrong blocks) every such dimension is refused. A TargetError
    names the tensor and its file. Returns {"fp8_weights": n, "fp8_bytes": bytes of weights and scales}."""
    path = Path(path)
    tensors = _headers(path)
    fp8 = {k: v for k, v in tensors.items() if v[0] == "F8_E4M3" and k.endswith(".weight")}
    if not fp8:
        raise TargetError(f"{path / 'config.json'} says FP8, but no weight in {path} is float8_e4m3fn; "
                          f"{_REWRITE_FIX}")
    if orphans := _orphan_scales(tensors):
        orphan, weight = orphans[0], tensors.get(orphans[0].removesuffix("_scale_inv"))
        what = f"{weight[0]} {weight[1]}" if weight else "missing"
        raise TargetError(f"{path / tensors[orphan][2]}: {orphan} scales no float8 weight (its weight is {what}); "
                          f"{_REWRITE_FIX}")
    total, scales = 0, {}
    for key, (_, shape, file) in sorted(fp8.items()):
        scale_key = key.removesuffix(".weight") + ".weight_scale_inv"
        scale = tensors.get(scale_key)
        if problem := _scale_problem(key, shape, scale_key, scale):
            raise TargetError(f"{path / (scale[2] if scale else file)}: {problem}; {_REWRITE_FIX}")
        if dequantize and any(d > BLOCK and d % BLOCK for d in shape):
            raise TargetError(f"{path / file}: {key} {shape} has a partial 128-block past the first; without an "
                              "FP8 GPU transformers dequantizes it with the wrong block size. Load it on a GPU "
                              "of compute capability 8.9 or newer, or use the bf16 checkpoint")
        scales[scale_key] = scale[2]
        total += math.prod(shape) + 4 * math.prod(scale[1])
    _check_scale_values(path, scales)
    return {"fp8_weights": len(fp8), "fp8_bytes": total, "tensor_dtypes": {k: v[0] for k, v in tensors.items()}}


# --------------------------------------------------------------------------------------------------
# Loading (dflash.model.target.Target.load)
# --------------------------------------------------------------------------------------------------
def check_fp8_target(path, device) -> dict | None:
    """An FP8 target's quantization_config and scale tensors, checked before its weights load (None for
    an unquantised target): a wrong method, block or missing scale is a TargetError naming the file."""
    quant = read_fp8_quantization(path)
    if quant is None:
        return None
    try:
        import accelerate  # noqa: F401  transformers' FP8 quantizer refuses to load without it
    except ImportError:
        raise TargetError(f"{path} is an FP8 checkpoint; transformers loads those only with accelerate "
                          "installed: pip install accelerate (the runtime image has it)") from None
    return {**quant, **check_fp8_tensors(path, dequantize=not fp8_capable(device))}


def fp8_precision(model, device, dtype, fp8: dict) -> str:
    """After transformers loaded an FP8 checkpoint: on an FP8 GPU its FP8 linear layers run on the GEMM
    dflash.model.fp8.pick_gemm chooses; elsewhere transformers has dequantized them to `dtype` (said here)."""
    gemm = pick_gemm(device)
    layers = use_fp8_gemm(model, gemm) if gemm != "dequant" else 0
    if layers:
        log.info("FP8 target: %d linear layers stay FP8 (128 x 128 blocks, GEMM %s), %.2f GB of FP8 weights and "
                 "scales", layers, gemm, fp8["fp8_bytes"] / 1e9)
        return f"fp8 ({gemm})"
    name = str(dtype).removeprefix("torch.")
    log.warning("FP8 target on %s: no GPU of compute capability 8.9 or newer, so transformers dequantized its %d "
                "FP8 weights to %s at load; the target runs dequantized (the same values, %s speed and memory)",
                torch.device(device), fp8["fp8_weights"], name, name)
    return f"fp8 dequantized to {name}"


def main(argv=None) -> int:
    """`dflash fp8-write BF16_DIR FP8_DIR`: the FP8 block-quantised copy of a model directory."""
    import argparse

    p = argparse.ArgumentParser(prog="dflash fp8-write", description="Write the FP8 block-quantised copy "
                                "(128 x 128 weight blocks, Qwen's published layout) of a bf16 model directory.")
    p.add_argument("src", help="the bf16 (or fp32) model directory")
    p.add_argument("out", help="the FP8 model directory to create (must not exist)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    args = p.parse_args(argv)
    record = write_fp8_checkpoint(args.src, args.out)
    print(json.dumps(record) if args.json else
          f"wrote {args.out}: {record['quantized']} FP8 linear layers, {record['kept']} tensors kept, "
          f"{record['bytes_in'] / 1e9:.2f} GB -> {record['bytes_out'] / 1e9:.2f} GB")
    return 0
