"""A double for what vLLM's and SGLang's drafter code imports but cannot run here: the seam between their
real config parsing and weight-name mapping (executed from the released wheel, unchanged) and their GPU
layers, kernels and distributed state (not installed: the wheels are read with no dependencies).

`EngineModules(wheel, real=[...], doubles={...})` is a context manager installing an import hook:

- a module named in `real` is executed from the wheel's own source file, as the engine ships it;
- a module named in `doubles` is a stand-in holding only the names given (the layer doubles below);
- any other module of the engine (its package __init__s, kernels, schedulers, ...) is an inert stand-in:
  importing a name from it works, *using* that name raises NotProvided naming it, so a test never
  passes through a path that was silently stubbed. Third-party packages resolve as usual (torch,
  transformers, regex); an absent optional one raises ImportError as it would for the engine.

`real_function(wheel, path, name, globals)` executes one top-level function of a wheel's module (for a
pure function living in a module too heavy to import, e.g. vLLM's set_default_rope_theta).

The layer doubles have the parameter shapes the engines' layers allocate from the same constructor
arguments (QKV stacked as q | k | v rows, gate_up as gate | up rows, nn.Linear layout [out, in]) and
weight loaders that check each loaded tensor's shape against its shard and record what was loaded, so a
test can tell that every parameter of the engine's model was filled exactly once.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import logging
import sys
import types
import zipfile
from pathlib import Path

import torch
from torch import nn


class NotProvided(RuntimeError):
    """An engine name that the double does not provide was used (not merely imported)."""


class _InertMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(f"{cls.__qualname__}.{name}", cls.__module__)

    def __call__(cls, *args, **kwargs):
        if "_inert_origin" in cls.__dict__:
            raise NotProvided(f"{cls.__module__}.{cls.__qualname__} is used here, but the engine double does "
                              "not provide it; add a double (tests/support/engine_import_double.py) or run the "
                              "real module")
        return super().__call__(*args, **kwargs)

    def __bool__(cls):
        return True


def _inert(qualname: str, module: str) -> type:
    """A stand-in name: importable, usable as a base class or an annotation, raises when called."""
    cls = _InertMeta(qualname.rsplit(".", 1)[-1], (), {"_inert_origin": True, "__module__": module})
    cls.__qualname__ = qualname
    return cls


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _inert(name, self.__name__)
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, finder: "EngineModules", kind: str):
        self.finder, self.kind = finder, kind

    def create_module(self, spec):
        if self.kind in ("inert", "double"):  # a double's other names are inert too
            return _InertModule(spec.name)
        return None

    def exec_module(self, module):
        name = module.__name__
        if self.kind == "double":
            module.__dict__.update(self.finder.doubles[name])
        elif self.kind == "real":
            path = self.finder.source_path(name)
            code = compile(self.finder.zip.read(path), f"{self.finder.wheel.name}/{path}", "exec")
            exec(code, module.__dict__)
        self.finder.created.append(name)


class EngineModules(importlib.abc.MetaPathFinder):
    """Import hook serving one engine package from its wheel (see the module docstring)."""

    def __init__(self, wheel: Path, package: str, real: list[str], doubles: dict[str, dict]):
        self.wheel, self.package = Path(wheel), package
        self.zip = zipfile.ZipFile(self.wheel)
        self.names = set(self.zip.namelist())
        self.real, self.doubles = set(real), dict(doubles)
        self.created: list[str] = []
        for name in self.real:
            self.source_path(name)  # a module that is not in the wheel fails here, not at use

    def source_path(self, name: str) -> str:
        base = name.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.names:
                return path
        raise ModuleNotFoundError(f"{name} is not in {self.wheel.name}")

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        if fullname in self.real:
            kind = "real"
            is_package = self.source_path(fullname).endswith("__init__.py")
        else:
            kind = "double" if fullname in self.doubles else "inert"
            is_package = True  # a stand-in may be a parent of real modules
        spec = importlib.util.spec_from_loader(fullname, _Loader(self, kind), is_package=is_package)
        if is_package:
            spec.submodule_search_locations = []
        return spec

    def __enter__(self) -> "EngineModules":
        clashing = [m for m in sys.modules if m == self.package or m.startswith(self.package + ".")]
        if clashing:
            raise RuntimeError(f"{self.package} is already imported ({clashing[:3]}...); the engine modules "
                               "must come from the pinned wheel")
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc):
        sys.meta_path.remove(self)
        for name in [m for m in sys.modules if m == self.package or m.startswith(self.package + ".")]:
            del sys.modules[name]
        self.zip.close()

    def load(self, name: str) -> types.ModuleType:
        return importlib.import_module(name)


def real_function(wheel: Path, path: str, name: str, namespace: dict | None = None):
    """Top-level function `name` (or method "Class.name", as a plain function of `self`) of `path` inside
    `wheel`, executed from its source as shipped; `namespace` holds the globals it uses."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(path).decode()
    body = ast.parse(source).body
    owner, _, name = name.rpartition(".")
    if owner:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        body = cls.body if cls else []
    node = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"{path} in {Path(wheel).name} has no function {owner + '.' if owner else ''}{name}")
    node.decorator_list = []
    namespace = {"__name__": f"engine_function.{name}", **(namespace or {})}
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"{Path(wheel).name}/{path}", "exec"), namespace)
    return namespace[name]


