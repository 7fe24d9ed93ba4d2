"""The DFlash drafter training loop: frozen target forward, drafter forward/backward, one optimizer.

Single process:        dflash-train --target DIR --data FILE.jsonl --out runs/x
One process per GPU:   torchrun --nproc-per-node 8 -m dflash.cli train --target DIR --data FILE.jsonl --out runs/x
Two CPU processes:     torchrun --nproc-per-node 2 -m dflash.cli train ... --device cpu   (gloo)

One training step, for a micro-batch of sequences [B,T] with loss mask [B,T]:

    anchors   up to max_anchors positions a per sequence with loss_mask[a] == loss_mask[a+1] == 1
    blocks    [input_ids[a], MASK, MASK, ..., MASK]                      [B, N, bs]
    labels    input_ids[a+1 .. a+bs-1]  (valid: inside the sequence, loss_mask 1)  [B, N, bs-1]
    context   target.context(input_ids)                                  [B, T, k*H]   (no grad)
    hidden    drafter(context, target.embed(blocks), anchors, ...)       [B, N*bs, H]
    loss      dflash_loss_from_hidden: target.lm_head on the scored positions, a chunk of rows at a
              time; CE at block positions 1..bs-1, weighted exp(-(k-1)/gamma)

Every counter is in OPTIMIZER steps (a step = grad_accum micro-batches); the LR schedule uses the same
counter. A micro-batch is global: its sequences are split across ranks, and the loss is normalised by
the loss weight summed over all ranks, so N processes compute the same gradient as one process would
on the whole micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint as ckpt
from . import distributed
from .config import ConfigError, TrainConfig, atomic_write_text
from .doctor.heartbeat import Heartbeat
from .losses import LOSS_CHUNK_ROWS

log = logging.getLogger("dflash.train")


class TrainError(RuntimeError):
    """Training cannot go on (out of memory, no usable data); the message names the knob to turn."""

    exit_code = 4


# --- blocks ----------------------------------------------------------------------------------------
def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A per-sequence seed: the anchors of a sequence depend only on (seed, epoch, its index), never on
    which rank or micro-batch it lands in, so resumed and multi-process runs sample the same anchors."""
    return (seed * 1_000_003 + epoch * 7_919 + sample_index * 104_729) % (2**63 - 1)


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """[T] loss mask of one (unpadded) sequence -> sorted [n] anchor positions, n <= max_anchors.

    An anchor a needs loss_mask[a] == 1 and a+1 < T; we also require loss_mask[a+1] == 1, since an
    anchor whose first label is unsupervised adds a whole block of compute and no signal.
    """
    m = loss_mask.bool()
    candidates = torch.nonzero(m[:-1] & m[1:]).flatten()
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        candidates = candidates[pick.sort().values]
    return candidates


