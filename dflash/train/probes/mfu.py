"""Model FLOPs of a training step and the GPU's peak: model FLOPs utilisation (MFU), as nanoGPT reports it.

Model FLOPs count the useful work only (recomputation and masked-out attention do not count):
  target forward  2 x (decoder-layer parameters) x tokens + 4 x head_dim x heads x (causal query-key
                  pairs) per full-attention layer (the GatedDeltaNet recurrences, under 1 %, are left out)
  drafter         3 x forward (forward + backward): 2 x parameters x the rows each matrix sees (q/o/MLP:
                  block rows; k/v: context + block rows; fc: context rows) + 4 x head_dim x heads x
                  (visible query-key pairs of the drafter mask, dflash.model.masks)
  LM head         4 x hidden x vocab x scored rows (forward + input gradient; the head is frozen)
The trainer counts the drafter's visible pairs from the anchor positions (`drafter_pairs`): a block
anchored at a sees the a context positions before it and its own bs tokens (a sliding window W cuts the
context to W on every layer but the last). `dense_mask_flops` counts them from the drafter's dense mask
instead, part by part: the check of the trainer's count, and what bench/bench_train.py reports.
"""

from __future__ import annotations

import torch

from dflash.model.flops import drafter_flops, drafter_pairs, head_flops, target_forward_flops
from dflash.model.masks import drafter_attention_mask
from dflash.train.blocks import build_blocks

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, by device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "B200": 2250.0, "B300": 2250.0,
                    "GB200": 2500.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "RTX 6000 Ada": 364.0,
                    "RTX PRO 6000": 504.0, "RTX 5090": 209.0, "RTX 4090": 165.0}


def drafter_and_head_flops(dcfg, items: list[dict], anchors: list[torch.Tensor]) -> tuple[float, float]:
    """(drafter forward + backward, LM head) model FLOPs of a micro-batch of `items` (input_ids, loss_mask)
    with these anchors, counted from the anchor positions (a sliding window cuts the sliding layers' pairs)."""
    lengths = [int(it["input_ids"].numel()) for it in items]
    positions = [int(a) for t in anchors for a in t.tolist()]
    bs = dcfg.block_size
    sliding = sum(1 for t in (dcfg.layer_types or []) if t == "sliding_attention")
    full_pairs = drafter_pairs(positions, bs)
    window_pairs = drafter_pairs(positions, bs, dcfg.sliding_window) if sliding else full_pairs
    n = max(1, dcfg.num_hidden_layers)
    pairs = (sliding * window_pairs + (n - sliding) * full_pairs) / n
    # scored rows: block positions a+1..a+bs-1 inside the sequence with a supervised label
    scored = sum(int(it["loss_mask"][a + 1:a + bs].sum()) for it, t in zip(items, anchors) for a in t.tolist())
    return drafter_flops(dcfg, sum(lengths), len(positions) * bs, pairs), head_flops(dcfg, scored)


class StepFlops:
    """Model FLOPs of micro-batches from their items and anchors (host-side: no device sync)."""

    def __init__(self, target, dcfg):
        self.target, self.dcfg = target, dcfg

    def __call__(self, items: list[dict], anchors: list[torch.Tensor]) -> float:
        lengths = [int(it["input_ids"].numel()) for it in items]
        return target_forward_flops(self.target, lengths) + sum(drafter_and_head_flops(self.dcfg, items, anchors))


def dense_mask_flops(target, dcfg, input_ids: torch.Tensor, attention_mask: torch.Tensor, blocks) -> dict:
    """Model FLOPs of one micro-batch step by part, with the drafter's visible query-key pairs counted
    exactly from its dense mask ([B, N*bs, T + N*bs], dflash.model.masks): the formulas above.

    input_ids, attention_mask: [B, T]; blocks: build_blocks' result for them (anchors [B, N]).
    Returns {target_forward, drafter, lm_head, total} in FLOPs, tokens (unpadded) and
    drafter_mask_density (visible pairs / all pairs of the valid block rows)."""
    T = input_ids.shape[1]
    lengths = [int(n) for n in attention_mask.sum(1).tolist()]
    tokens = sum(lengths)
    target_f = target_forward_flops(target, lengths)
    bs = dcfg.block_size
    rows = int(blocks.anchor_valid.sum()) * bs
    mask = drafter_attention_mask(blocks.anchors, T, bs, attention_mask.bool(), blocks.anchor_valid)
    valid_rows = blocks.anchor_valid.repeat_interleave(bs, dim=1)
    pairs = float(mask[valid_rows].sum())
    drafter_f = drafter_flops(dcfg, tokens, rows, pairs)
    head_f = head_flops(dcfg, int(blocks.label_valid.sum()))
    dense_pairs = rows * (T + blocks.anchors.shape[1] * bs)
    return {"target_forward": target_f, "drafter": drafter_f, "lm_head": head_f,
            "total": target_f + drafter_f + head_f, "tokens": tokens,
            "drafter_mask_density": pairs / max(1, dense_pairs)}


def batch_flops(target, batch: dict, anchors: list[torch.Tensor], dcfg) -> dict:
    """dense_mask_flops of a collated micro-batch (input_ids, loss_mask, attention_mask [B, T]) with these
    anchors (B sorted position tensors), its blocks built as the step builds them: the MFU's numerator."""
    blocks = build_blocks(batch["input_ids"], batch["loss_mask"] * batch["attention_mask"], anchors, dcfg.block_size,
                          target.mask_token_id)
    return dense_mask_flops(target, dcfg, batch["input_ids"], batch["attention_mask"], blocks)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s: the data-sheet value for a known GPU, else measured on
    4096^3 products (a few hundred milliseconds once); None on a CPU (no MFU there)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return measured_matmul_flops(device)


def measured_matmul_flops(device: torch.device, n: int = 4096, reps: int = 20) -> float:
    """bf16 FLOP/s of n^3 matrix products on random data (after 3 warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3)
