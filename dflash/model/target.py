"""The frozen target model: any Hugging Face causal LM, run forward only.

The drafter borrows three things from the target and trains nothing in it:

    embed(ids)        the target's embed_tokens          [B,T] -> [B,T,H]
    lm_head(hidden)   the target's output head           [...,H] -> [...,V]
    context(ids)      hidden states of the tapped layers [B,T] -> [B,T,k*H]

Qwen3.5 hybrids (`qwen3_5`, `qwen3_5_text`: GatedDeltaNet linear-attention layers + full-attention
layers) and Qwen3 are first-class; anything `AutoModelForCausalLM` loads with a `.layers` stack works.

The GatedDeltaNet kernels the target's layers dispatch to are read and routed by dflash.model.kernels;
`kernel_report` says which one each function gets.

Packed rows (dflash.model.segments) run through transformers' packed-sequence interface: position ids
restarting per sequence, from which the full-attention layers' mask becomes block-diagonal causal, and the
varlen lengths (cu_seq_lens, max_length), with which those layers run flash attention's varlen kernel on a
GPU (dflash.model.packed_attention), and seq_idx / cu_seqlens, with which the GatedDeltaNet convolution and
delta rule restart at every sequence (dflash.model.segment_kernels).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import torch

from dflash.errors import TargetError
from dflash.model.fp8_checkpoint import check_fp8_target, fp8_precision
from dflash.model.fused_mlp import fuse_mlps
from dflash.model.fused_norms import compile_norms
from dflash.model.kernels import kernel_functions, route_kernels_by_device
from dflash.model.packed_attention import use_packed_attention
from dflash.model.segments import Segments
from dflash.model.tapped_pass import tapped_pass

log = logging.getLogger(__name__)

# Mask tokens of the real model families: used only when the tokenizer declares no
# mask token and the id is a row of the target's embedding.
KNOWN_MASK_TOKEN_IDS = {"qwen3_5": 248070, "qwen3_5_text": 248070, "qwen3": 151669}

# Config keys that define the target's shape; the fingerprint hashes these (weights are not hashed:
# reading 50 GB to name a checkpoint would make every load slow).
_FINGERPRINT_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
)


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """`n` layer ids spread evenly from 1 to num_layers-3 (the upstream DFlash rule).

    Qwen3-8B (36 layers) -> [1, 9, 17, 25, 33]; a 64-layer Qwen3.5-27B -> [1, 16, 31, 46, 61].
    One layer -> [num_layers // 2], but never the last layer where there is another: the serving engines
    cannot tap the last layer (dflash.io.engines), so a 2-layer target taps layer 0.
    """
    if n < 1:
        raise TargetError(f"need at least one tapped layer, got n={n}")
    if n == 1:
        return [min(num_layers // 2, max(0, num_layers - 2))]
    start, end = 1, num_layers - 3
    if end - start + 1 < n:
        raise TargetError(
            f"a {num_layers}-layer target has only {max(0, end - start + 1)} layers in 1..{end} to tap, "
            f"fewer than the {n} requested; ask for n <= {max(1, end - start + 1)} or pass explicit layer ids"
        )
    span = end - start
    return [int(round(start + i * span / (n - 1))) for i in range(n)]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Return `layer_ids` as ints, or raise naming the bad ids and the valid range."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise TargetError("layer_ids is empty; pass at least one layer id, e.g. default_layer_ids(num_layers)")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(
            f"layer ids {bad} do not exist: the target has {num_layers} layers (ids 0..{num_layers - 1}); "
            f"use ids in that range, e.g. {default_layer_ids(num_layers, min(5, max(1, num_layers - 3)))}"
        )
    if len(set(ids)) != len(ids):
        raise TargetError(f"layer ids {ids} repeat a layer; each tapped layer must be distinct")
    return ids


# --------------------------------------------------------------------------------------------------
# Finding the target: a local directory, or a Hub model id
# --------------------------------------------------------------------------------------------------
# What a target needs from a Hub repository: config, tokenizer, chat template and safetensors weights
# (never the .bin/.pt/.gguf copies some repositories also carry).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def resolve_target(name) -> Path:
    """--target as a directory: a local one as it is, or a Hub model id (org/name) resolved from the local
    HF cache ($HF_HUB_CACHE, models--org--name/snapshots/<rev>/), offline, through huggingface_hub's
    local-files-only snapshot lookup; when it is not cached and the network is allowed (HF_HUB_OFFLINE
    unset), downloaded into that cache. The error says which of the two was tried and why each failed."""
    import os

    path = Path(name).expanduser()
    if path.is_dir() or not _looks_like_hub_id(str(name)):
        if not path.is_dir():
            raise TargetError(f"--target {name}: no such directory, and not a Hub model id (org/name); pass the "
                              "local directory with config.json, weights and tokenizer, or a model id like Qwen/Qwen3-8B")
        return path
    from huggingface_hub import constants, snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(str(name), cache_dir=cache, local_files_only=True, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # LocalEntryNotFoundError, or a snapshot missing files
        in_cache = f"the local HF cache {cache} ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    if offline:
        raise TargetError(f"--target {name}: not a local directory and not in {in_cache}; downloading was not "
                          "tried because HF_HUB_OFFLINE is set. Download it where the network allows "
                          f"(huggingface-cli download {name}) into that cache, or pass a local directory")
    try:
        log.info("downloading %s into %s", name, cache)
        return Path(snapshot_download(str(name), cache_dir=cache, allow_patterns=HUB_PATTERNS))
    except Exception as exc:
        raise TargetError(f"--target {name}: not a local directory, not in {in_cache}, and downloading it failed "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check the id, "
                          "the network and HF_TOKEN for gated models, or pass a local directory") from None


# --------------------------------------------------------------------------------------------------
# The target's files, read before its weights
# --------------------------------------------------------------------------------------------------
def read_target_config(path):
    """The target's config (transformers' AutoConfig) of the model directory `path`, with config.json
    checked first: missing, not JSON, not an object, or without "model_type" is a TargetError naming the
    file and the fix (transformers would raise a bare ValueError or OSError from deep inside)."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise TargetError(f"{path} is not a model directory (no config.json); pass the local directory "
                          "that holds config.json, the weights and the tokenizer files")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TargetError(f"{file} is not valid JSON ({type(exc).__name__}: {exc}); the target directory is "
                          "damaged or was copied incompletely: copy or download the model again "
                          "(huggingface-cli download ORG/NAME --local-dir DIR)") from None
    if not isinstance(data, dict):
        raise TargetError(f"{file} holds a JSON {type(data).__name__}, not an object of model settings; copy "
                          "or download the model's config.json again")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise TargetError(f"{file} has no \"model_type\" (it is {model_type!r}), so transformers cannot tell "
                          "which architecture to build; restore the config.json that came with the model, or add "
                          "the key it lacks (e.g. \"model_type\": \"qwen3\" for Qwen3, \"qwen3_5\" for Qwen3.5)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # ValueError, OSError, TypeError, huggingface_hub's StrictDataclassError, ...
        import transformers

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(f"{file} (model_type {model_type!r}) cannot be read by transformers "
                          f"{transformers.__version__}: {first}. If the model is newer than this transformers, "
                          "upgrade it; otherwise restore the model's config.json") from None


def load_target_tokenizer(path):
    """The target's tokenizer from the local directory `path`; a damaged or missing tokenizer is a
    TargetError naming the directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(f"the tokenizer of {path} cannot be loaded ({type(exc).__name__}: {first}); the target "
                          "directory needs the model's tokenizer files (tokenizer.json, tokenizer_config.json): "
                          "copy or download them again") from None


# --------------------------------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------------------------------
def _resolve_mask_token(tokenizer, model_type: str, vocab_rows: int, mask_token) -> int:
    """The mask token's id, from `mask_token` (str or int), the tokenizer, or the family's known id."""
    if isinstance(mask_token, int):
        token_id = mask_token
    elif isinstance(mask_token, str):
        token_id = tokenizer.convert_tokens_to_ids(mask_token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise TargetError(
                f"mask token {mask_token!r} is not in the target's vocabulary; pass an existing token, or "
                f"add it: tok.add_special_tokens({{'mask_token': {mask_token!r}}}); "
                "model.resize_token_embeddings(len(tok)); save both back to the target directory"
            )
    elif tokenizer.mask_token_id is not None:
        token_id = tokenizer.mask_token_id
    elif KNOWN_MASK_TOKEN_IDS.get(model_type, vocab_rows) < vocab_rows:
        token_id = KNOWN_MASK_TOKEN_IDS[model_type]
        log.info("tokenizer declares no mask token; using the %s family's mask id %d", model_type, token_id)
    else:
        raise TargetError(
            "the target's tokenizer has no mask token (tokenizer.mask_token is None); DFlash blocks are "
            "[anchor, MASK x (block_size-1)]. Name a token already in its vocabulary with --mask-token "
            "(e.g. --mask-token '<|MASK|>'; in Python: mask_token='<|MASK|>' or an id), or add one to the "
            "target: tok.add_special_tokens({'mask_token': '<|MASK|>'}); model.resize_token_embeddings(len(tok)); "
            "save both back to the target directory"
        )
    if not 0 <= token_id < vocab_rows:
        raise TargetError(
            f"mask token id {token_id} is outside the target's embedding ({vocab_rows} rows); "
            "resize the target's embeddings to include it (model.resize_token_embeddings(len(tok)))"
        )
    return int(token_id)


def packed_decoder_kwargs(segments: Segments) -> dict:
    """transformers' packed-sequence arguments of a decoder pass over `segments`' rows: positions restarting
    per sequence, the flash-attention varlen lengths over the flattened B*T, seq_idx for the convolution."""
    return {"position_ids": segments.position_ids, "seq_idx": segments.seq_idx,
            "cu_seq_lens_q": segments.cu_seqlens, "cu_seq_lens_k": segments.cu_seqlens,
            "max_length_q": segments.max_seqlen, "max_length_k": segments.max_seqlen}


class Target:
    """A frozen causal LM with tapped layers. Build it with `Target.load(path)`. `precision` says how its
    weights run: the dtype ("bfloat16"), "fp8 (GEMM)" for an FP8 checkpoint on an FP8 GPU, or "fp8 dequantized
    to DTYPE" elsewhere."""

    precision = "as built"

    def __init__(self, model, tokenizer, *, layer_ids: list[int] | None = None, mask_token=None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config()
        self._decoder = model.get_decoder()
        self._layers = self._decoder.layers
        self.num_layers = len(self._layers)
        self.hidden_size = int(self.config.hidden_size)
        self._embed = model.get_input_embeddings()
        self._head = model.get_output_embeddings()
        self.vocab_size = int(self._head.weight.shape[0])
        if layer_ids is None:
            layer_ids = default_layer_ids(self.num_layers, min(5, max(1, self.num_layers - 3)))
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.mask_token_id = _resolve_mask_token(
            tokenizer, self.config.model_type, int(self._embed.weight.shape[0]), mask_token)
        self._modeling_module = sys.modules[type(model).__module__]
        route_kernels_by_device(self._modeling_module)
        use_packed_attention(model)
        compile_norms(model)  # on a GPU: each RMSNorm one kernel (dflash.model.fused_norms)
        fuse_mlps(model)  # on a GPU, FP8: SiLU x up and the down projection's quantisation one kernel

    @classmethod
    def load(cls, path, *, device="cpu", dtype=torch.float32, layer_ids=None, mask_token=None) -> "Target":
        """Load model + tokenizer from a local HF directory or a Hub model id (see `resolve_target`)."""
        from transformers import AutoModelForCausalLM

        path = resolve_target(path)
        read_target_config(path)  # a damaged config.json fails here, before any weight is read
        fp8 = check_fp8_target(path, device)  # an FP8 checkpoint's config and scale tensors, likewise
        tokenizer = load_target_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        precision = fp8_precision(model, device, dtype, fp8) if fp8 else str(dtype).removeprefix("torch.")
        target = cls(model.to(device), tokenizer, layer_ids=layer_ids, mask_token=mask_token)
        target.precision = precision
        return target

    # ---- facts ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the target's architecture, sizes and vocabulary (not its weights).

        Only the text model counts: a Qwen3.5 checkpoint with its vision tower and the same model saved
        text-only get the same fingerprint, so a drafter trained on one is accepted for the other.
        """
        cfg = self.config.to_dict()
        record = {key: cfg.get(key) for key in _FINGERPRINT_KEYS}
        record["embedding_rows"] = self.vocab_size
        blob = json.dumps(record, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def kernel_report(self) -> dict[str, str]:
        """Each GatedDeltaNet kernel function -> "fast" or "fallback" for this target's device ({} if none)."""
        on_cuda = self.device.type == "cuda"
        return {fn.name: "fast" if fn.fast and on_cuda else "fallback"
                for fn in kernel_functions(self._modeling_module)}

    # ---- the frozen pieces the drafter borrows -----------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B,T] token ids -> [B,T,H] embeddings (frozen)."""
        return self._embed(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[...,H] -> [...,V] logits. The target's final norm is NOT applied: the drafter has its own."""
        return self._head(hidden)

    @property
    def head_weight(self) -> torch.Tensor | None:
        """The LM head's [V,H] weight when the head is a bias-free Linear (every Qwen3 and Qwen3.5), else
        None: the training step fuses the head with its loss (dflash.objective.head_loss) only through this weight."""
        plain = isinstance(self._head, torch.nn.Linear) and self._head.bias is None
        return self._head.weight if plain else None

    def _packed_kwargs(self, input_ids, attention_mask, segments: Segments, cache_kwargs: dict) -> dict:
        """The decoder's packed-sequence arguments for `segments`: positions restarting per sequence (the
        full-attention layers' mask becomes block-diagonal causal from them, and RoPE restarts), the
        flash-attention varlen lengths over the flattened B*T, and seq_idx for the convolution."""
        if cache_kwargs:
            raise TargetError("packed segments run without a cache: pass segments to context(), not to a cached pass")
        if attention_mask is not None:
            raise TargetError("pass segments OR attention_mask, not both: a pack's padding is a segment of its own "
                              "and needs no mask, and a 2-D mask would turn off the per-sequence attention mask")
        if tuple(segments.shape) != tuple(input_ids.shape):
            raise TargetError(f"segments describe {tuple(segments.shape)} tokens, input_ids are {tuple(input_ids.shape)}")
        return {**packed_decoder_kwargs(segments.to(input_ids.device)), "use_cache": False}

    def _run(self, input_ids, attention_mask=None, segments: Segments | None = None, last: bool = True,
             **cache_kwargs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One decoder pass: ([B,T,H] last hidden after the final norm, [B,T,k*H] tapped states).
        segments (dflash.model.segments) keep the sequences of packed rows apart; cache_kwargs (none: no
        cache) continue a transformers cache (dflash.decode.target_state builds them). Not both. last=False: the
        pass ends after the last tapped layer and the last hidden is None (dflash.model.tapped_pass)."""
        if segments is not None:
            extra = self._packed_kwargs(input_ids, attention_mask, segments, cache_kwargs)
        else:
            extra = cache_kwargs or {"use_cache": False}
        stop = None if last or cache_kwargs else max(self.layer_ids)
        out, captured = tapped_pass(self._decoder, self._layers, self.layer_ids, stop,
                                    input_ids=input_ids, attention_mask=attention_mask, **extra)
        context = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        return (out.last_hidden_state if out is not None else None), context

    @torch.no_grad()
    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                segments: Segments | None = None) -> torch.Tensor:
        """[B,T] ids (+ [B,T] attention mask, or the Segments of packed rows) -> [B,T,len(layer_ids)*H]: tapped
        layers' outputs, concatenated. With segments every packed sequence's states are those it has alone."""
        return self._run(input_ids, attention_mask, segments, last=False)[1]

    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, **cache_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,T] ids continuing a cache -> ([B,T,H] last hidden after the final norm, [B,T,k*H] context);
        cache_kwargs come from dflash.decode.target_state.TargetCache, which owns the cache and its rollback."""
        return self._run(input_ids, **cache_kwargs)

    @torch.no_grad()
    def greedy_next(self, input_ids: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,T] ids -> ([B,T] argmax next token at every position, [B,T,k*H] context), one pass.

        The head runs over `chunk` positions at a time: a 248K-wide vocabulary times T positions in
        float32 would otherwise be the largest tensor of the whole evaluation.
        """
        last, context = self._run(input_ids)
        argmax = torch.cat([self._head(part).argmax(-1) for part in last.split(chunk, dim=1)], dim=1)
        return argmax, context
