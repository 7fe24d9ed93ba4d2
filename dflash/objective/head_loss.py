"""The LM head and the DFlash loss fused: logits, cross-entropy, top-1 and the rows' gradient in one pass.

The training step scores M block positions (anchors x (bs-1), ~15K at the 27B shape) against a frozen
[V,H] head (V = 248,320 for Qwen3.5). losses.weighted_ce_from_hidden runs the head a chunk of rows at a
time under activation checkpointing: three [m,H]x[H,V]-sized products per chunk (forward, forward
recomputed in the backward, input gradient), 1.5x the head's model FLOPs, and the float32
cross-entropy as separate passes over [m,V]. Here, for each chunk of rows, the forward does

    logits = rows @ W^T                                   one product, in the compute dtype
    ce, top1, dlogits = w * (softmax(logits) - onehot)     one fused pass over [m,V] (compiled on a GPU)
    grad_rows = dlogits @ W                               the second and last product

and keeps only grad_rows ([M,H]) for the backward, which scales it by the incoming gradient (a scalar:
the loss is a weighted sum). Two products instead of three, no [m,V] tensor outlives its chunk, and the
numerics are autograd's: float32 softmax, the logits' gradient rounded to the compute dtype before the
product, as autocast's backward of `head(rows).float()` rounds it. The head is frozen: no weight gradient.
"""

from __future__ import annotations

import torch

from dflash.objective.losses import LOSS_CHUNK_ROWS, block_weights

_compiled = None


def _ce_rows(logits: torch.Tensor, targets: torch.Tensor, row_w: torch.Tensor, want_grad: bool):
    """[m,V] logits, [m] targets, [m] weights -> ([m] CE, [m] top-1, [m,V] w*(softmax-onehot) or None);
    the softmax in float32 at least (float64 stays float64)."""
    f = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(f, dim=-1)
    ce = lse - f.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    top1 = f.argmax(-1)
    if not want_grad:
        return ce, top1, None
    hit = torch.arange(f.shape[-1], device=f.device) == targets.unsqueeze(-1)
    dlogits = (torch.exp(f - lse.unsqueeze(-1)) - hit.to(f.dtype)) * row_w.unsqueeze(-1)
    return ce, top1, dlogits.to(logits.dtype)


def _ce_rows_fn(device: torch.device):
    """_ce_rows, compiled into one or two kernels on CUDA (eager elsewhere: five passes over [m,V])."""
    global _compiled
    if device.type != "cuda":
        return _ce_rows
    if _compiled is None:
        _compiled = torch.compile(_ce_rows, dynamic=None)
    return _compiled


def chunks(rows: int, chunk_rows: int) -> list[slice]:
    """The row slices the head runs: full chunks of `chunk_rows`, then what is left, never a single row.

    The scored rows of a step (M) differ from step to step, so the last chunk's size does too. On a GPU the
    fused pass compiles once for a full chunk and once for a shorter one, whose row count is marked dynamic
    (torch._dynamo.maybe_mark_dynamic): every later size reuses it. A chunk of one row would be compiled
    apart (dynamo specialises sizes 0 and 1), a recompile in the middle of training, so a remainder of one
    row takes one row from the chunk before it (chunk_rows - 1, then 2), both of the dynamic size (for
    chunk_rows >= 3; the training step's is LOSS_CHUNK_ROWS)."""
    bounds = list(range(0, rows, chunk_rows)) + [rows]
    if rows > chunk_rows and rows % chunk_rows == 1:
        bounds[-2] -= 1
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class _HeadCE(torch.autograd.Function):
    """sum_i w_i * CE(rows_i @ W^T, target_i) with its rows' gradient computed in the forward."""

    @staticmethod
    def forward(ctx, rows, weight, targets, row_w, chunk_rows: int, dtype: torch.dtype, want_grad: bool):
        w_c = weight.to(dtype)
        M = rows.shape[0]
        ce = torch.empty(M, dtype=torch.promote_types(dtype, torch.float32), device=rows.device)
        top1 = torch.empty(M, dtype=torch.long, device=rows.device)
        grad = torch.empty(M, rows.shape[1], dtype=dtype, device=rows.device) if want_grad else None
        fn = _ce_rows_fn(rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            for part in chunks(M, chunk_rows):
                x, t, rw = rows[part].to(dtype), targets[part], row_w[part]
                logits = x @ w_c.T
                if part.stop - part.start != chunk_rows:
                    for tensor in (logits, t, rw):
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
                ce[part], top1[part], dlogits = fn(logits, t, rw, want_grad)
                if want_grad:
                    torch.mm(dlogits, w_c, out=grad[part])
                del dlogits
        ctx.save_for_backward(grad)
        ctx.rows_dtype = rows.dtype
        ctx.mark_non_differentiable(top1)
        return (ce * row_w).sum(), top1

    @staticmethod
    def backward(ctx, grad_total, _grad_top1):
        (grad,) = ctx.saved_tensors
        return grad.to(ctx.rows_dtype) * grad_total.to(ctx.rows_dtype), None, None, None, None, None, None


def compute_dtype(device: torch.device, fallback: torch.dtype) -> torch.dtype:
    """The autocast dtype when autocast is on for `device`, else `fallback` (the rows' own dtype)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return fallback


def fused_weighted_ce(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    gamma: float | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """losses.weighted_ce_from_hidden with the head given as its [V,H] weight (a bias-free Linear):
    (ce_sum [] float32 with a graph, weight [] float32, correct [B,N,bs-1] bool); same loss and gradients
    up to float summation order. The products run in the autocast dtype when autocast is on."""
    H = hidden.shape[-1]
    valid, w = block_weights(hidden, labels, valid, gamma, "hidden")                     # [B,N,bs-1]
    if head_weight.dim() != 2 or head_weight.shape[1] != H:
        raise ValueError(f"head_weight must be [V,{H}], got {tuple(head_weight.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    index = valid.flatten().nonzero().squeeze(-1)   # the one host sync of the step: M, the scored rows
    rows = hidden[:, :, 1:, :].reshape(-1, H).index_select(0, index)                    # [M,H]
    targets, row_w = labels.flatten().index_select(0, index), w.flatten().index_select(0, index)
    dtype = compute_dtype(hidden.device, hidden.dtype)
    want_grad = torch.is_grad_enabled() and rows.requires_grad  # no second product in evaluation
    total, top1 = _HeadCE.apply(rows, head_weight, targets, row_w, chunk_rows, dtype, want_grad)
    with torch.no_grad():
        correct = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        correct[index] = top1 == targets
    return total, w.sum(), correct.view_as(valid)
