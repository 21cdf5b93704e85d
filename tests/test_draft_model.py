"""The separate draft model (verispec/spec_decode/draft_model.py): it must share the target's
vocabulary and tokenizer (a clear error names what differs), and it keeps a KV cache of its own,
made once, on the target's block layout. Checked on the tiny random checkpoints of conftest.py."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_checkpoint
from verispec import LLM
from verispec.config import SpeculativeConfig
from verispec.models.tokenizer_cache import load_tokenizer
from verispec.spec_decode.draft_model import DraftModelDrafter

ENGINE = SimpleNamespace(quantization=None, dtype=torch.float32, device=torch.device("cpu"), max_model_len=None)


def drafter_for(draft_path: str, target_path: str, vocab_size: int = 512) -> DraftModelDrafter:
    target = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab_size))
    cfg = SpeculativeConfig(method="draft_model", model=draft_path)
    return DraftModelDrafter(cfg, target, load_tokenizer(target_path), ENGINE)


def test_draft_model_vocab_mismatch_is_a_clear_error(tiny_llama, tmp_path):
    wrong = make_tiny_checkpoint(tmp_path / "w", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama, speculative_config={"method": "draft_model", "model": wrong})
    with pytest.raises(ValueError, match="model"):
        LLM(tiny_llama, speculative_config={"method": "draft_model"})


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(tiny_with_tokenizer, tmp_path):
    # Same vocabulary size, other token strings: the size check alone would let it through.
    other = tmp_path / "other"
    shutil.copytree(tiny_with_tokenizer, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {f"u{i}": i for i in range(512)}
    spec["model"]["unk_token"] = "u0"
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="different tokenizer"):
        drafter_for(str(other), tiny_with_tokenizer)


def test_the_draft_keeps_one_cache_of_its_own_sized_like_the_targets(tiny_with_tokenizer):
    drafter = drafter_for(tiny_with_tokenizer, tiny_with_tokenizer)
    inputs = SimpleNamespace(num_blocks=6, block_size=16)
    model, layers = drafter.model_and_cache(inputs)
    assert model is drafter.model and len(layers) == model.cfg.num_layers
    assert layers[0].v.shape[:2] == (6, 16)  # [blocks, block_size, kv_heads, head_dim]
    # A second call reuses it: the cache holds every position drafted or observed so far.
    assert drafter.model_and_cache(inputs)[1] is layers
