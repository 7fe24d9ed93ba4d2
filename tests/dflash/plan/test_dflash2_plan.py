"""The planner counts a DFlash2 drafter: its parameters are DFlash's plus the convolutions and the selector."""

from dflash.kinds.dflash2.dflash2_drafter import dflash2_extra_params
from dflash.plan.sizes import drafter_shape, target_shape


def test_the_planner_counts_a_dflash2_drafter_at_the_27b_shape():
    target = target_shape("27b")
    first, second = drafter_shape(target), drafter_shape(target, kind="dflash2")
    assert second.params - first.params == dflash2_extra_params(target.hidden, target.vocab, 5) == 194_191_360
    assert second.unit_params > first.unit_params  # a layer's convolutions are in the per-layer unit


def _saved_bytes(kind: str, B: int = 1, T: int = 512, N: int = 32, bs: int = 16) -> tuple[int, int]:
    """Bytes a drafter of `kind` keeps for its backward (saved tensors, parameters left out) over one forward
    under bf16 autocast on the CPU, and its rows x hidden x layers."""
    import dataclasses

    import torch

    from dflash.kinds import named
    from dflash.model.shapes import drafter_config

    shape = dict(hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1536, vocab=1000, target_layers=16)
    kind_ = named(kind)
    base = drafter_config(shape, 5, bs)
    config = kind_.config_class(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    torch.manual_seed(0)
    drafter = kind_.build(config)
    H = config.hidden_size
    context, embeds = torch.randn(B, T, len(config.target_layer_ids) * H), torch.randn(B, N * bs, H)
    anchors = torch.sort(torch.randperm(T - bs)[:N]).values.unsqueeze(0)
    params = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        drafter(context, embeds, anchors)
    return sum(saved.values()), B * N * bs * H * config.num_hidden_layers


def test_dflash2_layer_activation_surplus_is_what_its_layers_keep():
    """The memory model's DFlash2 surplus per layer x row x H (dflash.kinds.dflash2) is what a DFlash2
    drafter keeps for its backward beyond a DFlash drafter of the same shape, measured here, within 10 %."""
    from dflash.kinds import named

    (dflash, units), (dflash2, _) = _saved_bytes("dflash"), _saved_bytes("dflash2")
    measured = (dflash2 - dflash) / units
    declared = named("dflash2").layer_activation_surplus
    assert named("dflash").layer_activation_surplus == 0
    assert measured <= declared <= 1.1 * measured, (measured, declared)


def test_the_memory_check_refuses_the_dflash2_pack_that_ran_out_of_memory():
    """On an H100 (85.5 GB as torch sees it) with an FP8 27B target, DFlash2 on 8192-token packs ran with 512
    anchors and ran out of memory with 1,024: the model accepts the first and refuses the second; DFlash
    with 1,024 (which ran) fits."""
    from dflash.plan.memory import MicroBatch, rank_peaks

    target = target_shape("27b", precision="fp8")
    peak = {(kind, n): rank_peaks(target, drafter_shape(target, kind=kind), MicroBatch(1, 8192, n),
                                  "replicate")[0].total_gb
            for kind in ("dflash", "dflash2") for n in (512, 1024)}
    assert peak[("dflash2", 512)] < 85.5 < peak[("dflash2", 1024)]
    assert peak[("dflash", 1024)] < 85.5


def test_the_fewest_recomputed_layers_that_fit_the_dflash2_pack_are_named():
    """The same DFlash2 pack of 1,024 anchors: the memory model finds the fewest --recompute-layers with which
    it fits the H100 (a GPU run out of memory with 2 recomputed: the model puts that over the card too), and
    none once every layer is recomputed."""
    from dflash.plan.memory import MicroBatch, rank_peaks
    from dflash.plan.planner import fewest_recomputed_layers
    from dflash.plan.throughput import CARDS, Card

    target = target_shape("27b", precision="fp8")
    h100 = Card("85.5 GB visible", 85.5, CARDS["h200"].bf16_tflops, CARDS["h200"].link_gbps)
    mb = MicroBatch(1, 8192, 1024)
    r = fewest_recomputed_layers(target, drafter_shape(target, kind="dflash2"), mb, "replicate", 1, h100)
    assert r is not None and 1 <= r <= 5
    peak = {n: rank_peaks(target, drafter_shape(target, kind="dflash2", recompute=n), mb, "replicate")[0].total_gb
            for n in (r - 1, r)}
    assert peak[r] <= 85.5 < peak[r - 1]
    assert fewest_recomputed_layers(target, drafter_shape(target, kind="dflash2", recompute=5), mb, "replicate", 1,
                                    h100) is None  # nothing more to recompute
