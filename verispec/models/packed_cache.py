"""The fast tier's packed layouts of a GGUF file, saved after its first load and mapped at the next.

Packing a file's rows into the kernel's layout (`GGUFBlocks.packed`: the C++ op `gguf_pack`, plus
reading the rows) is most of building a model: 2 s of a 1B Q4_K_M file's 3, where the engine's
other start-up work is a fraction of a second. So a build inside `layouts_of(path)` saves every
packed matrix, in build order, to one file under verispec's cache (`packed/<key>/`, beside the
Inductor cache), and the next build maps that file (copy-on-write: an in-place weight update
writes private pages, never the cache) instead of packing.

The key is the GGUF file (path, size, mtime), the kernels' library (the layout is theirs) and the
sources that decide what is packed in which order; each entry also names its type and shape, and a
build that meets another one packs from there on and drops the saved layouts. A build that
packed everything itself saves them, atomically, once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from verispec import envs
from verispec.models.cpu_kernels import kernel_build
from verispec.models.gguf_index import file_key

logger = logging.getLogger("verispec")

_ALIGN = 64
# The sources that decide which matrices are packed, how, and in which order.
_SOURCES = ("gguf_blocks.py", "loader.py", "architectures.py", "linear.py", "llama.py", "packed_cache.py")
Packed = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


@dataclass(slots=True)
class PackedLayouts:
    """One model build's packed matrices: taken from the saved file while they match, else made."""

    directory: Path
    saved: list[dict] | None = None  # the saved entries, or None
    blob: np.ndarray | None = None
    made: list[tuple[str, tuple[int, int], Packed]] = field(default_factory=list)
    taken: int = 0
    broken: bool = False  # an entry did not match: the rest is made, nothing is saved

    def take(self, kind: str, shape: tuple[int, int], make: Callable[[], Packed]) -> Packed:
        i = self.taken + len(self.made)
        if self.saved is not None and not self.broken and i < len(self.saved):
            entry = self.saved[i]
            if entry["kind"] == kind and tuple(entry["shape"]) == tuple(shape):
                self.taken += 1
                return tuple(self._tensor(t) for t in entry["tensors"])
            self.broken = True
            logger.info("the saved packed layouts of this file are stale; packing it again")
        packed = make()
        self.made.append((kind, tuple(shape), packed))
        return packed

    def _tensor(self, spec: list | None) -> torch.Tensor | None:
        if spec is None:
            return None
        offset, dtype, shape = spec
        size = int(np.prod(shape)) * getattr(torch, dtype).itemsize
        return torch.from_numpy(self.blob[offset:offset + size]).view(getattr(torch, dtype)).view(shape)

    def close(self) -> None:
        if self.broken:
            shutil.rmtree(self.directory, ignore_errors=True)
        elif self.saved is None and self.made:
            _save(self.directory, self.made)


def _save(directory: Path, made: list[tuple[str, tuple[int, int], Packed]]) -> None:
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        entries, offset = [], 0
        with open(tmp / "layouts.bin", "wb") as fh:
            for kind, shape, tensors in made:
                specs = []
                for t in tensors:
                    if t is None:
                        specs.append(None)
                        continue
                    data = t.contiguous().view(torch.uint8).numpy().tobytes()
                    pad = -offset % _ALIGN
                    fh.write(b"\0" * pad)
                    offset += pad
                    specs.append([offset, str(t.dtype).removeprefix("torch."), list(t.shape)])
                    fh.write(data)
                    offset += len(data)
                entries.append({"kind": kind, "shape": list(shape), "tensors": specs})
        (tmp / "index.json").write_text(json.dumps(entries))
        os.replace(tmp, directory)  # atomic: a concurrent start maps a whole set or none
    except OSError:  # a full disk or a read-only home: not an error, only slower next time
        shutil.rmtree(tmp, ignore_errors=True)


def _open(directory: Path) -> PackedLayouts:
    try:
        saved = json.loads((directory / "index.json").read_text())
        blob = np.memmap(directory / "layouts.bin", dtype=np.uint8, mode="c")
        return PackedLayouts(directory, saved, blob)
    except (OSError, ValueError):  # none yet, or damaged: packed and saved again
        shutil.rmtree(directory, ignore_errors=True)
        return PackedLayouts(directory)


_current = threading.local()


@contextmanager
def layouts_of(path: Path, library: str):
    """Model builds inside this block take their packed matrices from the file's saved layouts
    (`library`: the kernels' library, whose layout they are)."""
    directory = Path(envs.cache_root()) / "packed" / _key(path, library)
    layouts = _open(directory)
    _current.layouts = layouts
    try:
        yield layouts
        layouts.close()
    finally:
        _current.layouts = None


@contextmanager
def layouts_for(path, device):
    """`layouts_of` where a model packs a GGUF file's matrices on this machine's kernels; else a
    block that changes nothing."""
    library = kernel_build().library if torch.device(device).type == "cpu" else ""
    if not library or path is None or Path(path).suffix != ".gguf":
        yield None
        return
    with layouts_of(Path(path), library) as layouts:
        yield layouts


def packed_or_made(kind: str, shape: tuple[int, int], make: Callable[[], Packed]) -> Packed:
    """`make()`, or its saved result inside `layouts_of` (GGUFBlocks.packed calls this)."""
    layouts = getattr(_current, "layouts", None)
    return make() if layouts is None else layouts.take(kind, shape, make)


def _key(path: Path, library: str) -> str:
    here = Path(__file__).parent
    sources = hashlib.sha256(b"".join((here / name).read_bytes() for name in _SOURCES)).hexdigest()
    return file_key(Path(path), library, sources)
