"""Self-speculative drafting: the target's first L layers, its final norm and its lm_head.

Drafting writes those layers' k/v into the target's own cache at the draft positions; the verify
forward then rewrites the same slots from the same inputs, so the drafter needs no cache of its
own and nothing to roll back. Drafts are drawn from the request's own processor chain (same
temperature, top-k, top-p) with its `draft` stream, and q goes to verification.
"""

from __future__ import annotations

from verispec.config import SpeculativeConfig
from verispec.spec_decode.drafter import DraftInputs, ModelDrafter


class LayerSkipDrafter(ModelDrafter):
    def __init__(self, cfg: SpeculativeConfig, num_target_layers: int):
        if cfg.num_layers > num_target_layers:
            raise ValueError(
                f"speculative_config.num_layers={cfg.num_layers} exceeds the target's {num_target_layers} layers"
            )
        self.num_layers = cfg.num_layers

    def model_and_cache(self, inputs: DraftInputs):
        return inputs.target, inputs.target_kv
