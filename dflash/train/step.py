"""One training step of the drafter on one micro-batch: the code the trainer runs and bench_train times.

For a micro-batch of sequences [B,T] with loss mask [B,T] (this rank's share of a global micro-batch):

    blocks    build_blocks(input_ids, loss_mask * attention_mask, anchors)      (see dflash.train.blocks)
    context   target.context(input_ids)                                  [B, T, k*H]   (no grad)
    embeds    target.embed(blocks)                                       [B, N*bs, H]  (no grad)
    hidden    drafter(context, embeds, anchors, ...)                     [B, N*bs, H]
    loss sum  target.lm_head on the scored positions fused with the CE at block positions 1..bs-1,
              weighted exp(-(k-1)/gamma), summed (not averaged): dflash.objective.head_loss (one product for the
              logits, one for the rows' gradient, a chunk of rows at a time)

`micro_batch_sums` returns sums, so micro-batches and ranks add up exactly; `backward` divides by the
loss weight summed over ALL ranks (one all-reduce), so N processes compute the gradient one process
would compute on the whole global micro-batch. The statistics stay on the device until the trainer
logs them; the one value read back in a step is the count of scored rows (dflash.objective.head_loss gathers them).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from dflash import distributed
from dflash.kinds import kind_of
from dflash.objective.losses import LOSS_CHUNK_ROWS
from dflash.train.blocks import build_blocks


@dataclass
class StepSums:
    """What one micro-batch adds to an optimizer step; tensors on the device, summed (never averaged)."""

    loss_sum: torch.Tensor  # [] float32: sum of w_k * CE over the valid labels (has the graph)
    weight: torch.Tensor    # [] float32: sum of w_k over the valid labels (loss = loss_sum / weight)
    correct: torch.Tensor   # [bs-1] float32: correct top-1 guesses per block position
    valid: torch.Tensor     # [bs-1] float32: valid labels per block position
    tokens: torch.Tensor    # [] float32: real (unpadded) tokens of the micro-batch
    anchors: torch.Tensor   # [] float32: valid anchors (blocks) of the micro-batch
    accepted: torch.Tensor  # [bs-1] float32: blocks whose positions 1..k are all valid and correct
    reached: torch.Tensor   # [bs-1] float32: blocks whose positions 1..k-1 are correct and k is valid
    block_correct: torch.Tensor | None = None  # [B,N,bs-1] bool, per block (only with keep_correct=True)

    def detached(self) -> "StepSums":
        return StepSums(*(t.detach() for t in (self.loss_sum, self.weight, self.correct, self.valid,
                                               self.tokens, self.anchors, self.accepted, self.reached)))

    def pack(self) -> torch.Tensor:
        """[4 + 4 x (bs-1)] float32, detached: the sums in one tensor, to add up and all-reduce at once."""
        return torch.cat([self.loss_sum.detach().view(1), self.weight.view(1), self.correct, self.valid,
                          self.tokens.view(1), self.anchors.view(1), self.accepted, self.reached]).float()


def acceptance_sums(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([bs-1] accepted, [bs-1] reached) from [B,N,bs-1] masks: what greedy verification would accept.

    A block "reaches" position k when positions 1..k-1 are all correct (verification got that far) and k
    has a label; it "accepts" k when k is correct too. accepted_k / reached_k estimates
    a_k = P(position k correct | positions 1..k-1 correct), the per-position acceptance rate.
    """
    correct, valid = correct.bool() & valid.bool(), valid.bool()
    upto = correct.long().cumprod(dim=-1)                                       # 1 while all so far correct
    before = torch.cat([torch.ones_like(upto[..., :1]), upto[..., :-1]], dim=-1)
    return upto.sum((0, 1)).float(), (before * valid.long()).sum((0, 1)).float()


def summarize(totals: torch.Tensor, block_size: int, grad_norm: torch.Tensor | None = None) -> dict:
    """Metrics of packed sums (StepSums.pack, added up over micro-batches and ranks); one read-back.

    loss (weighted CE), acc and acc_per_pos (top-1 accuracy per block position 1..bs-1) and
    accept_per_pos (a_k above). No tau: these blocks sit at sampled anchors, decoding's where the last
    step stopped, and no formula of these rates bounds decoding's tau (dflash.train.evaluation says why and
    what measures it). `grad_norm` ([], optional) is read back with the rest.
    """
    k = block_size - 1
    loss_sum, weight = totals[0], totals[1]
    correct, valid = totals[2:2 + k], totals[2 + k:2 + 2 * k]
    tokens, anchors = totals[2 + 2 * k], totals[3 + 2 * k]
    accepted, reached = totals[4 + 2 * k:4 + 3 * k], totals[4 + 3 * k:4 + 4 * k]
    accept = accepted / reached.clamp(min=1)
    norm = totals.new_full((), float("nan")) if grad_norm is None else grad_norm.detach().to(totals)
    head = torch.stack([loss_sum / weight.clamp(min=1e-12), correct.sum() / valid.sum().clamp(min=1),
                        tokens, anchors, norm.reshape(())])
    loss, acc, tokens, anchors, norm, *rest = torch.cat([head, correct / valid.clamp(min=1), accept]).tolist()
    out = {"loss": loss, "acc": acc, "acc_per_pos": [round(x, 4) for x in rest[:k]],
           "accept_per_pos": [round(x, 4) for x in rest[k:]], "tokens": int(tokens), "anchors": int(anchors)}
    return out if grad_norm is None else {"grad_norm": norm, **out}


