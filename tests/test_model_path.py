"""What `model=` names (models/model_path.py)."""

from __future__ import annotations

import pytest
import torch

from verispec.models.loader import load_checkpoint
from verispec.models.model_path import ModelNotFoundError, resolve_model_path


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_checkpoint(str(tmp_path / "nope"), torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path / "empty"), torch.float32)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_a_directory_holding_one_gguf_file_names_it(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "model.Q4_K_M.gguf").write_bytes(b"")
    assert resolve_model_path(str(tmp_path / "one")) == tmp_path / "one" / "model.Q4_K_M.gguf"
    (tmp_path / "one" / "model.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):  # two: which one is not guessed
        resolve_model_path(str(tmp_path / "one"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path / "hf")) == tmp_path / "hf"
