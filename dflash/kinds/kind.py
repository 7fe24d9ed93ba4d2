"""What a drafter kind is: everything that differs between kinds, declared once, so that the rest of the
code asks a kind instead of branching on one.

A kind declares
    config_class, model_class     its config (a DrafterConfig) and the module it builds
    objective                     its training loss over a micro-batch's blocks, as sums
    propose                       its proposal of one block at decode time
    architecture, model_file,     its on-disk layout: config.json's architecture, the self-contained model
    remote_code, own_keys,        file written beside the weights, the dflash_config keys it adds to
    read_keys                     DFlash's, and how to read them back
and the planner counts its parameters by building its model on the meta device (dflash.plan.sizes).
dflash.kinds holds the registry; a new kind is one folder beside dflash.kinds.dflash and one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import ConfigError
from dflash.model.drafter import FULL, SLIDING, Drafter, DrafterConfig


@dataclass(frozen=True)
class DrafterKind:
    name: str                     # what --drafter-kind takes
    title: str                    # how logs and reports name it
    summary: str                  # one line for --help
    config_class: type[DrafterConfig]
    model_class: type[Drafter]
    architecture: str             # config.json "architectures"; vLLM and SGLang pick their model class by it
    model_file: str               # the remote-code module written beside the weights (auto_map names it)
    remote_code: Path             # that module's source
    own_keys: tuple[str, ...]     # dflash_config keys beyond DFlash's target_layer_ids and mask_token_id
    read_keys: Callable[[dict, Path], dict]  # (dflash_config, config.json path) -> own config fields
    # (drafter, hidden [B,N,bs,H], lm_head, head weight or None, blocks, gamma, **options)
    #   -> (loss_sum [] with a graph, weight [], correct [B,N,bs-1] bool)
    objective: Callable
    options: tuple[str, ...]      # the model options (--flags, as ModelConfig fields) its objective takes
    # (drafter, hidden [1,bs,H], anchor token id, target, sampler) -> (tokens [bs-1], q [bs-1,V] or None)
    propose: Callable
    # bytes per drafter layer x block row x hidden its layers keep for the backward beyond DFlash's, which the
    # memory model's c_layer was fitted on (dflash.plan.memory); a test measures the surplus on the CPU
    layer_activation_surplus: float = 0.0

    @property
    def auto_map(self) -> dict:
        return {"AutoModel": f"{Path(self.model_file).stem}.{self.architecture}"}

    def remote_code_source(self) -> str:
        return self.remote_code.read_text()

    def build(self, config: DrafterConfig, attention: str = "sdpa") -> Drafter:
        return self.model_class(config, attention)

    def new_config(self, target, layers: int, block_size: int, sliding_window: int = 0, **fields) -> DrafterConfig:
        """A new config of this kind shaped like `target` (DrafterConfig.from_target): `layers` layers, all
        but the last sliding_attention when `sliding_window` > 0; or a ConfigError naming what misfits."""
        types = [SLIDING] * (layers - 1) + [FULL] if sliding_window else []
        try:
            return self.config_class.from_target(target, num_hidden_layers=layers, block_size=block_size,
                                                 layer_types=types, sliding_window=sliding_window or None, **fields)
        except ValueError as exc:
            raise ConfigError(f"--drafter-kind {self.name} cannot be shaped like this target: {exc}") from None

    def write_keys(self, config: DrafterConfig) -> dict:
        """This kind's own dflash_config keys of `config` (None where a key is off: every reader takes null as off)."""
        return {k: getattr(config, k) for k in self.own_keys}

    def objective_options(self, model_options) -> dict:
        """The options its objective takes, read from a ModelConfig (or anything with those fields)."""
        return {k: getattr(model_options, k) for k in self.options}