def literal_assignment(wheel: Path, path: str, name: str):
    """The value of a top-level `name = <literal>` (or annotated) in `path` inside `wheel`."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(path).decode())
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} in {Path(wheel).name} assigns no literal {name}")


# --- decorators and plain functions the engines call at import or construction time ---------------------
def identity_decorator(*args, **kwargs):
    """`@decorator` and `@decorator(...)` alike: the decorated object, unchanged."""
    if len(args) == 1 and not kwargs and (isinstance(args[0], type) or callable(args[0])):
        return args[0]
    return lambda obj: obj


def no_op(*args, **kwargs):
    return None


# --- layer doubles -------------------------------------------------------------------------------------------
class Loaded:
    """What the weight loaders filled, kept on each parameter (`loaded_shards`: shard ids, None for a
    whole tensor), so nothing outlives the model it describes."""

    @staticmethod
    def mark(param, shard) -> None:
        shards = param.__dict__.setdefault("loaded_shards", set())
        if shard in shards:
            raise AssertionError(f"shard {shard!r} of a parameter {tuple(param.shape)} was loaded twice")
        shards.add(shard)


LOADED = Loaded()


def _param(*shape) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.expected_shards = {None}
    return p


def default_weight_loader(param, loaded, *args):
    if args and args[0] is not None:
        raise AssertionError(f"a shard id {args[0]!r} was given for an unstacked parameter")
    if tuple(param.shape) != tuple(loaded.shape):
        raise AssertionError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)
    LOADED.mark(param, None)


class _Linear(nn.Module):
    """Unstacked linear layer in nn.Linear layout: weight [output_size, input_size]."""

    def __init__(self, input_size, output_size, bias=False, **kwargs):
        super().__init__()
        self.input_size, self.output_size = int(input_size), int(output_size)
        self.weight = _param(self.output_size, self.input_size)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = _param(self.output_size)
            self.bias.weight_loader = default_weight_loader
        self.quant_method = None
        self.kwargs = kwargs


class ReplicatedLinear(_Linear):
    pass


class RowParallelLinear(_Linear):
    pass


class ColumnParallelLinear(_Linear):
    pass


class _Stacked(nn.Module):
    """Stacked linear layer: rows of each shard at an offset; the loader checks each shard's shape."""

    def __init__(self, input_size, shards: dict, bias=False):
        super().__init__()
        self.input_size = int(input_size)
        self.shards, offset = {}, 0
        for shard, rows in shards.items():
            self.shards[shard] = (offset, int(rows))
            offset += int(rows)
        self.output_size = offset
        self.weight = _param(offset, self.input_size)
        self.weight.expected_shards = set(self.shards)
        self.weight.weight_loader = self._load
        if bias:
            raise AssertionError("the drafters checked here have no biases")
        self.quant_method = None

    def load_weights(self, weights):
        """vLLM's stacked layers load their own tensors, the shard id riding on the tensor (set by the
        WeightsMapper's orig_to_new_stacked)."""
        for name, loaded in weights:
            param = getattr(self, name)
            param.weight_loader(param, loaded, getattr(loaded, "shard_id", None))
            yield name

    def _load(self, param, loaded, shard=None):
        if shard is None:  # stacked on disk already: one tensor fills every shard
            if tuple(loaded.shape) != tuple(param.shape):
                raise AssertionError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint "
                                     f"{tuple(loaded.shape)}")
            param.data.copy_(loaded)
            for s in self.shards:
                LOADED.mark(param, s)
            return
        if shard not in self.shards:
            raise AssertionError(f"shard {shard!r} is not one of {sorted(map(str, self.shards))}")
        offset, rows = self.shards[shard]
        if tuple(loaded.shape) != (rows, self.input_size):
            raise AssertionError(f"shape mismatch in shard {shard!r}: parameter rows {(rows, self.input_size)}, "
                                 f"checkpoint {tuple(loaded.shape)}")
        param.data[offset:offset + rows].copy_(loaded)
        LOADED.mark(param, shard)


