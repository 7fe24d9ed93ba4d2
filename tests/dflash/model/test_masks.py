"""drafter_attention_mask against a plain Python loop that spells out the visibility rules."""

import pytest
import torch

from dflash.model.masks import drafter_attention_mask


def reference_mask(anchors, T, bs, context_valid, anchor_valid, window=None):
    """window=None: a full_attention layer; window=W: a sliding_attention layer, where the query at
    absolute position p = a + k sees only keys at positions p-W+1 .. p (so the block is causal)."""
    B, N = anchors.shape
    mask = torch.zeros(B, N * bs, T + N * bs, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            a = int(anchors[b, n])
            for k in range(bs):
                row, p = n * bs + k, a + k
                for j in range(T):
                    visible = bool(anchor_valid[b, n]) and j < a and bool(context_valid[b, j])
                    if window is not None:
                        visible = visible and p - window + 1 <= j
                    mask[b, row, j] = visible
                for m in range(N):
                    for kk in range(bs):
                        visible = m == n
                        if window is not None:
                            visible = visible and p - window + 1 <= a + kk <= p
                        mask[b, row, T + m * bs + kk] = visible
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_mask_matches_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, T = 3, 4, 11
    bs = [2, 3, 4, 8, 16, 5][seed]
    anchors = torch.randint(0, T, (B, N), generator=g)
    context_valid = torch.rand(B, T, generator=g) > 0.2
    anchor_valid = torch.rand(B, N, generator=g) > 0.3
    got = drafter_attention_mask(anchors, T, bs, context_valid, anchor_valid)
    assert got.dtype == torch.bool and got.shape == (B, N * bs, T + N * bs)
    assert torch.equal(got, reference_mask(anchors, T, bs, context_valid, anchor_valid))


@pytest.mark.parametrize("seed", range(6))
def test_sliding_window_mask_matches_loop_reference(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B, N, T = 2, 3, 13
    bs, window = [(4, 1), (4, 2), (4, 3), (8, 5), (3, 20), (16, 7)][seed]
    anchors = torch.randint(0, T, (B, N), generator=g)
    context_valid = torch.rand(B, T, generator=g) > 0.2
    anchor_valid = torch.rand(B, N, generator=g) > 0.3
    got = drafter_attention_mask(anchors, T, bs, context_valid, anchor_valid, sliding_window=window)
    assert torch.equal(got, reference_mask(anchors, T, bs, context_valid, anchor_valid, window))
    assert got.any(dim=-1).all()  # every query sees at least itself


def test_sliding_window_drawn_in_the_docstring():
    """The W = 3 example of dflash/model/masks.py, row by row."""
    mask = drafter_attention_mask(torch.tensor([[2, 4]]), T=6, block_size=3, sliding_window=3)[0].int()
    assert mask[3:].tolist() == [
        [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
    # A window wider than block + context is the full mask made causal inside the block.
    wide = drafter_attention_mask(torch.tensor([[2, 4]]), T=6, block_size=3, sliding_window=100)
    full = drafter_attention_mask(torch.tensor([[2, 4]]), T=6, block_size=3)
    assert torch.equal(wide[..., :6], full[..., :6])
    assert torch.equal(wide[..., 6:], full[..., 6:] & torch.ones(6, 6, dtype=torch.bool).tril())


def test_defaults_mean_all_valid_and_every_row_sees_something():
    anchors = torch.tensor([[0, 3, 5]])
    mask = drafter_attention_mask(anchors, T=6, block_size=4)
    ones = torch.ones(1, 6, dtype=torch.bool)
    assert torch.equal(mask, reference_mask(anchors, 6, 4, ones, torch.ones(1, 3, dtype=torch.bool)))
    assert mask.any(dim=-1).all()        # no all-masked softmax row, even for the anchor at 0
    assert not mask[0, 0:4, :6].any()    # anchor 0 sees no context
    assert mask[0, 4:8, :3].all() and not mask[0, 4:8, 3:6].any()  # anchor 3 sees 0..2 only


def test_invalid_anchor_sees_only_its_block():
    mask = drafter_attention_mask(torch.tensor([[4, 4]]), T=6, block_size=2,
                                  anchor_valid=torch.tensor([[True, False]]))
    assert mask[0, 0, :4].all()
    assert not mask[0, 2:4, :6].any() and mask[0, 2:4, 6 + 2:].all()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"anchors must be \[B,N\]"):
        drafter_attention_mask(torch.tensor([1, 2]), 4, 2)
    with pytest.raises(ValueError, match="context_valid"):
        drafter_attention_mask(torch.tensor([[1]]), 4, 2, context_valid=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        drafter_attention_mask(torch.tensor([[1]]), 4, 2, sliding_window=0)
