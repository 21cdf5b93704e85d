"""The self-speculative drafter (verispec/spec_decode/layer_skip.py): it refuses more layers than the
target has, and it drafts with the target's own model and KV cache (nothing of its own to keep in
step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verispec.config import SpeculativeConfig
from verispec.spec_decode.layer_skip import LayerSkipDrafter


def test_layer_skip_refuses_more_layers_than_the_target_has():
    with pytest.raises(ValueError, match="num_layers=9 exceeds the target's 4 layers"):
        LayerSkipDrafter(SpeculativeConfig(method="layer_skip", num_layers=9), 4)


def test_all_of_the_targets_layers_is_still_a_drafter():
    # The bound is inclusive: num_layers equal to the target's is allowed (a check of < would refuse it).
    assert LayerSkipDrafter(SpeculativeConfig(method="layer_skip", num_layers=4), 4).num_layers == 4


def test_it_drafts_on_the_targets_model_and_cache():
    drafter = LayerSkipDrafter(SpeculativeConfig(method="layer_skip", num_layers=1), 2)
    target, target_kv = object(), [object()]
    model, kv = drafter.model_and_cache(SimpleNamespace(target=target, target_kv=target_kv))
    assert model is target and kv is target_kv
