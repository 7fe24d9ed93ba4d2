"""The planner counts a DFlash2 drafter: its parameters are DFlash's plus the convolutions and the selector."""

from dflash.model.dflash2 import dflash2_extra_params
from dflash.plan.sizes import drafter_shape, target_shape


def test_the_planner_counts_a_dflash2_drafter_at_the_27b_shape():
    target = target_shape("27b")
    first, second = drafter_shape(target), drafter_shape(target, kind="dflash2")
    assert second.params - first.params == dflash2_extra_params(target.hidden, target.vocab, 5) == 194_191_360
    assert second.unit_params > first.unit_params  # a layer's convolutions are in the per-layer unit