@dataclass
class Blocks:
    """The drafter's inputs for one micro-batch (N = most anchors of any sequence in it)."""

    anchors: torch.Tensor       # [B,N] long, 0 where padded
    anchor_valid: torch.Tensor  # [B,N] bool
    block_ids: torch.Tensor     # [B,N,bs] long: [anchor token, MASK x (bs-1)]
    labels: torch.Tensor        # [B,N,bs-1] long: input_ids[a+1 .. a+bs-1] (0 where out of range)
    label_valid: torch.Tensor   # [B,N,bs-1] bool


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: list[torch.Tensor],
                 block_size: int, mask_token_id: int) -> Blocks:
    """input_ids, loss_mask [B,T] (right-padded, loss_mask 0 on padding) + per-row anchors -> Blocks.

    A batch whose rows have no anchor at all still gets N = 1 (an invalid anchor at 0) so the drafter
    runs and DDP sees every parameter in the backward pass.
    """
    B, T = input_ids.shape
    N = max(1, max(int(a.numel()) for a in anchors))
    anchor_t = torch.zeros(B, N, dtype=torch.long)
    anchor_valid = torch.zeros(B, N, dtype=torch.bool)
    for b, a in enumerate(anchors):
        anchor_t[b, : a.numel()] = a
        anchor_valid[b, : a.numel()] = True
    anchor_t, anchor_valid = anchor_t.to(input_ids.device), anchor_valid.to(input_ids.device)
    offsets = torch.arange(1, block_size, device=input_ids.device)
    pos = anchor_t.unsqueeze(-1) + offsets                       # [B,N,bs-1]
    in_range = pos < T
    pos = pos.clamp(max=T - 1)
    flat = pos.view(B, -1)
    labels = torch.gather(input_ids, 1, flat).view_as(pos)
    supervised = torch.gather(loss_mask, 1, flat).view_as(pos).bool()
    label_valid = in_range & supervised & anchor_valid.unsqueeze(-1)
    block_ids = torch.full((B, N, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchor_t)
    return Blocks(anchor_t, anchor_valid, block_ids, labels.masked_fill(~label_valid, 0), label_valid)


# --- learning-rate schedule ------------------------------------------------------------------------
def lr_lambda(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """Factor of the peak LR at optimizer step s: linear warm-up over ceil(ratio*total), then cosine to 0."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


# --- stopping on signals ---------------------------------------------------------------------------
class StopFlag:
    """Set by SIGTERM/SIGINT (or by a caller); the loop finishes the current step, checkpoints, exits."""

    def __init__(self):
        self.reason: str | None = None
        self._previous: dict = {}

    def request(self, reason: str = "request") -> None:
        self.reason = self.reason or reason

    def __bool__(self) -> bool:
        return self.reason is not None

    def install(self) -> "StopFlag":
        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if self.reason and signum == signal.SIGINT:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.request(name)
            log.warning("%s received: finishing the current step, then writing a checkpoint", name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                pass
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        return 130 if self.reason == "SIGINT" else 0


# --- the run ---------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    drafter: torch.nn.Module          # the bare drafter (not the DDP wrapper)
    step: int                         # optimizer steps done
    history: list[dict] = field(default_factory=list)  # one record per optimizer step (rank 0 view)
    checkpoint: Path | None = None
    stopped_by: str | None = None     # "SIGTERM", "SIGINT", "request" or None (ran to the end)
    exit_code: int = 0


def data_fingerprint(items: list[dict]) -> str:
    """16 hex digits over every sequence's tokens and loss mask: resume refuses changed data."""
    h = hashlib.sha256()
    for item in items:
        h.update(item["input_ids"].to(torch.int64).numpy().tobytes())
        h.update(item["loss_mask"].to(torch.int8).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


class _DataOrder:
    """Walks the length-bucketed micro-batches epoch after epoch; its position is checkpointed."""

    def __init__(self, lengths: list[int], config: TrainConfig, epoch: int = 0, index: int = 0):
        from .data import make_batches

        self._make = lambda e: make_batches(lengths, config.max_tokens, config.batch_size, config.seed, e)
        self.epoch, self.index = epoch, index
        self._batches = self._make(epoch)
        if not self._batches:
            raise TrainError("the data gives no micro-batch; check --max-tokens and --batch-size")

    @property
    def batches_per_epoch(self) -> int:
        return len(self._batches)

    def next(self) -> tuple[int, list[int]]:
        """(epoch, sample indices of the next global micro-batch)."""
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self._make(self.epoch)
        batch = self._batches[self.index]
        self.index += 1
        return self.epoch, list(batch)

    def state(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.index}


FLEX_MIN_HEAD_DIM = 16  # flex_attention's compiled kernels refuse narrower heads


def attention_impl(config: TrainConfig, device: torch.device, head_dim: int | None = None) -> str:
    """--attention resolved for `device`: 'auto' is flex on a GPU (compiled kernels), sdpa elsewhere
    and for heads narrower than flex's kernels take."""
    if config.attention == "flex" and device.type != "cuda":
        raise ConfigError(f"--attention flex needs a GPU: flex_attention has no backward on {device.type}; "
                          "use --attention sdpa (or auto, which picks sdpa there).")
    if config.attention == "flex" and head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM:
        raise ConfigError(f"--attention flex needs head_dim >= {FLEX_MIN_HEAD_DIM} (flex_attention's kernels), but "
                          f"the drafter's heads are {head_dim} wide; use --attention sdpa (or auto).")
    if config.attention != "auto":
        return config.attention
    wide_enough = head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if device.type == "cuda" and wide_enough else "sdpa"


def _precision(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if config.precision == "bf16" else torch.float32


def _oom_message(config: TrainConfig, shape: tuple[int, int], n_anchors: int, vocab: int) -> str:
    B, T = shape
    return (
        f"out of memory on a micro-batch of {B} x {T} tokens with {n_anchors} anchors x block "
        f"{config.block_size} ({n_anchors * config.block_size} drafter positions; logits over {vocab} tokens "
        f"are taken {LOSS_CHUNK_ROWS} rows at a time). "
        f"Lower --max-anchors (now {config.max_anchors}), --max-tokens (now {config.max_tokens}), "
        f"--batch-size (now {config.batch_size}) or --max-length (now {config.max_length}); "
        "raise --grad-accum to keep the same tokens per optimizer step."
    )


class Trainer:
    """Holds the run's pieces; `run()` trains and returns a TrainResult. Build it with `train()`."""

    def __init__(self, config: TrainConfig, target, items: list[dict], d: distributed.Dist,
                 stop: StopFlag, on_step: Callable[[int, dict], None] | None = None):
        from .losses import position_weights
        from .model import Drafter, DrafterConfig

        self.config, self.target, self.items, self.d, self.stop = config, target, items, d, stop
        self.on_step = on_step
        self.root = config.out_dir / "checkpoints"
        self.pad_id = _pad_id(target)
        self.autocast_dtype = _precision(config, d.device)
        overrides = dict(num_layers=config.drafter_layers, block_size=config.block_size)
        self.drafter_config = DrafterConfig.from_target(target, **overrides)
        torch.manual_seed(config.seed)  # the same initial drafter on every rank and on every rerun
        attention = attention_impl(config, d.device, self.drafter_config.head_dim)
        self.drafter = Drafter(self.drafter_config, attention=attention).to(d.device)
        self.model = DDP(self.drafter, device_ids=[d.device.index] if d.device.type == "cuda" else None) \
            if d.enabled else self.drafter
        self.weights = position_weights(config.block_size, config.gamma).to(d.device)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay,
                                           fused=d.device.type == "cuda")
        self.fingerprint = data_fingerprint(items)
        self.order = _DataOrder([len(it["input_ids"]) for it in items], config)
        self.total_steps = config.max_steps or config.epochs * math.ceil(self.order.batches_per_epoch
                                                                         / config.grad_accum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, config.warmup_ratio))
        self.step = 0
        self.heartbeat = Heartbeat(every=config.heartbeat_every) if d.is_main else None

    # --- resume ------------------------------------------------------------------------------------
    def restore(self) -> Path | None:
        """Load the latest checkpoint of --out (when --resume); refuse one that does not fit."""
        last = ckpt.latest_checkpoint(self.root)
        if last is None:
            raise ckpt.CheckpointError(
                f"--resume: no checkpoint in {self.root}. Drop --resume to start a new run there.")
        ckpt.check_compatible(last, self.drafter_config.to_dict(), self.fingerprint)
        from safetensors.torch import load_file

        self.drafter.load_state_dict(load_file(last / "drafter" / "model.safetensors", device=str(self.d.device)))
        state = ckpt.load_state(last, map_location=self.d.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.restore_rng(_cpu_rng(state["rng"]))
        self.step = int(state["step"])
        self.order = _DataOrder([len(it["input_ids"]) for it in self.items], self.config,
                                epoch=int(state["epoch"]), index=int(state["batch_index"]))
        log.info("resumed from %s at step %d (epoch %d, micro-batch %d)", last, self.step,
                 self.order.epoch, self.order.index)
        return last

    def save(self) -> Path | None:
        path = None
        if self.d.is_main:
            path = ckpt.save_checkpoint(
                self.root, step=self.step, drafter=self.drafter, optimizer=self.optimizer,
                scheduler=self.scheduler, config=self.config, keep=self.config.keep_checkpoints,
                train_state={**self.order.state(), "data_fingerprint": self.fingerprint,
                             "world_size": self.d.world_size},
            )
            log.info("checkpoint %s", path)
        distributed.barrier(self.d)
        return path

    # --- one micro-batch ---------------------------------------------------------------------------
    def _collate_shard(self, epoch: int, indices: list[int]) -> tuple[dict, list[torch.Tensor]]:
        """This rank's share of a global micro-batch, collated, with each sequence's anchors."""
        from .data import collate

        mine = distributed.shard(indices, self.d)
        stand_in = not mine
        if stand_in:  # fewer sequences than ranks: a zero-weight copy keeps this rank in the backward
            mine = indices[:1]
        items = [self.items[i] for i in mine]
        if stand_in:
            items = [{**items[0], "loss_mask": torch.zeros_like(items[0]["loss_mask"])}]
        anchors = []
        for i, item in zip(mine, items):
            g = torch.Generator().manual_seed(anchor_seed(self.config.seed, epoch, i))
            anchors.append(sample_anchors(item["loss_mask"], self.config.max_anchors, g))
        batch = collate(items, self.pad_id)
        return {k: v.to(self.d.device) for k, v in batch.items()}, anchors

    def _micro_step(self, batch: dict, anchors: list[torch.Tensor], accum: int, sync: bool) -> dict:
        """Forward + backward of one micro-batch; returns summed (not averaged) statistics."""
        from .losses import dflash_loss_from_hidden

        cfg, target = self.config, self.target
        ids, loss_mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        blocks = build_blocks(ids, loss_mask * attn, anchors, cfg.block_size, target.mask_token_id)
        B, N = blocks.anchors.shape
        context = target.context(ids, attn)
        with torch.no_grad():
            block_embeds = target.embed(blocks.block_ids.view(B, N * cfg.block_size))
        # The denominator is the loss weight of ALL ranks: then DDP's gradient average equals the
        # gradient of one process over the whole micro-batch.
        local_w = (blocks.label_valid.float() * self.weights).sum()
        global_w = distributed.all_reduce_sum(self.d, local_w.detach().clone())
        ctx = nullcontext() if sync or not self.d.enabled else self.model.no_sync()
        amp = torch.autocast(self.d.device.type, dtype=self.autocast_dtype,
                             enabled=self.autocast_dtype != torch.float32)
        with ctx:
            with amp:
                hidden = self.model(context, block_embeds,
                                    blocks.anchors, attn.bool(), blocks.anchor_valid)
                # The LM head runs on the scored positions only, a chunk at a time (never the full
                # [anchors x block x vocab] logits).
                loss, stats = dflash_loss_from_hidden(hidden.view(B, N, cfg.block_size, -1), target.lm_head,
                                                      blocks.labels, blocks.label_valid, cfg.gamma)
            loss_sum = loss * local_w  # dflash_loss averages over this rank's weight; undo that
            scale = self.d.world_size / (global_w.clamp(min=1e-12) * accum)
            (loss_sum * scale).backward()
        valid = blocks.label_valid.sum((0, 1)).float()
        correct = (stats["acc_per_pos"].to(valid.device) * valid).round()  # counts, to sum over ranks
        return {"loss_sum": loss_sum.detach(), "weight": local_w.detach(), "correct": correct, "valid": valid,
                "tokens": attn.sum().float(), "anchors": blocks.anchor_valid.sum().float()}

    def _optimizer_step(self) -> dict:
        """grad_accum micro-batches, clip, AdamW step, LR step; returns the step's metrics (all ranks)."""
        cfg = self.config
        totals: dict[str, torch.Tensor] = {}
        for k in range(cfg.grad_accum):
            epoch, indices = self.order.next()
            batch, anchors = self._collate_shard(epoch, indices)
            try:
                stats = self._micro_step(batch, anchors, cfg.grad_accum, sync=k == cfg.grad_accum - 1)
            except torch.OutOfMemoryError as exc:
                n = sum(int(a.numel()) for a in anchors)
                raise TrainError(_oom_message(cfg, tuple(batch["input_ids"].shape), n,
                                              self.target.vocab_size)) from exc
            for key, value in stats.items():
                totals[key] = totals.get(key, 0) + value
            if self.heartbeat:
                self.heartbeat.beat(self.step)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip) \
            if cfg.grad_clip > 0 else torch.tensor(float("nan"))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        packed = torch.cat([totals["loss_sum"].view(1), totals["weight"].view(1), totals["correct"],
                            totals["valid"], totals["tokens"].view(1), totals["anchors"].view(1)])
        packed = distributed.all_reduce_sum(self.d, packed)
        k = cfg.block_size - 1
        correct, valid = packed[2:2 + k], packed[2 + k:2 + 2 * k]
        return {
            "step": self.step, "lr": lr, "grad_norm": float(grad_norm),
            "loss": float(packed[0] / packed[1].clamp(min=1e-12)),
            "acc": float(correct.sum() / valid.sum().clamp(min=1)),
            "acc_per_pos": [round(float(x), 4) for x in correct / valid.clamp(min=1)],
            "tokens": int(packed[-2]), "anchors": int(packed[-1]),
        }

    # --- the loop ----------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        from tqdm.contrib.logging import logging_redirect_tqdm

        # log lines go through tqdm.write so that they do not tear the progress bar
        with logging_redirect_tqdm(loggers=[logging.getLogger("dflash")]):
            return self._run()

    def _run(self) -> TrainResult:
        from tqdm.auto import tqdm

        cfg, d = self.config, self.d
        result = TrainResult(drafter=self.drafter, step=self.step)
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not (cfg.progress and d.is_main), dynamic_ncols=True)
        metrics_path = cfg.out_dir / "metrics.jsonl"
        window_tokens, window_start = 0, time.perf_counter()
        self.drafter.train()
        if self.heartbeat:
            self.heartbeat.beat(self.step, force=True)
        while self.step < self.total_steps:
            m = self._optimizer_step()
            window_tokens += m["tokens"]
            elapsed = time.perf_counter() - window_start
            m["tokens_per_s"] = round(window_tokens / max(elapsed, 1e-9), 1)
            result.history.append(m)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
            if d.is_main:
                with open(metrics_path, "a") as fh:
                    fh.write(json.dumps(m) + "\n")
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    log.info("step %d/%d loss %.4f acc %.3f lr %.2e tok/s %.0f acc/pos %s", self.step,
                             self.total_steps, m["loss"], m["acc"], m["lr"], m["tokens_per_s"],
                             " ".join(f"{a:.2f}" for a in m["acc_per_pos"]))
                    window_tokens, window_start = 0, time.perf_counter()
            if self.on_step and self.on_step(self.step, m):
                self.stop.request("request")
            if distributed.any_rank(d, bool(self.stop)):
                result.stopped_by = self.stop.reason or "another rank"
                break
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total_steps:
                result.checkpoint = self.save()
        bar.close()
        result.checkpoint = self.save()
        if self.heartbeat:
            self.heartbeat.finish(self.step)
        result.step = self.step
        result.exit_code = self.stop.exit_code if result.stopped_by else 0
        if result.stopped_by:
            log.warning("stopped by %s at step %d; continue with --resume", result.stopped_by, self.step)
        elif d.is_main:
            ckpt.export_drafter(result.checkpoint, cfg.out_dir / "drafter")
            log.info("drafter written to %s", cfg.out_dir / "drafter")
        return result


def _pad_id(target) -> int:
    tok = target.tokenizer
    for value in (tok.pad_token_id, tok.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def _cpu_rng(state: dict) -> dict:
    """RNG states must be CPU ByteTensors for torch.set_rng_state, whatever map_location did."""
    out = dict(state)
    out["torch"] = state["torch"].cpu()
    if "cuda" in state:
        out["cuda"] = [s.cpu() for s in state["cuda"]]
    return out


def setup_logging(out_dir: Path, is_main: bool) -> None:
    """Log to stderr and to <out>/train.log (rank 0 only; other ranks only warn)."""
    logger = logging.getLogger("dflash")
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    for h in list(logger.handlers):
        if getattr(h, "_dflash", False):
            logger.removeHandler(h)
            h.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler()]
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(out_dir / "train.log"))
    for h in handlers:
        h.setFormatter(fmt)
        h._dflash = True
        logger.addHandler(h)
    logger.propagate = False


