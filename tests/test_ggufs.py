"""benchmarks/ggufs.py: GGUF copies re-quantized by a llama.cpp scheme keep every metadata field,
every tensor (order, names, shapes) and close values, with the types the scheme names."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import benchmarks.ggufs as ggufs
from benchmarks.ggufs import FILE_TYPES, SCHEMES, plan_types, quantized_copy, requantize_file, use_more_bits

# Relative RMS error of a re-quantized matrix against the values it was made from: about what
# each type reaches on Gaussian weights, with a margin.
REL_ERROR = {T.F32: 0.0, T.F16: 1e-3, T.Q8_0: 0.008, T.Q6_K: 0.025, T.Q5_K: 0.045, T.Q5_1: 0.05,
             T.Q5_0: 0.055, T.Q4_K: 0.09, T.Q4_1: 0.1, T.Q4_0: 0.11}
LAYERS = 12
# use_more_bits over 12 layers: the first and last eighth, every third one between
MORE_BITS_12 = {0, 3, 6, 9, 10, 11}


def raw_fields(reader: gguf.GGUFReader) -> dict[str, tuple]:
    """Every key/value field as (types, raw bytes of its values)."""
    return {name: (tuple(f.types), [bytes(f.parts[i]) for i in f.data]) for name, f in reader.fields.items()}


def decoded(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


def assert_copy(src: gguf.GGUFReader, dst: gguf.GGUFReader, scheme: str, want_types: dict[str, T]) -> None:
    """Metadata equal but the file type; tensors in order with their shapes, types and values."""
    fields, copied = raw_fields(src), raw_fields(dst)
    for name, value in fields.items():
        if name.startswith("GGUF.") or name == "general.file_type":
            continue
        assert copied.get(name) == value, name
    assert dst.fields["general.file_type"].contents() == FILE_TYPES[scheme]
    assert [(t.name, list(t.shape)) for t in dst.tensors] == [(t.name, list(t.shape)) for t in src.tensors]
    assert {t.name: t.tensor_type for t in dst.tensors} == want_types
    before, after = decoded(src), decoded(dst)
    for t in dst.tensors:
        a, b = before[t.name].astype(np.float64), after[t.name].astype(np.float64)
        assert a.shape == b.shape
        rel = np.sqrt(np.mean((a - b) ** 2) / np.mean(a**2))
        assert rel <= REL_ERROR[t.tensor_type], (t.name, t.tensor_type.name, rel)


# --------------------------------------------------------------------------- a synthetic model
def write_synthetic(path: Path, tied: bool) -> Path:
    """A small llama-like file with metadata of every kind and matrices of awkward row lengths:
    K=256 and 512 (K-quants fit), 96 (whole 32-blocks only) and 48 (neither)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", LAYERS)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint64("llama.context_length", 1 << 40)
    w.add_int8("test.int8", -5)
    w.add_float64("test.float64", 1 / 3)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "héllo", " ", "\n"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0, -0.125])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 6])
    w.add_array("tokenizer.ggml.merges", ["a b", "h é"])
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def matrix(rows, k):
        return rng.standard_normal((rows, k)).astype(np.float32)

    embd = matrix(50, 256)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embd, T.Q8_0), raw_dtype=T.Q8_0)
    for i in sorted(range(LAYERS), key=str):  # as some converters write them: blk.10 before blk.2
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(256).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(32, 256))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(16, 256))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(16, 96))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(8, 48))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(16, 512))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    if not tied:
        w.add_tensor("output.weight", matrix(50, 256))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def synthetic_types(scheme: str, tied: bool) -> dict[str, T]:
    base = T.Q4_K if scheme == "Q4_K_M" else T[scheme]
    fallback = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(base, base)  # K=96
    more = T.Q6_K if scheme == "Q4_K_M" else base
    want = {"token_embd.weight": T.Q6_K if scheme == "Q4_K_M" and tied else base}
    for i in range(LAYERS):
        want |= {f"blk.{i}.attn_norm.weight": T.F32, f"blk.{i}.attn_q.weight": base,
                 f"blk.{i}.attn_v.weight": more if i in MORE_BITS_12 else base,
                 f"blk.{i}.attn_output.weight": fallback, f"blk.{i}.ffn_gate.weight": T.F16,
                 f"blk.{i}.ffn_down.weight": more if i in MORE_BITS_12 else base}
    want["output_norm.weight"] = T.F32
    if not tied:
        want["output.weight"] = T.Q6_K if scheme == "Q4_K_M" else base
    return want


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("synthetic")
    return {tied: write_synthetic(root / f"tied-{tied}.gguf", tied) for tied in (True, False)}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_on_a_synthetic_model(synthetic, tmp_path, scheme):
    src = synthetic[True]
    out = requantize_file(src, tmp_path / "copy.gguf", scheme)
    assert out == tmp_path / "copy.gguf"
    assert_copy(gguf.GGUFReader(src), gguf.GGUFReader(out), scheme, synthetic_types(scheme, tied=True))


