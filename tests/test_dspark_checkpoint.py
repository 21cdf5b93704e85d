"""DSpark / DFlash checkpoints (verispec/models/dspark_checkpoint.py): both places the exports keep
the drafter's fields, their tensor names, and a clear error for every way a checkpoint can fail
to fit its target."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file, save_file

from dspark_checkpoints import MASK, make_dspark_checkpoint
from verispec.models.config import ModelConfig
from verispec.models.dspark_checkpoint import check_against_target, read_dspark_checkpoint

TARGET = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}


def target_cfg(**over) -> ModelConfig:
    return ModelConfig.from_hf_dict({**TARGET, **over})


@pytest.mark.parametrize("top_level", [False, True], ids=["dflash_config", "top_level"])
@pytest.mark.parametrize("prefix", ["", "model."])
def test_fields_and_names_read_from_either_place(tmp_path, top_level, prefix):
    path = make_dspark_checkpoint(tmp_path / "d", TARGET, top_level=top_level, prefix=prefix, block=5, rank=8)
    cfg, tensors = read_dspark_checkpoint(path)
    assert cfg.target_layer_ids == (0, 2) and cfg.mask_token_id == MASK and cfg.block_size == 5
    assert cfg.markov_rank == 8 and cfg.confidence_head and cfg.confidence_with_markov
    assert cfg.sample_from_anchor and cfg.first_slot == 0 and cfg.max_drafts == 5 and cfg.is_dspark
    assert cfg.layers.qk_norm and cfg.layers.num_layers == 1 and cfg.layers.head_dim == 16
    assert "markov_w1.weight" in tensors and "markov_w2.weight" in tensors
    check_against_target(cfg, tensors, target_cfg())


def test_a_checkpoint_without_heads_is_dflash_with_mask_slots(tmp_path):
    cfg, _ = read_dspark_checkpoint(make_dspark_checkpoint(tmp_path / "d", TARGET, rank=0, confidence=False, block=4))
    assert not cfg.is_dspark and not cfg.sample_from_anchor and cfg.first_slot == 1 and cfg.max_drafts == 3
    cfg, _ = read_dspark_checkpoint(make_dspark_checkpoint(tmp_path / "e", TARGET, rank=0, confidence=False,
                                                           anchor=True))
    assert cfg.sample_from_anchor and cfg.max_drafts == 4


def test_confidence_head_without_markov_input(tmp_path):
    path = make_dspark_checkpoint(tmp_path / "d", TARGET, rank=0, confidence=True)
    cfg, _ = read_dspark_checkpoint(path)
    assert cfg.confidence_head and not cfg.confidence_with_markov and cfg.markov_rank == 0


def rewrite(path, config=None, drop=(), add=None):
    if config is not None:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        config(raw)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
    t = load_file(os.path.join(path, "model.safetensors"))
    t = {k: v for k, v in t.items() if k not in drop} | (add or {})
    save_file(t, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("breakage, message", [
    (dict(config=lambda c: c["dflash_config"].pop("mask_token_id")), "mask_token_id"),
    (dict(config=lambda c: c.update(markov_head_type="rnn")), "markov_head_type 'rnn' is not supported"),
    (dict(drop=["layers.0.mlp.up_proj.weight"]), "layers.0.mlp.up_proj.weight"),
    (dict(drop=["markov_head.markov_w2.weight"]), "markov_w2"),
    (dict(config=lambda c: c.update(block_size=1)), "block_size"),
])
def test_broken_checkpoints_name_what_is_wrong(tmp_path, breakage, message):
    path = make_dspark_checkpoint(tmp_path / "d", TARGET)
    rewrite(path, **breakage)
    with pytest.raises(ValueError, match=message):
        read_dspark_checkpoint(path)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        read_dspark_checkpoint(tmp_path)


@pytest.mark.parametrize("target, kw, message", [
    (dict(num_hidden_layers=3), {}, "target_layer_ids"),  # layer 2 is the last of 3
    (dict(hidden_size=128), {}, "hidden_size"),
    (dict(vocab_size=600), {"rank": 0}, "no d2t map"),
    (dict(vocab_size=600), {"draft_vocab": 100}, "markov_w1"),
    (dict(vocab_size=3), {"rank": 0}, "mask_token_id"),
])
def test_a_drafter_for_another_target_is_refused(tmp_path, target, kw, message):
    cfg, tensors = read_dspark_checkpoint(make_dspark_checkpoint(tmp_path / "d", TARGET, **kw))
    with pytest.raises(ValueError, match=message):
        check_against_target(cfg, tensors, target_cfg(**target))
