"""The cached GGUF index (verispec.models.gguf_index): a later start reads the same config and
tensor table as gguf's own reader, and a damaged entry is rebuilt."""

from __future__ import annotations

from pathlib import Path

import pytest

from verispec.models.gguf_index import read_index
from verispec.models.loader import _gguf_config


@pytest.mark.slow
def test_the_cached_index_equals_a_fresh_read(smollm2_path, tmp_path):
    from gguf import GGUFReader

    path = Path(smollm2_path)
    first = read_index(path, _gguf_config, tmp_path)
    (entry,) = (tmp_path / "gguf").glob("*.json")
    again = read_index(path, lambda reader: pytest.fail("read the file again"), tmp_path)
    assert again == first
    reader = GGUFReader(str(path))  # the header itself against this reader: the test below
    by_name = {t.name: t for t in reader.tensors}
    assert [t.name for t in first[1]] == list(by_name)
    for t in first[1]:
        theirs = by_name[t.name]
        assert (t.kind, t.offset, t.n_bytes) == (theirs.tensor_type.name, theirs.data_offset, theirs.n_bytes)
        assert t.shape == [int(d) for d in reversed(theirs.shape)]
    entry.write_text("{not json")
    assert read_index(path, _gguf_config, tmp_path) == first  # rebuilt from the file
    assert read_index(path, _gguf_config, None) == first  # no cache at all


def test_the_header_reads_what_ggufs_own_reader_reads(smollm2_path):
    """Every key-value pair (the vocabulary and merges included) and every tensor's type, shape,
    offset and size, against gguf's reader."""
    import gguf

    from verispec.models.gguf_index import GGUFHeader

    ours, theirs = GGUFHeader.read(Path(smollm2_path)), gguf.GGUFReader(smollm2_path)
    for key, f in theirs.fields.items():
        if not key.startswith("GGUF."):  # the reader's own entries for the file's preamble
            assert ours.fields[key] == pytest.approx(f.contents()) if isinstance(ours.fields[key], float) \
                else ours.fields[key] == f.contents(), key
    assert len(ours.fields) == len([k for k in theirs.fields if not k.startswith("GGUF.")])
    got = [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in ours.tensors]
    assert got == [(t.name, t.tensor_type, [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes))
                   for t in theirs.tensors]