class QKVParallelLinear(_Stacked):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=False, **kwargs):
        kv = total_num_kv_heads or total_num_heads
        super().__init__(hidden_size, {"q": total_num_heads * head_size, "k": kv * head_size,
                                       "v": kv * head_size}, bias)
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, kv


class MergedColumnParallelLinear(_Stacked):
    def __init__(self, input_size, output_sizes, bias=False, **kwargs):
        super().__init__(input_size, dict(enumerate(output_sizes)), bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, **kwargs):
        super().__init__()
        self.weight = _param(int(hidden_size))
        self.variance_epsilon = eps


class GemmaRMSNorm(RMSNorm):
    pass


class Embedding(nn.Module):
    """VocabParallelEmbedding / ParallelLMHead: weight [vocab, hidden]."""

    def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
        super().__init__()
        self.weight = _param(int(num_embeddings), int(embedding_dim))
        self.weight.weight_loader = default_weight_loader


class Recorded(nn.Module):
    """A parameterless layer (attention, RoPE, activation, logits processor) that keeps its arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.args, self.kwargs = args, kwargs


def recorded(*args, **kwargs) -> Recorded:
    return Recorded(*args, **kwargs)


class AttentionType:
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER = "encoder"
    ENCODER_DECODER = "encoder_decoder"


def layer_doubles() -> dict:
    return dict(QKVParallelLinear=QKVParallelLinear, MergedColumnParallelLinear=MergedColumnParallelLinear,
                RowParallelLinear=RowParallelLinear, ReplicatedLinear=ReplicatedLinear,
                ColumnParallelLinear=ColumnParallelLinear)


def check_all_loaded(model: nn.Module, skip=()) -> list[str]:
    """Names of `model`'s parameters (outside `skip` prefixes) not loaded, or loaded only in part."""
    missing = []
    for name, param in model.named_parameters():
        if any(name.startswith(s) for s in skip):
            continue
        expected = getattr(param, "expected_shards", {None})
        got = getattr(param, "loaded_shards", set())
        if got != expected:
            missing.append(f"{name} (loaded {sorted(map(str, got)) or 'nothing'} of {sorted(map(str, expected))})")
    return missing


def logger_double(name=None):
    return logging.getLogger(name or "engine")


