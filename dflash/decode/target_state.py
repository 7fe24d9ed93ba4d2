"""The target's caches during speculative decoding, and their exact rollback after a rejected draft.

transformers (5.24, 5.25) builds `DynamicCache(config=...)` with one cache layer per decoder layer:

    attention layer       DynamicLayer           keys, values   [B, kv_heads, T, head_dim]
    GatedDeltaNet layer   LinearAttentionLayer   conv state     [B, conv_dim, kernel]    (last `kernel` inputs)
    (Qwen3.5 hybrids)                            recurrent state [B, v_heads, k_dim, v_dim] (after the last token)

A verify pass feeds [anchor, d1 .. d(bs-1)] and advances every layer over all bs tokens; only the anchor
and the accepted d1..dn may stay. `rollback(keep=n+1)` puts the cache where a pass over exactly those
tokens would have left it:

  attention layers  crop keys/values to the kept length (DynamicLayer.crop drops rows: exact).
  GatedDeltaNet     the recurrent state cannot be cropped: the kernels (fla's and transformers' torch
                    reference alike) return only the state after the LAST token, and the gated delta
                    rule cannot be run backwards. transformers' own `activate_past_recording` crops the
                    conv state but refuses recurrent states (LinearAttentionCacheLayerMixin.is_croppable).
                    So: copy both states before the verify pass; on a rejection restore the copy and
                    re-advance each GatedDeltaNet module over the kept tokens only. A pre-hook keeps
                    each module's input from the verify pass; at the kept positions it is exactly the
                    input a pass over the kept tokens would give (the target is causal, so those
                    positions never saw the rejected tail). The re-advance therefore runs only the
                    GatedDeltaNet modules on n+1 tokens (no MLP, no attention layer, no LM head) and
                    ends in the state a target forward of the kept tokens would leave.

When the whole draft is accepted nothing is rolled back. A target whose cache this module cannot roll
back exactly (sliding-window or other cache layers, a model without a cache argument) gets None from
`TargetCache.create` with the reason; evaluation then runs the exact uncached path and says so.
"""

from __future__ import annotations

import inspect

import torch


class TargetCache:
    """A transformers cache for one sequence of `target`, fed forward and rolled back exactly.

    forward(ids)    run the target over `ids` (list of ints) after the cached tokens; returns
                    ([1,T,H] last hidden after the final norm, [1,T,k*H] tapped context)
    rollback(keep)  keep only the first `keep` tokens of the last forward
    length          tokens the cache holds
    """

    def __init__(self, target, cache, cache_arg: str, linear_modules: dict[int, torch.nn.Module]):
        self.target, self.cache, self.cache_arg = target, cache, cache_arg
        self.linear_modules = linear_modules            # decoder layer index -> its GatedDeltaNet module
        self.length = 0
        self._last_fed = 0
        self._saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._inputs: dict[int, dict] = {}

    # ---- building ---------------------------------------------------------------------------------
    @staticmethod
    def _parts(target):
        """(cache, cache argument name, linear modules) or a string saying why there is no exact cache."""
        from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

        decoder = target.model.get_decoder()
        params = inspect.signature(decoder.forward).parameters
        cache_arg = "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else None
        if cache_arg is None:
            return f"{type(decoder).__name__}.forward takes no cache argument"
        try:
            cache = DynamicCache(config=target.model.config)
        except Exception as exc:  # a config transformers cannot build a cache from
            return f"transformers cannot build a DynamicCache for it ({type(exc).__name__}: {exc})"
        layers = decoder.layers
        if len(cache.layers) != len(layers):
            return f"its cache has {len(cache.layers)} layers for {len(layers)} decoder layers"
        linear = {}
        for i, layer in enumerate(cache.layers):
            if type(layer) is DynamicLayer:
                continue
            if type(layer) is LinearAttentionLayer and isinstance(getattr(layers[i], "linear_attn", None),
                                                                  torch.nn.Module):
                linear[i] = layers[i].linear_attn
                continue
            # e.g. DynamicSlidingWindowLayer: it drops tokens that a rollback would need back.
            return f"layer {i} has a {type(layer).__name__} cache, which cannot be rolled back exactly here"
        return cache, cache_arg, linear

    @classmethod
    def unsupported_reason(cls, target) -> str | None:
        parts = cls._parts(target)
        return parts if isinstance(parts, str) else None

    @classmethod
    def create(cls, target) -> "TargetCache | None":
        """A fresh, empty cache for one sequence, or None when `unsupported_reason(target)` says why not."""
        parts = cls._parts(target)
        return None if isinstance(parts, str) else cls(target, *parts)

    # ---- running ----------------------------------------------------------------------------------
    def forward(self, ids: list[int], rollback_ready: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance the cache over `ids`. rollback_ready: copy the GatedDeltaNet states first and keep
        their inputs, so that `rollback` can cut this pass short (a verify pass needs it, greedy not)."""
        device = self.target.device
        handles = []
        self._saved, self._inputs = {}, {}
        if rollback_ready and self.linear_modules:
            for i in self.linear_modules:
                layer = self.cache.layers[i]
                self._saved[i] = [(layer.conv_states[s].clone(), layer.recurrent_states[s].clone())
                                  for s in range(layer.number_of_states) if layer.is_recurrent_states_initialized[s]]
            handles = [m.register_forward_pre_hook(self._keeper(i), with_kwargs=True)
                       for i, m in self.linear_modules.items()]
        positions = torch.arange(self.length, self.length + len(ids), device=device).unsqueeze(0)
        try:
            last, context = self.target.forward_cached(
                torch.tensor([ids], device=device), position_ids=positions, use_cache=True,
                **{self.cache_arg: self.cache})
        finally:
            for handle in handles:
                handle.remove()
        self.length += len(ids)
        self._last_fed = len(ids)
        return last, context

    def _keeper(self, index: int):
        def hook(_module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self._inputs[index] = {"hidden_states": hidden, "attention_mask": kwargs.get("attention_mask")}
        return hook

    @torch.no_grad()
    def rollback(self, keep: int) -> None:
        """Keep the first `keep` tokens of the last forward, drop the rest (exact; module docstring)."""
        drop = self._last_fed - keep
        if not 0 <= drop <= self._last_fed:
            raise ValueError(f"rollback keeps {keep} of the last forward's {self._last_fed} tokens")
        if drop == 0:
            return
        if self.linear_modules and not self._saved:
            raise RuntimeError("rollback of GatedDeltaNet states needs forward(..., rollback_ready=True)")
        for i, layer in enumerate(self.cache.layers):
            if i not in self.linear_modules:
                layer.crop(-drop)
        for i, module in self.linear_modules.items():
            layer = self.cache.layers[i]
            for s, (conv, recurrent) in enumerate(self._saved[i]):
                layer.conv_states[s].copy_(conv)          # copy_, not assignment: the state keeps its address
                layer.recurrent_states[s].copy_(recurrent)
            if keep:
                kept = self._inputs[i]
                mask = kept["attention_mask"]
                # The module's own cached path: conv over (saved conv state, kept inputs), then the gated
                # delta rule from the saved recurrent state; its output is not needed, only the states.
                module(hidden_states=kept["hidden_states"][:, :keep], cache=self.cache,
                       attention_mask=mask[:, :keep] if isinstance(mask, torch.Tensor) else mask)
        self.length -= drop
        self._last_fed = keep
        self._saved, self._inputs = {}, {}