@pytest.mark.parametrize("scheme", ["Q4_K_M", "Q6_K"])
def test_untied_output(synthetic, tmp_path, scheme):
    # with an output.weight, that gets the Q4_K_M's Q6_K and token_embd stays Q4_K
    src = synthetic[False]
    out = requantize_file(src, tmp_path / "copy.gguf", scheme)
    assert_copy(gguf.GGUFReader(src), gguf.GGUFReader(out), scheme, synthetic_types(scheme, tied=False))


def test_use_more_bits_layers():
    assert {i for i in range(30) if use_more_bits(i, 30)} == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    assert {i for i in range(LAYERS) if use_more_bits(i, LAYERS)} == MORE_BITS_12


def test_plan_types_q4_k_m_rules():
    # fused qkv counts as attn_v; ffn_down's layer comes from its name; 1-D and non-weights stay F32
    tensors = [("token_embd.weight", [4096, 100]), ("output.weight", [4096, 100])]
    for i in range(LAYERS):
        tensors += [(f"blk.{i}.attn_qkv.weight", [4096, 12288]), (f"blk.{i}.attn_qkv.bias", [12288]),
                    (f"blk.{i}.ffn_down_exps.weight", [4096, 1024, 4])]
    types = plan_types(tensors, "Q4_K_M", n_layers=LAYERS)
    assert types["token_embd.weight"] == T.Q4_K and types["output.weight"] == T.Q6_K
    for i in range(LAYERS):
        want = T.Q6_K if i in MORE_BITS_12 else T.Q4_K
        assert types[f"blk.{i}.attn_qkv.weight"] == want and types[f"blk.{i}.ffn_down_exps.weight"] == want
        assert types[f"blk.{i}.attn_qkv.bias"] == T.F32


def test_bad_scheme(synthetic, tmp_path):
    with pytest.raises(ValueError, match=r"Q4_K_M.*'Q3_K_M'"):
        requantize_file(synthetic[True], tmp_path / "x.gguf", "Q3_K_M")
    with pytest.raises(ValueError, match=r"'q4_k_m'"):
        quantized_copy(synthetic[True], "q4_k_m", tmp_path)


def test_quantized_copy_is_cached(synthetic, tmp_path, monkeypatch):
    src = tmp_path / "model.gguf"
    src.write_bytes(synthetic[True].read_bytes())
    calls = []
    real = ggufs.requantize_file
    monkeypatch.setattr(ggufs, "requantize_file", lambda *a: calls.append(a) or real(*a))
    cache = tmp_path / "cache"
    first = quantized_copy(src, "Q4_K", cache)
    assert first.parent == cache and first.exists() and len(calls) == 1
    assert quantized_copy(str(src), "Q4_K", str(cache)) == first and len(calls) == 1  # reused
    other = quantized_copy(src, "Q8_0", cache)  # another scheme: another file
    assert other != first and len(calls) == 2
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))  # the source changed
    assert quantized_copy(src, "Q4_K", cache) != first and len(calls) == 3
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    reader = gguf.GGUFReader(first)
    assert {t.name: t.tensor_type for t in reader.tensors} == synthetic_types("Q4_K", tied=True)


# ----------------------------------------------------------------------- the bundled SmolLM2
@pytest.fixture(scope="module")
def smollm2_q4_k_m(smollm2_path, tmp_path_factory):
    copy = quantized_copy(smollm2_path, "Q4_K_M", tmp_path_factory.mktemp("ggufs"))
    return gguf.GGUFReader(smollm2_path), gguf.GGUFReader(copy)


@pytest.mark.slow
def test_smollm2_q4_k_m(smollm2_q4_k_m):
    src, dst = smollm2_q4_k_m
    # SmolLM2-135M: 30 layers, hidden 576 (not whole 256-blocks), ffn 1536, tied embeddings. So
    # only ffn_down (K=1536) keeps a K-quant; the rest falls back: Q4_K -> Q5_0, Q6_K -> Q8_0.
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    want = {}
    for t in src.tensors:
        name = t.name
        if len(t.shape) == 1:
            want[name] = T.F32
        elif name == "token_embd.weight":
            want[name] = T.Q8_0  # tied: the output's Q6_K, which falls back
        else:
            layer = int(name.split(".")[1])
            if name.endswith("ffn_down.weight"):
                want[name] = T.Q6_K if layer in more else T.Q4_K
            elif name.endswith("attn_v.weight"):
                want[name] = T.Q8_0 if layer in more else T.Q5_0
            else:
                want[name] = T.Q5_0
    assert "output.weight" not in want and len(want) == 272
    assert_copy(src, dst, "Q4_K_M", want)
