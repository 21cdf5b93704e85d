"""A GGUF file's model facts and tensor table, read once and cached.

gguf's reader parses every metadata field of the file before it returns, the tokenizer's
vocabulary and merges included (about 100,000 strings, 5 s for SmolLM2 on 2 cores), while a start
needs a few numbers and where each tensor lies. So the first start reads the file with gguf and
saves the model config and the tensor table under verispec's cache (keyed by the file's path,
size and mtime, like the converted tokenizer); later starts read that and map the file's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from verispec.models.config import ModelConfig

_VERSION = 2  # bump when the cached layout changes


@dataclass(slots=True)
class GGUFTensor:
    name: str
    kind: str  # gguf's GGMLQuantizationType name: Q4_1, Q8_0, F32, ...
    shape: list[int]  # [out, in]: GGUF lists dims innermost-first
    offset: int  # of its data, in bytes from the start of the file
    n_bytes: int


def file_key(path: Path, *extra: str) -> str:
    """A cache key for what was derived from the file at `path`: its path, size and mtime."""
    stat = path.stat()
    return hashlib.sha256(":".join([str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *extra]).encode()
                          ).hexdigest()[:16]


def read_index(path: Path, config_of: Callable[[Any], ModelConfig],
               cache: Path | None) -> tuple[ModelConfig, list[GGUFTensor]]:
    """The file's config (`config_of(reader)` on a first read) and tensor table."""
    cached = cache / "gguf" / f"{file_key(path, str(_VERSION))}.json" if cache is not None else None
    if cached is not None and cached.exists():
        try:
            saved = json.loads(cached.read_text())
            return ModelConfig(**saved["config"]), [GGUFTensor(**t) for t in saved["tensors"]]
        except (OSError, ValueError, TypeError, KeyError):  # a damaged entry is rebuilt below
            pass
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    cfg = config_of(reader)
    tensors = [GGUFTensor(t.name, t.tensor_type.name, [int(d) for d in reversed(t.shape)], int(t.data_offset),
                          int(t.n_bytes)) for t in reader.tensors]
    if cached is not None:
        _save(cached, {"config": dataclasses.asdict(cfg), "tensors": [dataclasses.asdict(t) for t in tensors]})
    return cfg, tensors


def _save(target: Path, content: dict) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(content))
        os.replace(tmp, target)  # atomic: a concurrent start reads a whole file or none
    except OSError:  # a read-only home is not an error, only slower next time
        pass