def micro_batch_sums(drafter, target, batch: dict[str, torch.Tensor], anchors: list[torch.Tensor], *,
                     block_size: int, gamma: float | None, autocast_dtype: torch.dtype,
                     mark: Callable[[str], None] | None = None, keep_correct: bool = False,
                     fused_head: bool = True, context: torch.Tensor | None = None,
                     objective_options: dict | None = None, n_anchors: int | None = None) -> StepSums:
    """The forward pass of one micro-batch: frozen target, drafter, LM head and loss, as sums.

    batch: input_ids, loss_mask, attention_mask [B,T] on the device (dflash.data.batches.collate), or packed rows
    with their "segments" too (dflash.data.packs.collate_pack: the target, the blocks and the drafter keep
    each sequence to itself); anchors: one sorted [n_b] position tensor per row (dflash.batching.anchors), `n_anchors`
    the fixed anchor count a batching brings every micro-batch to (Batching.n_anchors). `drafter` may be the DDP
    wrapper. `mark(phase)` is called after "target forward" and after "drafter forward" (a benchmark
    synchronises and reads its clock there; training passes None). keep_correct also returns the
    per-block correct mask (dflash.train.evaluation's replay of greedy verification). fused_head=False (or a
    head that is no bias-free Linear) takes losses.weighted_ce_from_hidden instead: the same loss with
    checkpointed chunks (bench/bench_drafter.py's "before"). `context` is target.context(input_ids,
    attention_mask) when the caller already ran it (several drafters on one target pass: dflash.train.multi).
    The loss is the drafter kind's objective (dflash.kinds); `objective_options` are the model options it
    takes (DrafterKind.objective_options: DFlash2's selector_missing picks the published variant).
    """
    ids, loss_mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    segments = batch.get("segments")
    blocks = build_blocks(ids, loss_mask * attn, anchors, block_size, target.mask_token_id, n_anchors=n_anchors,
                          seq_idx=None if segments is None else segments.seq_idx)
    B, N = blocks.anchors.shape
    if context is None:  # a packed row's padding tail is a segment of its own: no mask needed
        context = target.context(ids, attn) if segments is None else target.context(ids, segments=segments)
    kept_apart = {} if segments is None else {"segments": segments}
    with torch.no_grad():
        block_embeds = target.embed(blocks.block_ids.view(B, N * block_size))
    if mark:
        mark("target forward")
    amp = torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32)
    with amp:
        hidden = drafter(context, block_embeds, blocks.anchors, attn.bool(), blocks.anchor_valid, **kept_apart)
        # The LM head runs on the scored positions only, a chunk at a time (never the full
        # [anchors x block x vocab] logits).
        hidden = hidden.view(B, N, block_size, -1)
        head_weight = target.head_weight if fused_head else None
        inner = getattr(drafter, "module", drafter)  # under DDP
        loss_sum, weight, correct = kind_of(inner).objective(inner, hidden, target.lm_head, head_weight, blocks, gamma,
                                                             **(objective_options or {}))
    if mark:
        mark("drafter forward")
    accepted, reached = acceptance_sums(correct, blocks.label_valid)
    return StepSums(loss_sum=loss_sum, weight=weight, correct=correct.sum((0, 1)).float(),
                    valid=blocks.label_valid.sum((0, 1)).float(), tokens=attn.sum().float(),
                    anchors=blocks.anchor_valid.sum().float(), accepted=accepted, reached=reached,
                    block_correct=correct.bool() if keep_correct else None)


def backward(sums: StepSums, d: distributed.Dist, grad_accum: int) -> None:
    """Backward of loss_sum / (loss weight of all ranks x grad_accum), times world size (DDP averages
    gradients over ranks): the gradient of one process over the whole global micro-batch.

    Under DDP, the forward and this backward of a micro-batch that only accumulates run inside
    `ddp.no_sync()` (the caller's; DDP reads the flag in the forward).
    """
    global_w = distributed.all_reduce_sum(d, sums.weight.detach().clone())
    scale = d.world_size / (global_w.clamp(min=1e-12) * grad_accum)
    (sums.loss_sum * scale).backward()


def oom_message(config, shape: tuple[int, int], n_anchors: int, vocab: int, shrink: str) -> str:
    """What an out-of-memory error on a micro-batch of `shape` [B, T] says: its size and `shrink`, the options
    that make it smaller (the run's batching says which: dflash.batching.base.Batching.shrink_options)."""
    (B, T), model = shape, config.model
    return (
        f"out of memory on a micro-batch of {B} x {T} tokens with {n_anchors} anchors x block "
        f"{model.block_size} ({n_anchors * model.block_size} drafter positions; logits over {vocab} tokens "
        f"are taken {LOSS_CHUNK_ROWS} rows at a time). Lower {shrink}; "
        "raise --grad-accum to keep the same tokens per optimizer step."
    )
