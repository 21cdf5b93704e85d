"""The architecture facts (verispec/models/config.py) read from an HF config.json dict, against
values written by hand: defaults, the per-architecture switches, both places transformers keeps
rope parameters, EOS as one id or a list, and the errors that name an unsupported model."""

from __future__ import annotations

import pytest

from verispec.models.config import ModelConfig

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4}


def test_defaults_fill_what_a_llama_config_may_leave_out():
    cfg = ModelConfig.from_hf_dict(BASE)
    assert (cfg.architecture, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == ("llama", 4, 16, 10000.0)
    assert cfg.eos_token_ids == [] and cfg.rope_scaling is None and not cfg.attention_bias and not cfg.qk_norm


def test_architectures_switch_their_own_features():
    assert ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2"}).attention_bias
    qwen3 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_rope_parameters_are_read_from_either_place():
    old = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8}})
    new = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"] == 8
    plain = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}})
    assert plain.rope_scaling is None  # default rope is no scaling


def test_eos_is_one_id_or_a_list():
    assert ModelConfig.from_hf_dict({**BASE, "eos_token_id": 2}).eos_token_ids == [2]
    assert ModelConfig.from_hf_dict({**BASE, "eos_token_id": [2, 7]}).eos_token_ids == [2, 7]


def test_unsupported_models_are_named():
    with pytest.raises(ValueError, match="model architecture 'gpt2' is not supported; supported: llama"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        ModelConfig.from_hf_dict({**BASE, "num_key_value_heads": 3})
