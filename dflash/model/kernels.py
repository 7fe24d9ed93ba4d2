"""Which implementation each GatedDeltaNet kernel function of a transformers model module resolves to,
which one each op of a built layer takes, and routing it by device.

transformers 5.15+ resolves each GatedDeltaNet kernel function (`chunk_gated_delta_rule`, ...) once, at
import, to the installed package (fla, causal-conv1d) or to its torch reference. 5.24 does not look at
the device, so with fla installed a CPU forward reaches Triton and dies ("0 active drivers"); 5.25
added the device check. `route_kernels_by_device` applies the same rule here: CUDA tensors take the
resolved kernel, anything else the torch reference. `kernel_functions` is the one reader of that
dispatch, used by the target's kernel report and the doctor's dispatch check. The convolution and the
chunked delta rule also keep packed sequences apart (dflash.model.segment_kernels).

With the `kernels` package installed (a dependency of transformers 5.25), its `use_kernel_forward_from_hub`
turns each of those functions into a small nn.Module whose forward calls transformers' wrapper, and
`use_kernelized_func` gives every GatedDeltaNet layer private copies of them (`layer._kernel_funcs`) that
`kernelize` may rebind to a kernel from the Hugging Face Hub (`_kernel_repo` in the copy's `__dict__`).
`op_paths` reads, for one built layer, which of causal-conv1d, fla, a hub kernel or the torch reference
each op takes on the layer's device: the doctor's kernel-path check.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from dflash.model.segment_kernels import SEGMENT_ROUTERS


@dataclass(frozen=True)
class KernelFunction:
    """One function transformers resolved through `use_kernel_func_from_hub_with_fallback`."""

    name: str                 # the kernel's own name, e.g. "chunk_gated_delta_rule"
    attr: str                 # the module attribute holding it, e.g. "torch_chunk_gated_delta_rule"
    package: str              # where the fast one comes from: "fla" or "causal_conv1d"
    fast: bool                # True when it resolved to the package's kernel, not the torch reference
    implementation: Callable  # what the wrapper calls: the package's kernel, or torch_function
    torch_function: Callable  # the torch reference
    # The device types whose inputs the wrapper hands to the package's kernel (5.25: ("cuda",) for
    # causal_conv1d; fla's also xpu, mlu, npu); None: every device (5.24 has no such check).
    devices: tuple[str, ...] | None = None


# The free variables of transformers' fallback wrapper (integrations/hub_kernels.py, 5.24 and 5.25) that
# say what it resolved; a wrapper without all of them is not one this code knows how to read.
_WRAPPER_CELLS = frozenset({"func_name", "package", "implementation", "torch_function"})


def _closure(fn: Callable) -> dict:
    """`fn`'s closure as {free variable: value}, leaving out empty cells (a variable not bound yet: torch.compile's
    runtime wrappers have them, and dynamo installs those as `__compiled_fn_*` globals of the module whose code
    it compiled, the modeling module once the target's norms are compiled: dflash.model.fused_norms)."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # "Cell is empty"
            continue
    return out


def _hub_function(obj) -> Callable | None:
    """The function inside one of `kernels`' function modules (`use_kernel_forward_from_hub` applied to a
    function makes an nn.Module whose class's forward calls it: its closure cell `func`), or None."""
    cls = type(obj)
    forward = cls.__dict__.get("forward") if getattr(cls, "kernel_layer_name", None) else None
    return _closure(forward).get("func") if inspect.isfunction(forward) else None


def _kernel_wrapper_state(fn: Callable) -> dict | None:
    """The closure of transformers' fallback wrapper inside `fn`, following `__wrapped__` and `kernels`'
    function modules through outer wrappers (`_device_router`, a segment router), or None."""
    seen = 0
    while fn is not None and seen < 8:
        if inspect.isfunction(fn):
            state = _closure(fn)
            if _WRAPPER_CELLS <= state.keys():
                return state
        fn, seen = _hub_function(fn) or getattr(fn, "__wrapped__", None), seen + 1
    return None


def _kernel_function(attr: str, value) -> KernelFunction | None:
    state = _kernel_wrapper_state(value) if callable(value) else None
    if state is None:
        return None
    devices = state.get("supported_devices")
    return KernelFunction(
        name=state["func_name"], attr=attr, package=state["package"],
        fast=state["implementation"] is not state["torch_function"],
        implementation=state["implementation"], torch_function=state["torch_function"],
        devices=tuple(devices) if devices is not None else None,
    )


def kernel_functions(module: ModuleType) -> list[KernelFunction]:
    """Every per-function kernel dispatch point a transformers modeling module defines.

    transformers 5.24 and 5.25 wrap each with `use_kernel_func_from_hub_with_fallback(func_name, package)`,
    which picks the implementation ONCE, when the model module is imported: the function in
    `importlib.import_module(package)`, else the torch reference. The choice lives in the wrapper's
    closure; at call time a fallback only logs "`{func}` is falling back to its reference PyTorch
    implementation". Reading the closure tells the same without running a kernel, so it works on a
    machine without a GPU. With `kernels` installed the module attribute is `kernels`' function module
    around that wrapper; it is read through.
    """
    found = [_kernel_function(attr, value) for attr, value in sorted(vars(module).items())]
    return [fn for fn in found if fn is not None]


