"""GatedDeltaNet kernel functions that keep the sequences of a pack apart (dflash.model.segments).

The Qwen3.5 GatedDeltaNet layer (transformers 5.24 and 5.25, models/qwen3_5/modeling_qwen3_5.py) hands the
decoder's keyword arguments on to its two sequence-mixing functions:

    causal_conv1d_fn(x [B,D,T], weight [D,W], bias, activation=..., **kwargs)      reads kwargs["seq_idx"]
    chunk_gated_delta_rule(q, k [B,T,H,K], v [B,T,HV,V], g=, beta= [B,T,HV], ...,
                           cu_seqlens=kwargs.pop("cu_seq_lens_q"), **kwargs)

With a pack, `seq_idx` [B,T] numbers each token's sequence and `cu_seqlens` [S+1] holds the sequence starts
over the flattened B*T. Where each call goes:

    x on CUDA, the fast kernel resolved    causal-conv1d's kernel with seq_idx (a tap never reads across a
                                           change of seq_idx; it needs channel-last x: stride(1) == 1)
                                           fla's kernel with cu_seqlens, on [1,B*T,...] (fla takes batch 1
                                           with cu_seqlens) and reshaped back to [B,T,...]
    anything else, with seq_idx/cu_seqlens the torch reference on each sequence alone, concatenated
    anything else, without them            transformers' own wrapper, where it sends inputs its kernel cannot
                                           take to the reference itself (5.25, or no kernel resolved: the
                                           wrapper calls the reference); else (5.24) the torch reference

Why: the torch references take **kwargs and ignore seq_idx and cu_seqlens, so called directly they carry the
convolution window and the delta-rule state from one packed sequence into the next; transformers' wrapper
refuses them instead ("can't keep packed sequences apart"). With cu_seqlens the delta rule follows fla's
convention: initial_state and the final state are [N,HV,K,V], one per sequence.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch


def _named(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A call with `args`, `kwargs` of a function of signature `sig` as {parameter name: value}, its
    **kwargs folded in."""
    bound = sig.bind(*args, **kwargs).arguments
    for name, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    return dict(bound)


def _accepted(params, call: dict) -> dict:
    """The entries of `call` that a function with these parameters names (never its **kwargs catch-all)."""
    return {k: v for k, v in call.items() if k in params and params[k].kind is not inspect.Parameter.VAR_KEYWORD}


