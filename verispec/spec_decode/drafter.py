"""Drafters: after each step, propose draft tokens for the requests that are decoding."""

from __future__ import annotations

from verispec.config import SpeculativeConfig
from verispec.engine.request import Request
from verispec.spec_decode.ngram import propose_ngram


class NgramDrafter:
    needs_forward = False

    def __init__(self, cfg: SpeculativeConfig):
        self.k = cfg.num_speculative_tokens
        self.n_min, self.n_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, running: list[Request], max_model_len: int) -> None:
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # still prefilling: nothing to speculate on yet
            # No draft past the request's own limits: it could never be emitted.
            room = min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens, self.k)
            if room > 0:
                req.spec_tokens = propose_ngram(req.token_ids, room, self.n_min, self.n_max)


def make_drafter(cfg: SpeculativeConfig, num_target_layers: int):
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "layer_skip":
        from verispec.spec_decode.layer_skip import LayerSkipDrafter

        return LayerSkipDrafter(cfg, num_target_layers)
    raise ValueError(
        f"speculative_config.method {cfg.method!r} is not available yet; this version implements 'ngram' and 'layer_skip'"
    )
