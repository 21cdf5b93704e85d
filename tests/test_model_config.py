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


def test_sliding_windows_come_from_layer_types_or_the_familys_pattern():
    listed = ModelConfig.from_hf_dict({**BASE, "model_type": "gemma2", "sliding_window": 8,
                                       "layer_types": ["full_attention", "sliding_attention"]})
    assert [listed.window(i) for i in range(2)] == [0, 8]
    gemma3 = ModelConfig.from_hf_dict({**BASE, "model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 4})
    assert [gemma3.window(i) for i in range(7)] == [4, 4, 4, 4, 4, 0, 4]  # five of six slide
    mistral = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 16})
    assert mistral.window(0) == mistral.window(1) == 16  # every layer
    qwen2 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False})
    assert qwen2.window(0) == 0
    assert ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": None}).window(0) == 0


def test_gemma3_reads_each_layer_types_rope_and_phi_its_partial_longrope():
    per_type = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    new = ModelConfig.from_hf_dict({**BASE, "model_type": "gemma3_text", "rope_parameters": per_type})
    old = ModelConfig.from_hf_dict({**BASE, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    for cfg in (new, old):
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
        assert cfg.qk_norm
    phi = ModelConfig.from_hf_dict({**BASE, "model_type": "phi3", "partial_rotary_factor": 0.75,
                                    "original_max_position_embeddings": 4096,
                                    "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}})
    assert phi.rotary_dim == 12 and phi.rope_scaling["original_max_position_embeddings"] == 4096
    assert phi.part_rows("q") == 64 and phi.part_rows("gate") == 128


def test_gemma_scales_and_caps():
    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "gemma2", "query_pre_attn_scalar": 144,
                                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert (cfg.query_scalar, cfg.attn_softcap, cfg.final_softcap) == (144, 50.0, 30.0)
