"""The target layers several drafters read from one target pass: the target taps the union of their layers,
and each drafter sees a TargetView that hands it only its own, in its own order.

    tapped_layers(configs, num_layers, loaded)   {name: layer ids}: each drafter's --target-layer-ids, else
                                                 the layers a run of it alone would tap
    union(layers)                                the ids the one target pass taps (ascending)
    TargetView(target, ids)                      the target as a drafter tapping `ids` sees it: layer_ids,
                                                 context / forward_cached / greedy_next give its columns only

The tapped states of layer l do not depend on which other layers are tapped, so a drafter's columns of the
union's context are the context a run of it alone computes.
"""

from __future__ import annotations

import torch

from dflash.errors import ConfigError


def tapped_layers(configs: dict, num_layers: int, loaded: list[int] | None = None) -> dict[str, list[int]]:
    """Each drafter's tapped layers: its --target-layer-ids, else `loaded` (a target built by the caller, as
    train() takes it), else the target's default layers."""
    from dflash.model.target import check_layer_ids, default_layer_ids

    default = list(loaded) if loaded is not None else default_layer_ids(num_layers, min(5, max(1, num_layers - 3)))
    out = {}
    for name, cfg in configs.items():
        ids = cfg.model.target_layer_ids
        out[name] = check_layer_ids(ids, num_layers) if ids else default
        if loaded is not None and not set(out[name]) <= set(loaded):
            raise ConfigError(f"drafter '{name}' taps target layers {out[name]}, the target was loaded tapping "
                              f"{list(loaded)}; load it tapping every drafter's layers.")
    return out


def union(layers: dict[str, list[int]]) -> list[int]:
    return sorted({i for ids in layers.values() for i in ids})


class TargetView:
    """`target` (tapping a superset of `layer_ids`) as a drafter tapping `layer_ids` sees it."""

    def __init__(self, target, layer_ids: list[int]):
        self._target, self.layer_ids = target, list(layer_ids)
        self._where = [list(target.layer_ids).index(i) for i in self.layer_ids]

    def __getattr__(self, name):
        return getattr(self._target, name)

    def select(self, context: torch.Tensor) -> torch.Tensor:
        """This drafter's columns of the target's [.., k*H] context (a new tensor unless they are all of it)."""
        if self._where == list(range(len(self._target.layer_ids))):
            return context
        h = context.shape[-1] // len(self._target.layer_ids)
        return torch.cat([context[..., p * h:(p + 1) * h] for p in self._where], dim=-1)

    def context(self, input_ids, attention_mask=None, segments=None) -> torch.Tensor:
        return self.select(self._target.context(input_ids, attention_mask, segments=segments))

    def forward_cached(self, input_ids, **cache_kwargs):
        last, context = self._target.forward_cached(input_ids, **cache_kwargs)
        return last, self.select(context)

    def greedy_next(self, input_ids, chunk: int = 1024):
        argmax, context = self._target.greedy_next(input_ids, chunk)
        return argmax, self.select(context)
