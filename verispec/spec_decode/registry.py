"""The drafter for a `speculative_config`: one entry per method."""

from __future__ import annotations

from verispec.config import EngineConfig, SpeculativeConfig
from verispec.models.llama import LlamaModel
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.drafter import ModelDrafter, NgramDrafter
from verispec.spec_decode.layer_skip import LayerSkipDrafter


def make_drafter(cfg: SpeculativeConfig, target: LlamaModel, target_tokenizer,
                 engine_config: EngineConfig) -> NgramDrafter | ModelDrafter:
    """The drafter of `cfg.method` (validated by SpeculativeConfig: one of SPEC_METHODS)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "layer_skip":
        return LayerSkipDrafter(cfg, target.cfg.num_layers)
    return DraftModelDrafter(cfg, target, target_tokenizer, engine_config)
