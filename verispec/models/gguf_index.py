"""A GGUF file's model facts and tensor table, read once and cached.

gguf's reader makes a numpy view of every part of every metadata field, the tokenizer's
vocabulary and merges included (about 100,000 strings: 3-6 s for SmolLM2), while a start needs a
few numbers and where each tensor lies. So the header is read here (`GGUFHeader`: the format's
key-value pairs and tensor table, strings read with `struct` in one pass, 0.1 s), and the model
config and tensor table are saved under verispec's cache (keyed by the file's path, size and
mtime, like the converted tokenizer); later starts read that and map the file's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from verispec.models.config import ModelConfig

_VERSION = 3  # bump when the cached layout (or how it is read) changes


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
    reader = GGUFHeader.read(path)
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


# GGUF's value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class HeaderTensor:
    """One tensor of the table, with the attributes the config reads (gguf's reader names)."""

    name: str
    shape: list[int]  # GGUF's order: innermost first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int
    path: Path

    @property
    def data(self) -> np.ndarray:  # F32 tensors only (LongRoPE's factors)
        return np.memmap(self.path, dtype=np.float32, mode="r", offset=self.data_offset, shape=(self.n_bytes // 4,))


@dataclass(slots=True)
class GGUFHeader:
    """A GGUF file's key-value pairs (`fields`: key -> Python value, arrays as lists) and tensors."""

    fields: dict[str, Any] = field(default_factory=dict)
    tensors: list[HeaderTensor] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> "GGUFHeader":
        """Version 2 and 3 files (little-endian), as llama.cpp writes them."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as fh:
            buf = fh.read(1 << 20)
            reader = _Cursor(buf, fh)
            magic, version, n_tensors, n_kv = reader.unpack("<4sIQQ")
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
            header = cls()
            for _ in range(n_kv):
                key = reader.string()
                header.fields[key] = reader.value(reader.unpack("<I")[0])
            infos = []
            for _ in range(n_tensors):
                name = reader.string()
                (dims,) = reader.unpack("<I")
                shape = list(reader.unpack(f"<{dims}Q"))
                kind, offset = reader.unpack("<IQ")
                infos.append((name, shape, GGMLQuantizationType(kind), offset))
            align = int(header.fields.get("general.alignment", 32))
            start = -(-reader.offset // align) * align
        for name, shape, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape, dtype=np.int64)) // block * size
            header.tensors.append(HeaderTensor(name, shape, kind, start + offset, n_bytes, path))
        return header


class _Cursor:
    """Reads the header from a growing buffer (a 262k-token vocabulary is tens of MB)."""

    def __init__(self, buf: bytes, fh):
        self.buf, self.fh, self.pos, self.base = buf, fh, 0, 0  # base: the file offset of buf[0]

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            more = self.fh.read(max(n, len(self.buf)))
            if self.pos + n > len(self.buf) + len(more):
                raise ValueError("the GGUF header ends early (a truncated file)")
            self.base += self.pos
            self.buf = self.buf[self.pos:] + more
            self.pos = 0

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self._need(size)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self._need(n)
        text = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.unpack("<IQ")
            if item in _SCALARS:
                return list(self.unpack(f"<{n}{_SCALARS[item]}"))
            return [self.value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"GGUF value type {kind} is not one of the format's")
        return self.unpack(f"<{_SCALARS[kind]}")[0]
