"""The demo target: a tiny Qwen3.5-style hybrid that has really learned something.

`dflash-train` with no arguments needs a target that runs on a CPU in seconds, yet behaves like a
language model: a random-weight model repeats one token, which makes any drafter look perfect. So the
demo target is pre-trained briefly on the synthetic chat corpus (dflash.demo.corpus), and its greedy
continuations are varied.

    corpus (10 task templates, ChatML) --> byte-level BPE tokenizer (dflash.demo.tokenizer, with <|mask|>)
                                       --> Qwen3_5ForCausalLM, model_type qwen3_5_text:
                                           GatedDeltaNet layers + full-attention layers (3:1 as in Qwen3.5)
                                       --> pre-train, probe greedy answers, save as an HF directory

The built directory is cached under a name keyed by a hash of every build parameter and written
atomically (built in a temporary sibling, then renamed), so concurrent or interrupted builds never
leave a half-written target where a good one belongs. It loads through `dflash.model.target.Target.load`
like any real model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.fsutil import atomic_write

from dflash.demo import cpu_numerics
from dflash.demo.corpus import corpus_texts, demo_conversations

log = logging.getLogger(__name__)

BUILD_VERSION = 1  # bump whenever the corpus, tokenizer, model shape or recipe changes meaning
RECORD = "demo.json"  # written last: a directory without a matching record is not a finished build


@dataclass(frozen=True)
class DemoSpec:
    """Every parameter of a demo build; its hash names the cache directory."""

    seed: int = 0
    pretrain_steps: int = 240          # optimizer steps of batch_size x seq_len tokens
    corpus_size: int = 8000            # conversations (2-3 exchanges each) in the pre-training corpus
    vocab_size: int = 768              # BPE vocabulary incl. 4 special tokens and 256 bytes
    hidden_size: int = 64              # CPU cost is per token and op, barely per width: 64 learns as
    intermediate_size: int = 192       # well as 96 in the same time here
    num_layers: int = 8                # 6 GatedDeltaNet + 2 full attention with the 3:1 pattern
    full_attention_interval: int = 4   # every 4th layer is full attention, as in Qwen3.5
    seq_len: int = 256                 # packed row length (a multiple of the torch GatedDeltaNet's 64-token chunk)
    batch_size: int = 8                # rows per step
    lr: float = 4e-3                   # AdamW peak; 5% warmup, cosine to 10%
    cpu_kernels: str = "native"        # the CPU kernel paths it was built with (dflash.demo.cpu_numerics.kernels)

    def key(self) -> str:
        blob = json.dumps({"build_version": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_layers)]


def default_demo_dir() -> Path:
    """Where demo targets are cached: $DFLASH_DEMO_CACHE, else ~/.cache/dflash/demo."""
    env = os.environ.get("DFLASH_DEMO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dflash" / "demo"


def read_demo_record(path) -> dict | None:
    """The build record of a finished demo target directory, or None if it is missing or unreadable."""
    try:
        return json.loads((Path(path) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path, spec: DemoSpec) -> bool:
    record = read_demo_record(path)
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return bool(record) and record.get("key") == spec.key() and all((path / f).is_file() for f in files)


def build_demo_target(out_dir=None, *, seed: int = 0, pretrain_steps: int = DemoSpec.pretrain_steps,
                      progress: bool = True) -> Path:
    """Build (or reuse) the demo target under `out_dir` and return its HF model directory.

    The directory is `out_dir/demo-target-<hash of the build parameters>`; an existing complete one
    is reused, an incomplete one rebuilt. `out_dir` defaults to `default_demo_dir()`. The CPU kernel paths
    this process runs (`dflash.demo.cpu_numerics`) are a build parameter: the demo holds them first. Builds take
    about a minute on one CPU core. Under torchrun, build on rank 0 and barrier before the others
    load it (concurrent builds are safe, just wasted work: the first rename wins).
    """
    if pretrain_steps < 0:
        raise ValueError(f"pretrain_steps must be >= 0, got {pretrain_steps}")
    spec = DemoSpec(seed=seed, pretrain_steps=pretrain_steps, cpu_kernels=cpu_numerics.kernels())
    root = Path(out_dir) if out_dir is not None else default_demo_dir()
    final = root / f"demo-target-{spec.key()}"
    if _is_complete(final, spec):
        return final
    if final.exists() and not _is_complete(final, spec):  # re-check: a concurrent build may just have landed
        log.warning("%s is incomplete (no matching %s); rebuilding it", final, RECORD)
        shutil.rmtree(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    threads = torch.get_num_threads()
    # One thread: ops this small gain nothing from more, several threads on a busy machine lose
    # several-fold to oversubscription, and a fixed count keeps float reductions (the build) repeatable.
    torch.set_num_threads(1)
    try:
        _build_into(tmp, spec, progress)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final, spec):  # someone else's rename won only if theirs is complete
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _pack_rows(token_lists: list[list[int]], seq_len: int, pad_id: int, open_rows: int = 32) -> torch.Tensor:
    """Pack whole conversations into rows of `seq_len` tokens -> LongTensor [R, seq_len] (pad_id-filled).

    First fit over the last `open_rows` rows keeps padding to a few percent while every row still
    starts at a conversation boundary, as generation does. A conversation longer than a row is cut.
    """
    rows: list[list[int]] = []
    for ids in token_lists:
        ids = ids[:seq_len]
        row = next((r for r in rows[-open_rows:] if len(r) + len(ids) <= seq_len), None)
        if row is None:
            rows.append(row := [])
        row += ids
    return torch.tensor([r + [pad_id] * (seq_len - len(r)) for r in rows], dtype=torch.long)


def _lr_at(step: int, spec: DemoSpec) -> float:
    warmup = max(1, spec.pretrain_steps // 20)
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.pretrain_steps - warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _new_model(spec: DemoSpec, tokenizer):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, layer_types=spec.layer_types(),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        # GatedDeltaNet layers: 4 key heads and 4 value heads of 16 dims, a width-4 causal conv
        linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, hidden_act="silu", max_position_embeddings=2048,
        # Qwen3.5 rotates a quarter of each head (8 of 32 dims); mrope_section must sum to 8 / 2
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3_5ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _route_kernels(model) -> None:
    # transformers 5.24 sends CPU tensors to fla's Triton kernels when fla is installed (5.25 no longer
    # does); route them to the torch references as the target does (see dflash.model.kernels).
    from dflash.model.kernels import route_kernels_by_device

    route_kernels_by_device(sys.modules[type(model).__module__])


def _pretrain(model, rows: torch.Tensor, spec: DemoSpec, pad_id: int, progress: bool) -> list[float]:
    """Next-token training on packed rows [R, T]; returns the loss of every step."""
    from tqdm.auto import tqdm

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(spec.seed)
    order, cursor, losses = torch.randperm(len(rows), generator=gen), 0, []
    bar = tqdm(range(spec.pretrain_steps), desc="pre-train demo target", unit="step", disable=not progress)
    for step in bar:
        if cursor + spec.batch_size > len(order):
            order, cursor = torch.randperm(len(rows), generator=gen), 0
        batch = rows[order[cursor:cursor + spec.batch_size]]
        cursor += spec.batch_size
        labels = batch.masked_fill(batch == pad_id, -100)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, spec)
        loss = model(input_ids=batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def answer_diversity(answers: list[list[int]]) -> dict:
    """How varied greedy answers are: distinct tokens overall, and the largest share any one token takes."""
    tokens = [t for answer in answers for t in answer]
    top = max(Counter(tokens).values()) if tokens else 0
    return {"tokens": len(tokens), "distinct_tokens": len(set(tokens)),
            "top_token_share": round(top / len(tokens), 3) if tokens else 1.0}


def probe_greedy(model, tokenizer, n_prompts: int = 16, max_new_tokens: int = 48, seed: int = 99) -> dict:
    """Greedy answers to held-out demo prompts: diversity, exact-match rate, and a few samples."""
    from dflash.regenerate.local import generate_replies

    convs = demo_conversations(n_prompts, seed=seed, turns=(1, 1))
    replies, n_cut = generate_replies(model, tokenizer, [c[:1] for c in convs], max_new_tokens)
    answers = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in replies]
    exact = sum(r == c[1]["content"] for r, c in zip(replies, convs))
    return {**answer_diversity(answers), "exact_match": round(exact / len(convs), 3), "cut": n_cut,
            "samples": [[c[0]["content"], r] for c, r in zip(convs[:6], replies)]}


def _build_into(path: Path, spec: DemoSpec, progress: bool) -> None:
    """Build tokenizer + model, pre-train, probe, and save everything (record last) into `path`."""
    from dflash.demo.tokenizer import build_chat_tokenizer

    started, cpu_started = time.monotonic(), time.process_time()
    # the corpus seed is derived, so demo_conversations(n, seed) prompts are not the corpus verbatim
    corpus = demo_conversations(spec.corpus_size, seed=spec.seed + 7919)
    tokenizer = build_chat_tokenizer(corpus_texts(corpus), spec.vocab_size)
    model = _new_model(spec, tokenizer)
    _route_kernels(model)
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in corpus]
    token_lists = tokenizer(texts, add_special_tokens=False)["input_ids"]
    rows = _pack_rows(token_lists, spec.seq_len, tokenizer.pad_token_id)
    losses = _pretrain(model, rows, spec, tokenizer.pad_token_id, progress)
    probe = probe_greedy(model, tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    record = {
        "key": spec.key(), "build_version": BUILD_VERSION, "spec": asdict(spec),
        "params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
        "rows": len(rows), "loss_first": round(losses[0], 4) if losses else None,
        "loss_last10": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
        "probe": probe, "seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    atomic_write(path / RECORD, json.dumps(record, indent=2) + "\n")
    log.info("demo target built in %.0f s: loss %s -> %s, greedy answers use %d distinct tokens",
             record["seconds"], record["loss_first"], record["loss_last10"], probe["distinct_tokens"])

