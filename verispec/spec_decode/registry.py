"""The draft policy for a `speculative_config`: its drafter (one entry per method) and, with
adaptive verification, its controller."""

from __future__ import annotations

import logging

from verispec.config import EngineConfig, SpeculativeConfig
from verispec.models.llama import LlamaModel
from verispec.spec_decode.adaptive import AdaptiveController
from verispec.spec_decode.cost import CostModel
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.drafter import Drafter, NgramDrafter
from verispec.spec_decode.dspark_drafter import DSparkDrafter
from verispec.spec_decode.layer_skip import LayerSkipDrafter
from verispec.spec_decode.policy import DraftPolicy
from verispec.spec_decode.suffix import SuffixDrafter

logger = logging.getLogger("verispec")


def make_draft_policy(config: EngineConfig, target: LlamaModel, target_tokenizer, tp=None) -> DraftPolicy:
    """The engine's draft policy for `config.speculative` (not None), `config.max_model_len` set;
    `tp`: the target's tensor-parallel ranks, which a draft model is sharded over too."""
    spec = config.speculative
    drafter = make_drafter(spec, target, target_tokenizer, config, tp)
    adaptive = make_adaptive(config, target, drafter) if spec.adaptive_verification else None
    return DraftPolicy(drafter, spec.num_speculative_tokens, config.max_model_len, adaptive)


def make_drafter(cfg: SpeculativeConfig, target: LlamaModel, target_tokenizer, engine_config: EngineConfig,
                 tp=None) -> Drafter:
    """The drafter of `cfg.method` (validated by SpeculativeConfig: one of SPEC_METHODS)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "suffix":
        return SuffixDrafter(cfg)
    if cfg.method == "layer_skip":
        return LayerSkipDrafter(cfg, target.cfg.num_layers)
    if cfg.method in ("dspark", "dflash"):
        return DSparkDrafter(cfg, target, engine_config, tp)
    return DraftModelDrafter(cfg, target, target_tokenizer, engine_config, tp)


def make_adaptive(config: EngineConfig, model: LlamaModel, drafter: Drafter) -> AdaptiveController:
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
    return AdaptiveController(k, cost, exact_host_scores=not drafter.drafts_in_step,
                              calibrated=drafter.calibrated)
