"""A GGUF file's packed layouts saved at its first model build and mapped at the next
(models/packed_cache.py): the same bits, nothing packed the second time, a stale save dropped,
and a weight update never writes the saved file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verispec.models import cpu_kernels
from verispec.models.gguf_blocks import GGUFBlocks, row_bytes
from verispec.models.packed_cache import layouts_of

pytestmark = pytest.mark.skipif(not cpu_kernels.kernels_wanted(), reason="the packed layout is the CPU kernels'")

SHAPES = [("Q4_0", (32, 64)), ("Q8_0", (48, 64)), ("Q4_1", (16, 256))]


def blocks(seed: int) -> list[GGUFBlocks]:
    rng = np.random.default_rng(seed)
    out = []
    for kind, (n, k) in SHAPES:
        raw = rng.integers(0, 256, size=(n, row_bytes(kind, k)), dtype=np.uint8)  # any bits: compared as bits
        out.append(GGUFBlocks.of(raw, kind, (n, k)))
    return out


def build(path, weights) -> tuple[list, object]:
    with layouts_of(path, "lib") as layouts:
        packed = [w.packed() for w in weights]
    return packed, layouts


def same(a, b) -> bool:
    """Bit for bit (random scales hold NaNs)."""
    return a[3] == b[3] and all((x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                for x, y in zip(a[:3], b[:3]))


def test_the_second_build_maps_what_the_first_packed(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    cpu_kernels.kernel_build()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    weights = blocks(0)
    fresh = [w.packed() for w in weights]  # outside any build: packed, nothing saved
    first, layouts = build(model, weights)
    assert len(layouts.made) == 3 and layouts.taken == 0
    second, layouts = build(model, weights)
    assert layouts.made == [] and layouts.taken == 3
    assert all(same(a, b) and same(a, c) for a, b, c in zip(fresh, first, second))
    saved = next((tmp_path / "cache" / "packed").iterdir()) / "layouts.bin"
    before = saved.read_bytes()
    second[0][0].fill_(7)  # an in-place update of a mapped matrix: private pages, the file unchanged
    assert saved.read_bytes() == before
    third, _ = build(model, weights)
    assert same(third[0], first[0])


def test_a_save_that_does_not_match_the_build_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    weights = blocks(1)
    first, _ = build(model, weights)
    (directory,) = (tmp_path / "cache" / "packed").iterdir()
    index = json.loads((directory / "index.json").read_text())
    index[1]["shape"] = [1, 1]
    (directory / "index.json").write_text(json.dumps(index))
    again, layouts = build(model, weights)
    assert layouts.broken and layouts.taken == 1 and len(layouts.made) == 2
    assert all(same(a, b) for a, b in zip(first, again))
    assert not directory.exists()  # dropped: the next build packs and saves anew
    build(model, weights)
    assert directory.exists()
