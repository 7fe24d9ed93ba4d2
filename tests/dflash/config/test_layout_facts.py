"""A layout is its facts (dflash.config.layout): every combination of them is either built by the code or refused
by what is missing, as the layout is made, before any option is parsed or weight loaded."""

from __future__ import annotations

import itertools

import pytest

from dflash.config.layout import ALL, IMPLEMENTED, UNIMPLEMENTED, Layout
from dflash.errors import ConfigError


def test_every_combination_of_facts_is_built_or_refused():
    combos = set(itertools.product((False, True), repeat=3))
    assert set(IMPLEMENTED) | set(UNIMPLEMENTED) == combos and not set(IMPLEMENTED) & set(UNIMPLEMENTED)
    assert {(lay.shards_drafter, lay.state_on_host, lay.target_in_stages) for lay in ALL} == set(IMPLEMENTED)


@pytest.mark.parametrize("facts", sorted(UNIMPLEMENTED), ids=str)
def test_a_layout_of_unbuilt_facts_is_refused_by_what_is_missing(facts):
    shards, host, stages = facts
    with pytest.raises(ConfigError, match=r"layout 'x': .*; the layouts that run are replicate"):
        Layout("x", shards_drafter=shards, state_on_host=host, target_in_stages=stages)
