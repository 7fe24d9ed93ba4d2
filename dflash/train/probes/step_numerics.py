"""The training step's gradients against an fp32 reference step on the same weights and inputs.

What runs is the trainer's own micro-batch (dflash.train.step: micro_batch_sums + backward) with
`StandInTarget` in place of the frozen target: random tensors of a real target's shapes (tapped hidden
states [B, T, k*H], embedding and LM head [V, H]), so the drafter, the head and the loss do all the work.

Step variants (STEP_VARIANTS; every one starts from the same initial weights, anchors and inputs):
    before      eager decoder layers, LM head in checkpointed chunks (losses.weighted_ce_from_hidden)
    fused-head  eager layers, LM head fused with the loss (dflash.objective.head_loss)
    compiled    Drafter.compile_layers (regional torch.compile), checkpointed head
    after       compiled layers + fused head: what the trainer runs on a GPU

The reference (`reference_gradients`): fp32 (or float64) weights and activations, no autocast, TF32 off,
dense masked SDPA (the memory-efficient kernel on a GPU, the math kernel for float64 and on a CPU), the
head in checkpointed chunks of that dtype. `compare` gives the cosine and the relative L2 error of a
variant's parameter gradients against it, per parameter group (fc, attention, mlp, norms) and over all.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dflash import distributed
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.train.step import backward, micro_batch_sums
from dflash.train.probes.timing import free_memory, sync

STEP_VARIANTS = {"before": dict(compiled=False, fused_head=False), "fused-head": dict(compiled=False, fused_head=True),
                 "compiled": dict(compiled=True, fused_head=False), "after": dict(compiled=True, fused_head=True)}
GROUPS = ("fc", "attention", "mlp", "norms")


def group_of(name: str) -> str:
    """The parameter group of a drafter tensor name: fc (+ its norm), attention projections, MLP, the other norms."""
    if name.startswith(("fc.", "hidden_norm.")):
        return "fc"
    if "_proj." in name:
        return "mlp" if ".mlp." in name else "attention"
    return "norms"


class StandInTarget:
    """What dflash.train.step reads of a Target (context, embed, lm_head, head_weight, mask_token_id), as
    random tensors of a step shape (dflash.model.shapes.STEP_SHAPES) in `dtype`:

        context(ids)   [B, T, layers*H]   the tapped hidden states, the same whatever the ids
        embed(ids)     [..., H]           rows of a random [V, H] embedding table
        lm_head(h)     [..., V]           h @ head_weight.T, head_weight a random [V, H]

    `like` shares another stand-in's values (cast to `dtype`): the fp32 reference of a bf16 stand-in."""

    def __init__(self, s: dict, device: torch.device, dtype: torch.dtype, layers: int, seed: int = 0,
                 like: "StandInTarget | None" = None):
        H, V = s["hidden"], s["vocab"]
        self.hidden_size, self.vocab_size, self.mask_token_id = H, V, V - 1
        if like is not None:
            self._context, self.embedding, self.head_weight = (t.to(dtype) for t in
                                                               (like._context, like.embedding, like.head_weight))
            return
        g = torch.Generator(device=device).manual_seed(seed)
        self._context = torch.randn(s["batch"], s["seq"], layers * H, generator=g, device=device).to(dtype)
        self.embedding = (torch.randn(V, H, generator=g, device=device) * 0.02).to(dtype)
        self.head_weight = (torch.randn(V, H, generator=g, device=device) * 0.02).to(dtype)

    def context(self, input_ids, attention_mask=None):
        return self._context

    def embed(self, ids):
        return F.embedding(ids, self.embedding)

    def lm_head(self, hidden):
        return hidden @ self.head_weight.T


def new_drafter(dcfg: DrafterConfig, device: torch.device, attention: str, compiled: bool,
                state: dict | None = None) -> Drafter:
    """The drafter of every variant: float32 master weights from `state` (or a seeded init)."""
    torch.manual_seed(0)
    with torch.device(device):
        drafter = Drafter(dcfg, attention=attention)
    if state is not None:
        drafter.load_state_dict(state)
    return drafter.compile_layers() if compiled else drafter


def one_step(drafter, target, batch, anchors, dcfg, autocast: torch.dtype, fused_head: bool, device):
    """(forward+loss seconds, backward seconds) of the trainer's micro-batch, a sync around each phase;
    the gradients are left in drafter's .grad (accumulated: zero them first to time a clean step).
    batch: input_ids, loss_mask, attention_mask [B, T]; anchors: B sorted position tensors [n_b]."""
    d = distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)
    sync(device)
    t0 = time.perf_counter()
    sums = micro_batch_sums(drafter, target, batch, anchors, block_size=dcfg.block_size, gamma=None,
                            autocast_dtype=autocast, fused_head=fused_head)
    sync(device)
    t1 = time.perf_counter()
    backward(sums, d, grad_accum=1)
    sync(device)
    return t1 - t0, time.perf_counter() - t1


def gradients(drafter) -> dict[str, torch.Tensor]:
    """{parameter name: its gradient as a float32 copy} of every parameter that has one."""
    return {n: p.grad.detach().float().clone() for n, p in drafter.named_parameters() if p.grad is not None}


def compare(grads: dict, ref: dict) -> dict:
    """Cosine and relative L2 error (|g - ref| / |ref|) per parameter group, and over all parameters:
    {group: {"cosine", "rel_l2", "params"}}, computed in float64."""
    out = {}
    for group in (*GROUPS, "all"):
        names = [n for n in ref if group in ("all", group_of(n))]
        if not names:
            continue
        a = torch.cat([grads[n].flatten() for n in names]).double()
        b = torch.cat([ref[n].flatten() for n in names]).double()
        out[group] = {"cosine": float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300)),
                      "rel_l2": float((a - b).norm() / b.norm().clamp(min=1e-300)), "params": int(b.numel())}
    return out


def reference_gradients(dcfg, s, target, batch, anchors, device, state, dtype=torch.float32) -> dict:
    """One micro-batch in `dtype` end to end: no autocast, no TF32, dense masked SDPA (memory-efficient
    kernel on a GPU; the math kernel for float64), the head in checkpointed chunks of `dtype`.
    `s` is the step shape of `target` (a StandInTarget, whose values the reference's stand-in shares);
    `state` the drafter's initial weights. Returns gradients() of the reference drafter."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref_target = StandInTarget(s, device, dtype, len(dcfg.target_layer_ids), like=target)
    with torch.device(device):
        drafter = Drafter(dcfg, attention="sdpa").to(dtype)
    drafter.load_state_dict(state)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    backend = SDPBackend.MATH if dtype == torch.float64 or device.type != "cuda" else SDPBackend.EFFICIENT_ATTENTION
    try:
        with sdpa_kernel([backend]):
            one_step(drafter, ref_target, batch, anchors, dcfg, dtype, False, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    grads = gradients(drafter)
    del drafter, ref_target
    free_memory(device)
    return grads
