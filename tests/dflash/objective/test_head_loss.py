"""The fused LM head + loss (dflash.head_loss) against the full-logits loss (dflash.losses.dflash_loss)."""

import pytest
import torch

from dflash.objective import head_loss
from dflash.objective.head_loss import fused_weighted_ce
from dflash.objective.losses import default_gamma, dflash_loss, weighted_ce_from_hidden


def _case(seed: int, B=2, N=3, bs=5, H=16, V=50, dtype=torch.float64, all_invalid=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, bs, H, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (B, N, bs - 1), generator=g)
    valid = (torch.rand(B, N, bs - 1, generator=g) > 0.3) & (not all_invalid)
    return hidden, weight, labels, valid


@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_gradient_and_top1_equal_the_full_logits_loss(seed, chunk_rows):
    hidden, weight, labels, valid = _case(seed)
    total, denom, correct = fused_weighted_ce(hidden, weight, labels, valid, None, chunk_rows)
    (total / denom).backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None

    logits = hidden @ weight.T
    ref, stats = dflash_loss(logits, labels, valid)
    ref.backward()
    # the reference takes its cross-entropy in float32; this one stays in float64
    assert torch.allclose(total / denom, ref.double(), rtol=1e-6, atol=0)
    assert torch.allclose(fused_grad, hidden.grad, rtol=1e-5, atol=1e-6)
    expect = (logits[:, :, 1:].argmax(-1) == labels) & valid
    assert torch.equal(correct, expect)
    assert denom.item() == pytest.approx(float((torch.exp(-torch.arange(4.0) / default_gamma(5)) * valid).sum()))
    assert stats["n_valid"] == valid.sum()


def test_gradient_scales_with_the_incoming_gradient_like_autograd():
    hidden, weight, labels, valid = _case(3)
    total, _, _ = fused_weighted_ce(hidden, weight, labels, valid, 7.0, 3)
    (total * 0.37).backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None
    ref, _, _ = weighted_ce_from_hidden(hidden, lambda h: h @ weight.T, labels, valid, 7.0, 3)
    (ref * 0.37).backward()
    assert torch.allclose(total, ref.double(), rtol=1e-6)
    assert torch.allclose(fused_grad, hidden.grad, rtol=1e-5, atol=1e-6)


def test_nothing_scored_still_gives_every_row_a_zero_gradient():
    hidden, weight, labels, valid = _case(4, all_invalid=True)
    assert not valid.any()
    total, denom, correct = fused_weighted_ce(hidden, weight, labels, valid)
    total.backward()
    assert total.item() == 0.0 and denom.item() == 0.0 and not correct.any()
    assert hidden.grad is not None and not hidden.grad.any()


def test_without_grad_it_computes_the_loss_only():
    hidden, weight, labels, valid = _case(5)
    with torch.no_grad():
        total, denom, correct = fused_weighted_ce(hidden, weight, labels, valid)
    ref, ref_denom, ref_correct = weighted_ce_from_hidden(hidden.detach(), lambda h: h @ weight.T, labels, valid)
    assert not total.requires_grad
    assert torch.allclose(total, ref.double(), rtol=1e-6) and torch.equal(correct, ref_correct) and denom == ref_denom


def test_under_autocast_the_products_run_in_the_autocast_dtype():
    # bf16 products: the loss moves by bf16 rounding, not more; the rows' gradient keeps the rows' dtype.
    hidden, weight, labels, valid = _case(6, H=64, V=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, denom, _ = fused_weighted_ce(hidden, weight, labels, valid, None, 5)
    total.backward()
    assert hidden.grad.dtype == torch.float32
    ref, ref_denom, _ = weighted_ce_from_hidden(hidden.detach().double(), lambda h: h @ weight.double().T,
                                                labels, valid)
    assert abs(total.item() - ref.item()) / ref.item() < 2e-2


def test_bad_shapes_are_named():
    hidden, weight, labels, valid = _case(7)
    with pytest.raises(ValueError, match="head_weight must be"):
        fused_weighted_ce(hidden, weight[:, :3], labels, valid)
    with pytest.raises(ValueError, match="labels and valid"):
        fused_weighted_ce(hidden, weight, labels[:, :1], valid)
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_weighted_ce(hidden, weight, labels, valid, None, 0)


@pytest.mark.parametrize("rows,chunk_rows", [(1, 8), (8, 8), (9, 8), (17, 8), (23, 8), (5, 1), (4097, 2048)])
def test_chunks_cover_the_rows_once_and_leave_no_single_row_behind(rows, chunk_rows):
    parts = head_loss.chunks(rows, chunk_rows)
    assert [i for part in parts for i in range(part.start, part.stop)] == list(range(rows))
    sizes = [part.stop - part.start for part in parts]
    assert all(size <= chunk_rows for size in sizes)
    assert sizes[:-2] == [chunk_rows] * len(sizes[:-2])
    if rows > chunk_rows > 2:
        assert 1 not in sizes


@pytest.mark.parametrize("chunk_rows,first_graphs", [(16, 2), (1000, 1)])
def test_the_compiled_pass_compiles_in_the_first_step_only(monkeypatch, chunk_rows, first_graphs):
    """Steps score different row counts. The first step compiles a graph for full chunks (if it has one) and
    one for a shorter chunk, marked dynamic; no later row count compiles again. Before, a first step of one
    short chunk compiled it static and the second step compiled it again (the GPU test of
    tests/dflash/train/test_compiled_shapes.py counted one more graph at step 2)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(head_loss._ce_rows, backend="eager", dynamic=None)
    monkeypatch.setattr(head_loss, "_ce_rows_fn", lambda device: compiled)
    graphs = []
    for seed, (B, N) in enumerate([(2, 9), (2, 7), (3, 9), (1, 11), (2, 10)]):
        hidden, weight, labels, valid = _case(seed, B=B, N=N)
        total, denom, _ = fused_weighted_ce(hidden, weight, labels, valid, None, chunk_rows=chunk_rows)
        (total / denom).backward()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    torch._dynamo.reset()
    assert graphs == [first_graphs] * len(graphs), graphs
