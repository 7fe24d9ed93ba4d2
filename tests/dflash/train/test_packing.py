"""Packed micro-batches (dflash.data.packs, dflash.batching.packed): the packs themselves, and the exactness
that makes them safe: a pack's loss and gradients equal the padded computation over the same sequences and
anchors (fp32, 1e-5), for both drafter kinds, through the real target and through the drafter alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.data.batches import collate
from dflash.data.packs import PackOrder, collate_pack, make_packs, per_sequence
from dflash.kinds import build_drafter, named
from dflash.model.segments import Segments
from dflash.model.target import Target
from dflash.batching.anchors import sample_pack_anchors
from dflash.train.blocks import build_blocks
from dflash.train.step import micro_batch_sums
from tests.support.dflash_tiny import save_tiny_target

BS = 4


# --- the packs ---------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=200), st.integers(64, 200), st.integers(0, 3))
def test_every_sequence_lands_in_exactly_one_pack_within_the_budget(lengths, budget, epoch):
    packs = make_packs(lengths, budget, seed=7, epoch=epoch, pool=50)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(p and sum(lengths[i] for i in p) <= budget for p in packs)
    assert packs == make_packs(lengths, budget, seed=7, epoch=epoch, pool=50)


def test_packs_are_tight_and_each_epoch_mixes_them_differently():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(200, 3000, (2000,), generator=g).tolist()
    first, second = make_packs(lengths, 8192, 0, 0), make_packs(lengths, 8192, 0, 1)
    real = sum(lengths)
    assert real / (len(first) * 8192) > 0.97, "best-fit packing should fill its packs"
    assert first != second


def test_a_sequence_longer_than_a_pack_is_refused_by_name():
    with pytest.raises(ValueError, match="--pack-tokens"):
        make_packs([10, 300], 256, 0, 0)


def test_pack_order_resumes_at_the_same_pack_on_another_number_of_ranks():
    lengths = [5 + (i * 37) % 50 for i in range(60)]
    two = PackOrder(lengths, 100, per_batch=2, seed=3)
    seen = [two.next()[1] for _ in range(3)]
    resumed = PackOrder(lengths, 100, per_batch=1, seed=3, **{"epoch": two.state()["epoch"],
                                                               "index": two.state()["batch_index"]})
    whole = make_packs(lengths, 100, 3, 0)
    assert [p for batch in seen for p in batch] == whole[:6]
    assert resumed.next()[1] == [whole[6]]


def test_collate_pack_lays_sequences_back_to_back_with_a_padding_segment():
    items = [{"input_ids": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.long)} for n in (3, 2)]
    batch = collate_pack(items, pad_id=0, pack_tokens=8)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 1, 2, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    seg = batch["segments"]
    assert seg.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert seg.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert seg.cu_seqlens.tolist() == [0, 3, 5, 8] and seg.starts.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5]]
    assert [a.tolist() for a in per_sequence(torch.tensor([0, 1, 3]), [3, 2])] == [[0, 1], [0]]


def test_pack_anchors_never_straddle_two_sequences_and_keep_the_budget():
    seg = Segments.from_lengths([[5, 4, 3]], 14)
    mask = torch.tensor([1] * 12 + [0, 0])
    anchors = sample_pack_anchors(mask, seg.seq_idx[0], 100, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [0, 1, 2, 3, 5, 6, 7, 9, 10]  # 4, 8 and 11 end a sequence
    few = sample_pack_anchors(mask, seg.seq_idx[0], 4, torch.Generator().manual_seed(0))
    assert few.numel() == 4 and set(few.tolist()) <= set(anchors.tolist())


def test_a_label_past_its_sequence_is_not_scored():
    seg = Segments.from_lengths([[5, 4]], 9)
    ids = torch.arange(9).view(1, 9)
    blocks = build_blocks(ids, torch.ones(1, 9, dtype=torch.long), [torch.tensor([3])], 4, 99, n_anchors=2,
                          seq_idx=seg.seq_idx)
    assert blocks.label_valid[0, 0].tolist() == [True, False, False]  # 4 is in sequence 0, 5 and 6 are not
    assert blocks.anchor_valid[0].tolist() == [True, False] and blocks.anchors.shape == (1, 2)


# --- a pack computes what the padded batch computes ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_target(tmp_path_factory.mktemp("target"), "qwen3_5")
    return Target.load(path, layer_ids=[1, 3, 5])


def _sequences(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for n, prompt in ((23, 5), (17, 4), (30, 9)):
        ids = torch.randint(4, 90, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.long)
        mask[prompt:] = 1
        items.append({"input_ids": ids, "loss_mask": mask})
    return items


def _anchors(items: list[dict]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for item in items:
        m = item["loss_mask"].bool()
        cand = torch.nonzero(m[:-1] & m[1:]).flatten()
        out.append(cand[torch.randperm(cand.numel(), generator=g)[:6]].sort().values)
    return out


def _run(drafter, target, batch, anchors, **kw):
    drafter.zero_grad(set_to_none=True)
    sums = micro_batch_sums(drafter, target, batch, anchors, block_size=BS, gamma=None,
                            autocast_dtype=torch.float32, **kw)
    sums.loss_sum.backward()
    return sums, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _alone_context(target, items: list[dict], T: int) -> torch.Tensor:
    """Each sequence's context from a target pass over it alone, laid out as the pack lays it (zeros after)."""
    parts = [target.context(it["input_ids"].view(1, -1))[0] for it in items]
    context = torch.cat(parts)
    return torch.cat([context, context.new_zeros(T - context.shape[0], context.shape[1])]).unsqueeze(0)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("through", ["target", "drafter"])