def _runs(seq_idx_row: torch.Tensor) -> list[tuple[int, int]]:
    """[T] segment numbers -> [(start, end)] of each run of equal numbers."""
    cuts = (torch.nonzero(seq_idx_row[1:] != seq_idx_row[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, int(seq_idx_row.shape[0])]
    return list(zip(bounds, bounds[1:]))


def conv1d_by_segment(torch_function: Callable, x: torch.Tensor, weight: torch.Tensor, bias=None,
                      activation=None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """[B,D,T] -> [B,D,T]: `torch_function` (the causal-conv1d reference) on each run of equal `seq_idx`
    [B,T] alone, concatenated along T; without seq_idx, one call."""
    if seq_idx is None:
        return torch_function(x, weight, bias, activation=activation)
    if tuple(seq_idx.shape) != (x.shape[0], x.shape[-1]):
        raise ValueError(f"seq_idx is {tuple(seq_idx.shape)}, the convolution's input [B,D,T] is {tuple(x.shape)}: "
                         "seq_idx must be [B,T]")
    rows = []
    for b in range(x.shape[0]):
        parts = [torch_function(x[b:b + 1, :, s:e], weight, bias, activation=activation)
                 for s, e in _runs(seq_idx[b])]
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=0)


def delta_rule_by_segment(torch_function: Callable, query, key, value, g, beta, *, cu_seqlens: torch.Tensor,
                          initial_state=None, output_final_state: bool = False, **kwargs):
    """fla's varlen chunked delta rule, computed with the torch reference one sequence at a time.

    query, key [B,T,H,K], value [B,T,HV,V], g, beta [B,T,HV]; cu_seqlens [N+1]: sequence starts over the
    flattened B*T, then B*T; initial_state None or [N,HV,K,V]. Returns ([B,T,HV,V] output, [N,HV,K,V] final
    states or None).
    """
    B, T = query.shape[:2]
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != B * T or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to B*T={B * T}, got {bounds[:4]}...{bounds[-2:]}")
    if initial_state is not None and initial_state.shape[0] != len(bounds) - 1:
        raise ValueError(f"initial_state holds {initial_state.shape[0]} states for {len(bounds) - 1} sequences")
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (query, key, value, g, beta)]
    outs, finals = [], []
    for n, (s, e) in enumerate(zip(bounds, bounds[1:])):
        if e == s:
            continue
        q, k, v, g_n, beta_n = (t[:, s:e] for t in flat)
        out, final = torch_function(q, k, v, g=g_n, beta=beta_n, output_final_state=output_final_state,
                                    initial_state=None if initial_state is None else initial_state[n:n + 1],
                                    **kwargs)
        outs.append(out)
        finals.append(final)
    out = torch.cat(outs, dim=1).reshape(B, T, *outs[0].shape[2:])
    return out, torch.cat(finals) if output_final_state else None


# The last cu_seqlens seen and its int64 copy: (source tensor, its version counter, int64 tensor).
_LONG_BOUNDS: list = []


def long_bounds(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens` as int64 (fla's dtype), the same tensor for as long as the same `cu_seqlens` comes back.

    transformers hands one int32 `cu_seq_lens_q` (flash-attention's dtype) to every layer of a pass. fla
    builds its chunk indices with a device-to-host sync (`repeat_interleave`) and caches them by the identity
    of the cu_seqlens tensor (fla.utils.tensor_cache); a fresh int64 copy in every layer missed that cache,
    so each GatedDeltaNet layer synchronised twice (95 syncs in a 27B pass: bench/NOTES.md). One copy per
    source tensor lets fla's cache hit from the second layer on. A source written in place (its version
    counter moved) gets a new copy."""
    if cu_seqlens.dtype == torch.long:
        return cu_seqlens
    if _LONG_BOUNDS and _LONG_BOUNDS[0] is cu_seqlens and _LONG_BOUNDS[1] == cu_seqlens._version:
        return _LONG_BOUNDS[2]
    _LONG_BOUNDS[:] = [cu_seqlens, cu_seqlens._version, cu_seqlens.to(torch.long)]
    return _LONG_BOUNDS[2]


def _varlen_on_one_row(kernel: Callable, call: dict, cu_seqlens: torch.Tensor):
    """fla's kernel on [B,T,...] inputs with cu_seqlens over B*T: flattened to batch 1, and back to [B,T,...]."""
    B, T = call["query"].shape[:2]
    q, k, v, g, beta = (call.pop(n) for n in ("query", "key", "value", "g", "beta"))
    q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
    out, final = kernel(q, k, v, g=g, beta=beta, cu_seqlens=long_bounds(cu_seqlens), **call)
    return out.reshape(B, T, *out.shape[2:]), final


def conv1d_router(wrapper: Callable, torch_function: Callable, implementation: Callable, fast: bool,
                  guarded: bool = False) -> Callable:
    """causal_conv1d_fn as the module docstring routes it. `wrapper` is transformers' dispatching function,
    `implementation` the kernel it resolved (its parameters say whether it takes seq_idx); `guarded`: the
    wrapper sends inputs of a device its kernel does not run on to the reference itself."""
    takes_seq_idx = "seq_idx" in inspect.signature(implementation).parameters
    reference = inspect.signature(torch_function)  # read once: the router runs in every layer's forward

    @functools.wraps(wrapper)
    def routed(*args, **kwargs):
        call = _named(reference, args, kwargs)
        x, seq_idx = call["hidden_states"], call.get("seq_idx")
        if fast and x.is_cuda and (seq_idx is None or takes_seq_idx):
            if seq_idx is None:
                return wrapper(x, call["weight"], call.get("bias"), activation=call.get("activation"))
            if x.stride(1) != 1:  # the kernel takes seq_idx only with channel-last x
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            return wrapper(x, call["weight"], call.get("bias"), activation=call.get("activation"),
                           seq_idx=seq_idx.to(torch.int32).contiguous())
        if seq_idx is None:
            return torch_function(*args, **kwargs) if fast and not guarded else wrapper(*args, **kwargs)
        return conv1d_by_segment(torch_function, x, call["weight"], call.get("bias"), call.get("activation"),
                                 seq_idx)

    routed.__dflash_routed__ = True
    return routed


def delta_rule_router(wrapper: Callable, torch_function: Callable, implementation: Callable, fast: bool,
                      guarded: bool = False) -> Callable:
    """chunk_gated_delta_rule as the module docstring routes it. `wrapper` is transformers' dispatching
    function, `implementation` the kernel it resolved (its parameters say which arguments it takes);
    `guarded` as for conv1d_router."""
    kernel, reference = inspect.signature(implementation).parameters, inspect.signature(torch_function)
    takes_cu_seqlens = "cu_seqlens" in kernel

    @functools.wraps(wrapper)
    def routed(*args, **kwargs):
        call = _named(reference, args, kwargs)
        cu_seqlens = call.pop("cu_seqlens", None)
        if fast and call["query"].is_cuda and (cu_seqlens is None or takes_cu_seqlens):
            if cu_seqlens is None:
                return wrapper(*args, **kwargs)
            return _varlen_on_one_row(wrapper, _accepted(kernel, call) | {
                n: call[n] for n in ("query", "key", "value")}, cu_seqlens)
        if cu_seqlens is None:
            return torch_function(*args, **kwargs) if fast and not guarded else wrapper(*args, **kwargs)
        return delta_rule_by_segment(torch_function, cu_seqlens=cu_seqlens, **_accepted(reference.parameters, call))

    routed.__dflash_routed__ = True
    return routed


# The kernel functions (by their own name) whose routing knows about packed sequences.
SEGMENT_ROUTERS = {"causal_conv1d_fn": conv1d_router, "chunk_gated_delta_rule": delta_rule_router}
