"""dflash_loss against a per-position loop; the weight formula and gamma rule."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.objective.losses import (
    default_gamma, dflash_loss, dflash_loss_from_hidden, position_weights, weighted_ce_from_hidden,
)


def test_default_gamma_known_values_and_rule():
    assert default_gamma(16) == 7 and default_gamma(8) == 4 and default_gamma(10) == 5
    assert default_gamma(4) == 2 and default_gamma(13) == 6 and default_gamma(19) == 8
    values = [default_gamma(bs) for bs in range(2, 40)]
    assert values == sorted(values)  # never shrinks as blocks grow
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        default_gamma(1)


def test_position_weights_formula():
    w = position_weights(16)
    assert w.shape == (15,)
    for k in range(1, 16):
        assert w[k - 1].item() == pytest.approx(math.exp(-(k - 1) / 7))
    assert position_weights(8, gamma=2.0)[3].item() == pytest.approx(math.exp(-1.5))
    with pytest.raises(ValueError, match="gamma must be a positive"):
        position_weights(8, gamma=0)


def naive_loss(logits, labels, valid, gamma):
    B, N, bs, V = logits.shape
    num, den = 0.0, 0.0
    correct = [0] * (bs - 1)
    count = [0] * (bs - 1)
    for b in range(B):
        for n in range(N):
            for k in range(1, bs):
                if not valid[b, n, k - 1]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                ce = F.cross_entropy(logits[b, n, k].double().unsqueeze(0), labels[b, n, k - 1].unsqueeze(0))
                num += w * ce.item()
                den += w
                count[k - 1] += 1
                correct[k - 1] += int(logits[b, n, k].argmax() == labels[b, n, k - 1])
    return num / den, [c / max(1, n) for c, n in zip(correct, count)], sum(count), sum(correct)


@pytest.mark.parametrize("bs,gamma", [(16, None), (8, None), (5, 1.5)])
def test_loss_matches_per_position_loop(bs, gamma):
    g = torch.Generator().manual_seed(bs)
    B, N, V = 2, 3, 11
    logits = torch.randn(B, N, bs, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, N, bs - 1), generator=g)
    valid = torch.rand(B, N, bs - 1, generator=g) > 0.3
    labels[~valid] = -100  # padding ids outside the vocabulary must be ignored, not crash
    loss, stats = dflash_loss(logits, labels, valid, gamma)
    ref, acc_pos, n_valid, n_correct = naive_loss(logits.detach(), labels, valid, gamma or default_gamma(bs))
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert stats["n_valid"] == n_valid
    assert stats["acc"] == pytest.approx(n_correct / n_valid)
    assert stats["acc_per_pos"].tolist() == pytest.approx(acc_pos)
    loss.backward()
    assert logits.grad[:, :, 0].abs().sum() == 0  # the anchor position is never scored
    assert logits.grad.abs().sum() > 0


def test_tau_estimate_counts_the_accepted_prefix():
    V, bs = 5, 4
    labels = torch.tensor([[[1, 2, 3], [1, 2, 3]]])
    logits = torch.full((1, 2, bs, V), -10.0)
    for n, guesses in enumerate([[1, 2, 0], [0, 2, 3]]):  # block 0: 2 right then wrong; block 1: first wrong
        for k, tok in enumerate(guesses):
            logits[0, n, k + 1, tok] = 10.0
    _, stats = dflash_loss(logits, labels, torch.ones(1, 2, 3, dtype=torch.bool))
    assert stats["tau_est"] == pytest.approx(1 + (2 + 0) / 2)


def test_nothing_valid_gives_zero_loss_with_graph():
    logits = torch.randn(1, 2, 4, 7, requires_grad=True)
    loss, stats = dflash_loss(logits, torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3, dtype=torch.bool))
    assert loss.item() == 0 and stats["n_valid"] == 0 and stats["tau_est"] == 0.0
    loss.backward()


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"labels and valid must be \[B,N,bs-1\]"):
        dflash_loss(torch.randn(1, 2, 4, 7), torch.zeros(1, 2, 4, dtype=torch.long), torch.ones(1, 2, 4, dtype=torch.bool))


class RecordingHead(torch.nn.Linear):
    """A real LM head (Linear) that records how many rows each call saw."""

    def __init__(self, hidden, vocab, generator):
        super().__init__(hidden, vocab, bias=False)
        with torch.no_grad():
            self.weight.copy_(torch.randn(vocab, hidden, generator=generator))
        self.rows = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return super().forward(x)


@pytest.mark.parametrize("chunk_rows", [1, 5, 10_000])
def test_chunked_loss_from_hidden_equals_the_full_logits_loss(chunk_rows):
    """Same loss, same gradient w.r.t. the drafter's hidden states, same stats; the head never sees more
    than chunk_rows rows, and only the scored positions (not the anchors, not invalid labels)."""
    g = torch.Generator().manual_seed(chunk_rows)
    B, N, bs, H, V = 2, 3, 6, 8, 13
    head = RecordingHead(H, V, g)
    head.requires_grad_(False)  # the target's head is frozen
    hidden = torch.randn(B, N, bs, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, N, bs - 1), generator=g)
    valid = torch.rand(B, N, bs - 1, generator=g) > 0.3
    valid[0, 0] = True  # one fully valid block, so tau_est is defined
    labels[~valid] = -100

    ref_loss, ref_stats = dflash_loss(head(hidden), labels, valid, None)
    ref_loss.backward()
    ref_grad, hidden.grad = hidden.grad.clone(), None
    head.rows.clear()

    loss, stats = dflash_loss_from_hidden(hidden, head, labels, valid, None, chunk_rows=chunk_rows)
    forward_rows = list(head.rows)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, ref_grad, atol=1e-6)
    assert torch.equal(stats["acc_per_pos"], ref_stats["acc_per_pos"])
    assert (stats["acc"], stats["n_valid"], stats["tau_est"]) == (ref_stats["acc"], ref_stats["n_valid"], ref_stats["tau_est"])
    assert sum(forward_rows) == int(valid.sum()) and max(forward_rows) <= chunk_rows
    assert max(head.rows) <= chunk_rows  # the backward recomputes chunk by chunk too
    assert hidden.grad[:, :, 0].abs().sum() == 0  # anchors are never scored


def test_chunked_loss_with_nothing_valid_is_zero_with_a_graph():
    head = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(1, 2, 4, 4, requires_grad=True)
    loss, stats = dflash_loss_from_hidden(hidden, head, torch.zeros(1, 2, 3, dtype=torch.long),
                                          torch.zeros(1, 2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and stats["n_valid"] == 0 and hidden.grad is not None


def test_weighted_sum_is_the_loss_before_its_normalisation():
    """The training step's sums: ce_sum / weight is the loss, weight is sum(w_k * valid), and the
    correct mask counts what acc_per_pos reports, with no division to undo."""
    g = torch.Generator().manual_seed(3)
    B, N, bs, H, V = 2, 3, 5, 8, 11
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    hidden = torch.randn(B, N, bs, H, generator=g)
    labels = torch.randint(0, V, (B, N, bs - 1), generator=g)
    valid = torch.rand(B, N, bs - 1, generator=g) > 0.3
    loss, stats = dflash_loss_from_hidden(hidden, head, labels, valid)
    ce_sum, weight, correct = weighted_ce_from_hidden(hidden, head, labels, valid)
    assert weight.item() == pytest.approx((position_weights(bs) * valid).sum().item())
    assert (ce_sum / weight).item() == pytest.approx(loss.item(), rel=1e-6)
    assert correct.shape == valid.shape and not (correct & ~valid).any()
    per_pos = correct.sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)
    assert torch.equal(per_pos, stats["acc_per_pos"])
