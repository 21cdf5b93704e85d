"""What `model=` names: an HF checkpoint directory or a .gguf file, resolved without importing torch
(the tokenizer and the server's frontend need the path before, or without, any weights)."""

from __future__ import annotations

from pathlib import Path


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str) -> Path:
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} not found: pass an HF checkpoint directory (config.json + "
            "*.safetensors) or a .gguf file; verispec never downloads weights"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"model file {str(path)!r} is not a .gguf file")
    return path