def test_a_pack_gives_the_loss_and_gradients_of_the_padded_batch(tiny, kind, through):
    """`target`: the whole step, the packed target pass included; `drafter`: the pack's context made from
    each sequence run alone, so this half holds whatever the target side does."""
    items, T = _sequences(), 96
    anchors = _anchors(items)
    torch.manual_seed(0)
    drafter = build_drafter(named(kind).new_config(tiny, 2, BS, 0), attention="sdpa")
    padded = collate(items, pad_id=0)
    ref, ref_grads = _run(drafter, tiny, padded, anchors)

    packed = collate_pack(items, pad_id=0, pack_tokens=T)
    offsets = torch.tensor([0, 23, 40])
    in_pack = torch.cat([a + o for a, o in zip(anchors, offsets)])
    context = None if through == "target" else _alone_context(tiny, items, T)
    sums, grads = _run(drafter, tiny, packed, [in_pack], n_anchors=24, context=context)

    assert float(sums.weight) == pytest.approx(float(ref.weight), rel=1e-6)
    assert float(sums.loss_sum.detach()) == pytest.approx(float(ref.loss_sum.detach()), rel=1e-5)
    assert torch.equal(sums.correct, ref.correct) and torch.equal(sums.valid, ref.valid)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1e-12)
        assert (g - ref_grads[name]).abs().max() / scale < 1e-5, name


def test_out_of_memory_names_the_knobs_of_the_run_it_happened_in():
    """A packed micro-batch that runs out of memory names --pack-anchors / --pack-tokens, a padded one the
    padded batch's bounds (a packed run on an H100 was told to lower --max-anchors, which packs ignore)."""
    from dflash.batching.packed import Packed
    from dflash.batching.padded import Padded
    from dflash.config import TrainConfig
    from dflash.train.step import oom_message

    config = TrainConfig.from_flat(out="x", pack_tokens=8192, pack_anchors=1024, max_anchors=512)
    packed = oom_message(config, (1, 8192), 1024, 248320, Packed(config).shrink_options())
    assert "Lower --pack-anchors (now 1024) or --pack-tokens (now 8192)" in packed and "--max-anchors" not in packed
    padded = oom_message(config, (2, 4096), 1024, 248320, Padded(config).shrink_options())
    assert "Lower --max-anchors (now 512)" in padded and "--pack-anchors" not in padded
    assert "--grad-accum" in packed and "--grad-accum" in padded
