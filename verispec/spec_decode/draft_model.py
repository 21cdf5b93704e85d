"""A separate, smaller draft model with the target's tokenizer.

It keeps its own KV cache tensors but shares the target's block tables: a position lives in the
same slot in both caches. Every step the draft model also runs over the target's flat batch
(prefill chunks and verify rows), so its cache holds every position the target's does, including
a fully accepted last draft that the drafting steps never fed.
"""

from __future__ import annotations

import torch

from verispec.config import SpeculativeConfig
from verispec.distributed.executor import build_model
from verispec.models.kv_cache_tensors import KVCacheTensors
from verispec.models.loader import load_checkpoint, resolve_model_path
from verispec.models.tokenizer_cache import load_tokenizer
from verispec.spec_decode.drafter import DraftInputs, ModelDrafter


class DraftModelDrafter(ModelDrafter):
    def __init__(self, cfg: SpeculativeConfig, target, target_tokenizer, engine_config, tp=None):
        # The target's tier; a "gguf" target with an HF draft runs the draft dense in that dtype.
        quantization = engine_config.quantization
        if quantization == "gguf" and not resolve_model_path(cfg.model).is_file():
            quantization = None
        model_cfg, weights = load_checkpoint(cfg.model, engine_config.dtype, quantization)
        model_cfg.rope_context = engine_config.max_model_len  # as the target's (LongRoPE)
        if model_cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"speculative_config.model has a vocabulary of {model_cfg.vocab_size} tokens but the "
                f"target has {target.cfg.vocab_size}: the draft model must share the target's tokenizer"
            )
        tokenizer = load_tokenizer(cfg.model)
        if tokenizer is not None and target_tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError("speculative_config.model uses a different tokenizer from the target's")
        # Sharded like the target under tensor parallelism (the same ranks `tp`, its own shards).
        self.model = build_model(model_cfg, weights, cfg.model, engine_config.dtype, quantization,
                                 engine_config.device, tp)
        self.kv: KVCacheTensors | None = None

    def model_and_cache(self, inputs: DraftInputs):
        if self.kv is None:
            self.kv = self.model.new_kv_cache(inputs.num_blocks, inputs.block_size)
        return self.model, self.kv.layers

    @torch.inference_mode()
    def observe(self, inputs: DraftInputs, input_ids, positions, meta) -> None:
        model, kv_layers = self.model_and_cache(inputs)
        model(input_ids, positions, meta, kv_layers)
