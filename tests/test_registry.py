"""The drafter registry (verispec/spec_decode/registry.py): each `speculative_config.method` gets its
own drafter class, built from the config and the target's facts (a stand-in target: no weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verispec.config import SpeculativeConfig
from verispec.spec_decode.drafter import NgramDrafter
from verispec.spec_decode.layer_skip import LayerSkipDrafter
from verispec.spec_decode.registry import make_drafter


def test_the_registry_builds_each_methods_drafter():
    target = SimpleNamespace(cfg=SimpleNamespace(num_layers=4))
    assert isinstance(make_drafter(SpeculativeConfig(), target, None, None), NgramDrafter)
    skip = make_drafter(SpeculativeConfig(method="layer_skip", num_layers=2), target, None, None)
    assert isinstance(skip, LayerSkipDrafter) and skip.num_layers == 2 and skip.drafts_in_step


def test_layer_skip_is_checked_against_the_targets_own_layer_count():
    # The registry passes the target's layer count, not a default: 4 layers refuse num_layers=5.
    target = SimpleNamespace(cfg=SimpleNamespace(num_layers=4))
    with pytest.raises(ValueError, match="exceeds the target's 4 layers"):
        make_drafter(SpeculativeConfig(method="layer_skip", num_layers=5), target, None, None)