# ----------------------------------------------------------------------------------------------------
# The path each op of a built GatedDeltaNet layer takes
# ----------------------------------------------------------------------------------------------------
# The four ops of a GatedDeltaNet layer, by their kernel name: the convolution and the delta rule over a
# sequence (prefill, training), and their one-token steps against the cache (decoding).
GDN_OPS = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
# What each path is called: the distribution a package's kernel comes from, a hub kernel, the reference.
PATHS = {"causal_conv1d": "causal-conv1d", "fla": "fla"}
HUB, TORCH = "kernels", "torch"
# transformers 5.25's functions that call an op and that `kernelize` may replace as a whole: a hub kernel
# bound to `causal_conv1d_forward` (the conv with its cache) takes both convolution ops over.
_CALLERS = {"causal_conv1d_fn": "causal_conv1d_forward", "causal_conv1d_update": "causal_conv1d_forward"}


@dataclass(frozen=True)
class OpPath:
    """The implementation one op of a built GatedDeltaNet layer runs on the layer's device."""

    op: str      # the kernel's own name, e.g. "chunk_gated_delta_rule"
    path: str    # "causal-conv1d", "fla", "kernels" (a hub kernel bound by `kernelize`) or "torch"
    runs: str    # the function that runs (module.qualname), or the hub repository bound
    why: str     # why not a faster path ("" when the package's kernel or a hub kernel runs)
    package: str = ""  # the package whose kernel transformers would call ("causal_conv1d", "fla")

    def line(self) -> str:
        return f"{self.op} -> {self.path} ({self.runs}{'; ' + self.why if self.why else ''})"


def gated_delta_net_layers(model) -> list:
    """The GatedDeltaNet linear-attention layers of a built model, in order."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def _dotted(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _hub_repo(obj) -> str | None:
    """The Hub repository `kernels.kernelize` bound to this layer or function module, or None."""
    repo = vars(obj).get("_kernel_repo") if obj is not None and hasattr(obj, "__dict__") else None
    return str(repo) if repo is not None else None


def op_paths(layer, ops: tuple[str, ...] = GDN_OPS) -> list[OpPath]:
    """The path each op of `layer` (a GatedDeltaNet module) takes on the device its weights are on.

    Read from what transformers bound, not decided again here: a hub kernel `kernelize` bound to the
    layer, to the function that calls the op, or to the layer's own copy of the op (`_kernel_repo`); else
    the wrapper in that copy (or, without `kernels`, in the model module): the package's kernel it
    resolved at import when the wrapper sends inputs of this device type to it, else the torch reference.
    Raises LookupError for an op the layer's module does not dispatch (transformers changed it)."""
    device = next(layer.parameters()).device
    own = vars(layer).get("_kernel_funcs", {})
    module_fns = {fn.name: fn for fn in kernel_functions(sys.modules[type(layer).__module__])}
    out = []
    for op in ops:
        repo = _hub_repo(layer) or _hub_repo(own.get(_CALLERS.get(op))) or _hub_repo(own.get(op))
        fn = _kernel_function(op, own[op]) if op in own else module_fns.get(op)
        if fn is None:
            raise LookupError(f"{type(layer).__name__} dispatches no kernel function named {op} (found: "
                              f"{', '.join(sorted(own or module_fns)) or 'none'})")
        reference, name = _dotted(fn.torch_function), PATHS.get(fn.package, fn.package)
        if repo is not None:
            out.append(OpPath(op, HUB, repo, "", fn.package))
        elif not fn.fast:
            out.append(OpPath(op, TORCH, reference, f"{name} is not installed or does not import", fn.package))
        elif fn.devices is not None and device.type not in fn.devices:
            out.append(OpPath(op, TORCH, reference, f"{device.type} inputs: transformers hands only "
                              f"{', '.join(fn.devices)} inputs to {fn.package}", fn.package))
        else:
            out.append(OpPath(op, name, _dotted(fn.implementation), "", fn.package))
    return out


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _device_router(wrapper: Callable, torch_function: Callable) -> Callable:
    """`wrapper` for CUDA inputs, `torch_function` (with the kwargs it accepts) for anything else."""
    params = inspect.signature(torch_function).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(wrapper)
    def routed(*args, **kwargs):
        first = _first_tensor(args, kwargs)
        if first is not None and first.is_cuda:
            return wrapper(*args, **kwargs)
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_function(*args, **kwargs)

    routed.__dflash_routed__ = True
    return routed


def route_kernels_by_device(module: ModuleType) -> None:
    """Make `module`'s kernel functions send non-CUDA tensors to their torch reference (idempotent).

    Where transformers' wrapper checks the device itself (5.25: `devices` known) it is left to do so, and
    the calls keep going through it (and through a kernel `kernels.kernelize` may have bound in its place).
    The convolution and the chunked delta rule are routed whether or not their kernel resolved: they also
    keep packed sequences apart (seq_idx / cu_seqlens), on the kernel or, one sequence at a time, on the
    reference (dflash.model.segment_kernels)."""
    for fn in kernel_functions(module):
        current = getattr(module, fn.attr)
        if getattr(current, "__dflash_routed__", False):
            continue
        guarded = fn.devices is not None
        if fn.name in SEGMENT_ROUTERS:
            setattr(module, fn.attr, SEGMENT_ROUTERS[fn.name](current, fn.torch_function, fn.implementation, fn.fast,
                                                              guarded))
        elif fn.fast and not guarded:
            setattr(module, fn.attr, _device_router(current, fn.torch_function))
