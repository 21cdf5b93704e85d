"""The drafter for a `speculative_config` (one entry per method), and its adaptive controller."""

from __future__ import annotations

import logging

from verispec.config import EngineConfig, SpeculativeConfig
from verispec.models.llama import LlamaModel
from verispec.spec_decode.adaptive import AdaptiveController, CostModel
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.drafter import ModelDrafter, NgramDrafter
from verispec.spec_decode.layer_skip import LayerSkipDrafter
from verispec.spec_decode.suffix import SuffixDrafter

logger = logging.getLogger("verispec")


def make_drafter(cfg: SpeculativeConfig, target: LlamaModel, target_tokenizer,
                 engine_config: EngineConfig) -> NgramDrafter | SuffixDrafter | ModelDrafter:
    """The drafter of `cfg.method` (validated by SpeculativeConfig: one of SPEC_METHODS)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "suffix":
        return SuffixDrafter(cfg)
    if cfg.method == "layer_skip":
        return LayerSkipDrafter(cfg, target.cfg.num_layers)
    return DraftModelDrafter(cfg, target, target_tokenizer, engine_config)


def make_adaptive(config: EngineConfig, model: LlamaModel, drafter: NgramDrafter | ModelDrafter) -> AdaptiveController:
    """Adaptive verification's controller: the cost table given, or profiled on `model` now."""
    spec = config.speculative
    k = spec.num_speculative_tokens
    if spec.cost_table is not None:
        cost = CostModel([int(n) for n, _ in spec.cost_table], [float(t) for _, t in spec.cost_table])
    else:
        most = min(config.max_num_batched_tokens, config.max_num_seqs * (k + 1))
        cost = CostModel.profile(model, config.block_size, most, config.device)
        logger.info("adaptive verification cost table: %s",
                    ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in zip(cost.tokens, cost.seconds)))
    return AdaptiveController(k, cost, exact_host_scores=not drafter.needs_forward)