# --- the two engines -----------------------------------------------------------------------------------------
def vllm(wheel: Path, current: dict) -> EngineModules:
    """vLLM's drafter modules, real: the model (qwen3_dflash.py, with qwen2.py's MLP), the weight loader and
    mapper (models/utils.py), the draft config wrapper (configs/eagle.py), the tapped-layer rule
    (eagle3_utils.py). `current["config"]` answers get_current_vllm_config()."""
    from types import SimpleNamespace

    rope_theta = real_function(wheel, "vllm/transformers_utils/config.py", "set_default_rope_theta")

    def hf_file_bytes(name, model, revision=None):  # a local drafter directory: the file or nothing
        path = Path(model) / name
        return path.read_bytes() if path.is_file() else None

    linear = {**layer_doubles(), "UnquantizedLinearMethod": type("UnquantizedLinearMethod", (), {})}
    no_quantization = type("VllmConfig", (), {"get_quantization_config": staticmethod(lambda model, load: None)})
    doubles = {
        "vllm.logger": {"init_logger": logger_double},
        "vllm.compilation.decorators": {"support_torch_compile": identity_decorator},
        "vllm.distributed": {"get_tensor_model_parallel_world_size": lambda: 1,
                             "get_tensor_model_parallel_rank": lambda: 0},
        "vllm.model_executor.layers.linear": linear,
        "vllm.model_executor.layers.layernorm": {"RMSNorm": RMSNorm},
        "vllm.model_executor.layers.vocab_parallel_embedding": {"VocabParallelEmbedding": Embedding,
                                                                "ParallelLMHead": Embedding},
        "vllm.model_executor.layers.rotary_embedding": {"get_rope": recorded},
        "vllm.model_executor.layers.attention": {"Attention": Recorded},
        "vllm.model_executor.layers.activation": {"SiluAndMul": Recorded},
        "vllm.model_executor.layers.logits_processor": {"LogitsProcessor": Recorded},
        "vllm.model_executor.model_loader.weight_utils": {"default_weight_loader": default_weight_loader,
                                                          "make_attention_sink": no_op},
        "vllm.model_executor.model_loader.reload": {"support_quantized_model_reload_from_hp_weights":
                                                    identity_decorator},
        "vllm.utils.torch_utils": {"direct_register_custom_op": no_op},
        "vllm.config": {"get_current_vllm_config": lambda: current["config"],
                        "get_current_vllm_config_or_none": lambda: current.get("config"),
                        "VllmConfig": no_quantization},
        "vllm.platforms": {"current_platform": SimpleNamespace(is_rocm=lambda: False, is_cpu=lambda: False)},
        "vllm.transformers_utils.config": {"set_default_rope_theta": rope_theta},
        "vllm.transformers_utils.repo_utils": {"get_hf_file_bytes": hf_file_bytes},
        "vllm.v1.attention.backend": {"AttentionType": AttentionType},
        "vllm.model_executor.models.interfaces": {"supports_any_eagle": lambda model: True},
        "vllm.model_executor.models.qwen3": {"Qwen3ForCausalLM": nn.Module},  # a base DFlash's __init__ bypasses
    }
    real = ["vllm.model_executor.models.qwen3_dflash", "vllm.model_executor.models.qwen2",
            "vllm.model_executor.models.utils", "vllm.transformers_utils.configs.eagle",
            "vllm.transformers_utils.utils", "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"]
    return EngineModules(wheel, "vllm", real, doubles)


def sglang(wheel: Path) -> EngineModules:
    """SGLang's drafter modules, real: the model and its load_weights (models/dflash.py) and the draft config
    parsing (speculative/dflash_utils.py)."""
    from types import SimpleNamespace

    rope_config = real_function(wheel, "sglang/srt/utils/hf_transformers/common.py", "get_rope_config")
    doubles = {
        "sglang.srt.configs.draft_parallel": {"DraftParallelSpec": SimpleNamespace},  # msgspec: parallel layout
        "sglang.srt.layers.linear": layer_doubles(),
        "sglang.srt.layers.layernorm": {"RMSNorm": RMSNorm, "GemmaRMSNorm": GemmaRMSNorm},
        "sglang.srt.layers.activation": {"SiluAndMul": Recorded},
        "sglang.srt.layers.radix_attention": {"RadixAttention": Recorded, "AttentionType": AttentionType},
        "sglang.srt.layers.rotary_embedding": {"get_rope": recorded},
        "sglang.srt.layers.vocab_parallel_embedding": {"VocabParallelEmbedding": Embedding},
        "sglang.srt.model_loader.weight_utils": {"default_weight_loader": default_weight_loader},
        "sglang.srt.runtime_context": {"get_parallel": lambda: SimpleNamespace(tp_size=1, tp_rank=0),
                                       "get_spec": lambda: SimpleNamespace()},
        "sglang.srt.utils": {"is_npu": lambda: False, "set_weight_attrs": no_op},
        "sglang.srt.utils.common": {"get_compiler_backend": lambda: "inductor"},
        "sglang.srt.utils.hf_transformers_utils": {"get_rope_config": rope_config},
    }
    return EngineModules(wheel, "sglang", ["sglang.srt.models.dflash", "sglang.srt.speculative.dflash_utils"],
                         doubles)
