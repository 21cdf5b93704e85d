"""Checkpoints and precisions (models/loader.py)."""

from __future__ import annotations


import pytest
import torch

from verispec.models.loader import load_checkpoint, resolve_precision


def test_auto_precision_is_the_fast_tier_on_gguf_and_the_checkpoints_own_dtype_elsewhere(smollm2_path, tiny_llama):
    assert resolve_precision(smollm2_path, None, None) == (torch.bfloat16, "gguf")
    assert resolve_precision(smollm2_path, torch.float32, "gguf") == (torch.float32, "gguf")  # exact, on the codes
    assert resolve_precision(tiny_llama, None, "int4") == (torch.bfloat16, "int4")
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        resolve_precision(tiny_llama, None, "gguf")
    with pytest.raises(ValueError, match="computes in bfloat16"):
        resolve_precision(tiny_llama, torch.float32, "int8")


def test_weight_kinds_names_the_kept_types_and_those_re_quantized():
    """The start-up line's account of a GGUF file's matrices: the types kept as the file's blocks,
    then the types verispec has no kernel for, which it re-quantizes to 8 bits: never silently."""
    import numpy as np

    from verispec.models.gguf_blocks import GGUFBlocks
    from verispec.models.loader import weight_kinds
    from verispec.models.quant import quantize_rtn

    dense = torch.randn(32, 256)
    weights = {"layers.0.q": GGUFBlocks.of(np.zeros((32, 144), np.uint8), "Q4_K", (32, 256)),
               "layers.0.v": GGUFBlocks.of(np.zeros((32, 210), np.uint8), "Q6_K", (32, 256)),
               "layers.0.k": quantize_rtn(dense, 8, source="IQ4_XS"), "norm": torch.ones(256)}
    assert weight_kinds(weights) == "Q4_K, Q6_K; IQ4_XS re-quantized to 8 bits"
    assert weight_kinds({"embed": dense}) == ""
