"""Checkpoints, precisions and tokenizers (models/loader.py)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from verispec.models.loader import ModelNotFoundError, load_checkpoint, load_tokenizer, resolve_precision


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_checkpoint(str(tmp_path / "nope"), torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path / "empty"), torch.float32)


def test_auto_precision_is_the_fast_tier_on_gguf_and_the_checkpoints_own_dtype_elsewhere(smollm2_path, tiny_llama):
    assert resolve_precision(smollm2_path, None, None) == (torch.bfloat16, "gguf")
    assert resolve_precision(smollm2_path, torch.float32, "gguf") == (torch.float32, "gguf")  # exact, on the codes
    assert resolve_precision(tiny_llama, None, "int4") == (torch.bfloat16, "int4")
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        resolve_precision(tiny_llama, None, "gguf")
    with pytest.raises(ValueError, match="computes in bfloat16"):
        resolve_precision(tiny_llama, torch.float32, "int8")


def test_a_damaged_tokenizer_cache_is_rebuilt(smollm2_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    first = load_tokenizer(smollm2_path)
    (cached,) = [p for p in (tmp_path / "tokenizers").iterdir() if p.is_dir()]
    assert not [p for p in (tmp_path / "tokenizers").iterdir() if ".tmp" in p.name]  # nothing left behind
    (cached / "tokenizer.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="verispec"):
        again = load_tokenizer(smollm2_path)
    assert "rebuilding the cached tokenizer" in caplog.text
    assert again.encode("Hello, world") == first.encode("Hello, world")
    assert load_tokenizer(smollm2_path).encode("Hello") == first.encode("Hello")  # the rebuilt entry loads


def test_another_file_with_the_same_vocabulary_reuses_its_tokenizer(smollm2_path, tmp_path, monkeypatch, caplog):
    """A copy (a new path: another quantization of the same model reads the same) finds the
    tokenizer converted for the first file, and converts nothing."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    first = load_tokenizer(smollm2_path)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_path, copy)
    caplog.clear()  # the first file's conversion may be captured (an earlier test can leave INFO on)
    with caplog.at_level(logging.INFO, logger="verispec"):
        again = load_tokenizer(str(copy))
    assert "reading the tokenizer" not in caplog.text
    assert again.encode("Hello, world") == first.encode("Hello, world")
    assert again.chat_template == first.chat_template
    assert len([p for p in (tmp_path / "cache" / "tokenizers").iterdir() if p.is_dir()]) == 1


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


def test_two_processes_starting_together_convert_a_tokenizer_once(smollm2_path, tmp_path):
    """A server's frontend and its engine core load the tokenizer at the same moment: one converts,
    the other waits and loads its result."""
    import os
    import subprocess
    import sys

    code = ("import logging, sys\nlogging.basicConfig(level=logging.INFO)\n"
            "from verispec.models.loader import load_tokenizer\n"
            "print(load_tokenizer(sys.argv[1]).encode('Hello, world'))\n")
    env = dict(os.environ, VERISPEC_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, smollm2_path], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1000:] for _, err in outs]
    assert sum(err.count("reading the tokenizer") for _, err in outs) == 1
    assert outs[0][0] == outs[1][0]
