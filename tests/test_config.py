"""Engine options (config.py): one home for each, errors that name the option."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from conftest import run_fresh
from verispec.config import EngineConfig, LogprobsMode, SpeculativeConfig, user_options


def test_every_user_option_is_a_config_field_and_create_takes_it():
    names = {f.name for f in fields(EngineConfig)}
    for opt in user_options():
        assert (opt.name if opt.name != "speculative_config" else "speculative") in names
        assert opt.help and (opt.choices is None or opt.default in (*opt.choices, None))
    cfg = EngineConfig.create(**{o.name: o.default for o in user_options()})  # the defaults as users write them
    assert cfg.dtype is None and cfg.device.type in ("cpu", "cuda") and cfg.logprobs_mode is LogprobsMode.RAW_LOGPROBS
    assert cfg.speculative is None and cfg.max_num_seqs == EngineConfig().max_num_seqs


def test_user_values_resolve_and_bad_ones_are_named():
    cfg = EngineConfig.create(dtype="bf16", device="cpu", logprobs_mode="processed_logits",
                              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert cfg.dtype is torch.bfloat16 and cfg.logprobs_mode is LogprobsMode.PROCESSED_LOGITS
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=4)
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['max_num_seq'\]"):
        EngineConfig.create(max_num_seq=3)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineConfig.create(logprobs_mode="logits")
    for bad, field in [({"max_num_seqs": 0}, "max_num_seqs"), ({"num_kv_blocks": 0}, "num_kv_blocks"),
                       ({"quantization": "q2"}, "quantization"), ({"max_logprobs": -2}, "max_logprobs"),
                       ({"prompt_logprobs_cache_bytes": -1}, "prompt_logprobs_cache_bytes")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig.create(**bad).validate()


@pytest.mark.parametrize("spec, field", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"k": 3}, "unknown keys"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "layer_skip"}, "num_layers"),
    ({"cost_table": [[0, 1.0]]}, "cost_table"),
    ({"max_verify_rows_per_chunk": 0}, "max_verify_rows_per_chunk"),
])
def test_a_bad_speculative_config_names_its_field(spec, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(spec)


def test_a_frontend_config_keeps_dtype_and_device_as_names_until_the_engine_resolves_them():
    """`verispec serve`'s frontend: the names are checked in form, torch is not imported, and the
    engine's `validate` turns them into torch's."""
    code = ("import sys\nfrom verispec.config import EngineConfig\n"
            "c = EngineConfig.create(dtype='bf16', device='auto', resolve=False)\nc.validate(resolve=False)\n"
            "assert (c.dtype, c.device) == ('bfloat16', 'auto') and 'torch' not in sys.modules\n"
            "c.validate()\nimport torch\nassert c.dtype == torch.bfloat16 and c.device.type in ('cpu', 'cuda')\n")
    run_fresh(code)
    for bad in ({"device": "tpu"}, {"dtype": "int3"}):
        with pytest.raises(ValueError, match="device must be|dtype must be"):
            EngineConfig.create(resolve=False, **bad)
