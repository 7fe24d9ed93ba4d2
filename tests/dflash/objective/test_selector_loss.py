"""The DFlash2 objective: DFlash's weighted CE plus the K-way selector CE, row by row as documented;
chunking changes nothing; the selector's codebooks and the backbone both receive gradient."""

import pytest
import torch
import torch.nn.functional as F

from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config, DFlash2Drafter
from dflash.objective.losses import position_weights
from dflash.kinds.dflash2.selector_loss import dflash2_sums

SHAPE = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             intermediate_size=24, vocab_size=40, block_size=4, num_target_layers=4, target_layer_ids=[1],
             mask_token_id=3, conv_group_size=4, selector_rank=5, selector_top_k=6, final_logit_softcapping=4.0)


@pytest.fixture
def case():
    torch.manual_seed(0)
    drafter = DFlash2Drafter(DFlash2Config(**SHAPE))
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 0.5)
        drafter.candidate_selector.predecessor_codebook.normal_(0, 0.5)
    head = torch.nn.Linear(16, 40, bias=False)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 4, 16, generator=g, requires_grad=True)
    block_ids = torch.randint(0, 40, (2, 3, 4), generator=g)
    labels = torch.randint(0, 40, (2, 3, 3), generator=g)
    valid = torch.rand(2, 3, 3, generator=g) > 0.2
    return drafter, head, hidden, block_ids, labels, valid


def expected(drafter, head, hidden, block_ids, labels, valid, missing):
    """The objective written out one scored row at a time."""
    w = position_weights(4, 2.0)
    total, K = 0.0, drafter.candidate_selector.top_k
    for b, n, k in valid.nonzero().tolist():
        h, y = hidden[b, n, k + 1], labels[b, n, k]
        logits = torch.tanh(head(h) / 4.0) * 4.0
        total = total + w[k] * F.cross_entropy(logits[None], y[None])
        values, cands = logits.topk(K)
        if y not in cands:
            if missing == "drop":
                continue
            cands, values = cands.clone(), values.clone()
            cands[-1], values[-1] = y, logits[y]
        prev = block_ids[b, n, 0] if k == 0 else labels[b, n, k - 1]
        scores = drafter.candidate_selector.scores(h, values, cands, prev)
        total = total + w[k] * F.cross_entropy(scores[None], (cands == y).long().argmax()[None])
    return total


@pytest.mark.parametrize("missing", ["drop", "inject"])
def test_the_loss_is_the_documented_sum_and_chunks_change_nothing(case, missing):
    drafter, head, hidden, block_ids, labels, valid = case
    total, weight, correct = dflash2_sums(drafter, hidden, head, block_ids, labels, valid, 2.0, missing=missing)
    torch.testing.assert_close(total, expected(*case, missing), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight, (position_weights(4, 2.0) * valid).sum())
    one, _, correct_one = dflash2_sums(drafter, hidden, head, block_ids, labels, valid, 2.0, missing=missing,
                                       chunk_rows=1)
    torch.testing.assert_close(one, total, rtol=1e-6, atol=1e-6)
    assert torch.equal(correct, correct_one) and not (correct & ~valid).any()


def test_gradient_reaches_the_codebooks_and_the_backbone(case):
    drafter, head, hidden, block_ids, labels, valid = case
    total, _, _ = dflash2_sums(drafter, hidden, head, block_ids, labels, valid, 2.0)
    total.backward()
    sel = drafter.candidate_selector
    for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight, hidden):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_an_unknown_variant_is_refused(case):
    with pytest.raises(ValueError, match="drop, inject"):
        dflash2_sums(*case[:6], 2.0, missing="soft")