def load_items(config: TrainConfig, target) -> list[dict]:
    """Read --data, tokenize with the target's chat template, drop samples too short to supervise."""
    from .data import ChatDataset, load_chat_jsonl

    conversations, report = load_chat_jsonl(config.data, on_error=config.on_bad_line)
    log.info("data %s: %s", config.data, report)
    return dataset_items(ChatDataset(conversations, target.tokenizer, max_length=config.max_length,
                                     block_size=config.block_size))


def dataset_items(dataset) -> list[dict]:
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        raise TrainError(f"no usable training sample ({getattr(dataset, 'report', '')}); each needs at "
                         "least 2 x --block-size supervised (assistant) tokens. Check --data and --max-length.")
    return items


def target_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    """The frozen target runs in bf16 when training uses bf16 autocast (its forward is most of the
    cost on a GPU), else in fp32."""
    return _precision(config, device)


def load_target(config: TrainConfig, device: torch.device, path=None):
    from .target import Target

    return Target.load(path or config.target, device=device, dtype=target_dtype(config, device),
                       layer_ids=config.target_layer_ids, mask_token=config.mask_token)


def train(config: TrainConfig, *, target=None, items: list[dict] | None = None,
          on_step: Callable[[int, dict], None] | None = None, handle_signals: bool = True) -> TrainResult:
    """Train a drafter as `config` says; returns when done, stopped by a signal, or on an error.

    `target` and `items` (dicts with input_ids/loss_mask LongTensor[T]) skip loading them from
    config.target / config.data. `on_step(step, metrics)` runs after every optimizer step; when it
    returns True the run stops as if it got SIGTERM (checkpoint, then return).
    """
    d = distributed.init(config.device, cpu_threads=config.cpu_threads)
    setup_logging(config.out_dir, d.is_main)
    stop = StopFlag().install() if handle_signals else StopFlag()
    try:
        attention_impl(config, d.device)  # a bad --attention fails before the target loads
        if target is None:
            target = load_target(config, d.device)
        if items is None:
            items = load_items(config, target)
        if d.is_main:
            config.to_json(config.out_dir / "config.json")
        trainer = Trainer(config, target, items, d, stop, on_step)
        if config.resume:
            trainer.restore()
        log.info("training %d steps on %d sequences, world size %d, device %s, %s, %s attention",
                 trainer.total_steps, len(items), d.world_size, d.device, trainer.autocast_dtype,
                 trainer.drafter.attention)
        return trainer.run()
    finally:
        stop.uninstall()
