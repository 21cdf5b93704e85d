"""A tiny Gemma 3 for the start-up benchmark, made at run time: Gemma 3 270M's layer shape (hidden
640, 18 layers, 4 heads of 256, one KV head, FFN 2048, query and key norms, a sliding window of 512
on five layers in six) with SmolLM2's tokenizer (copied from the bundled file; no Gemma vocabulary
ships offline) and seeded random weights, written F32 and quantized to Q4_K_M, where hidden 640
is not whole 256-blocks, so most matrices fall back to Q5_0 as in the published file. Cached under
verispec's cache. Random weights: it measures load and compile time, never fidelity."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from benchmarks.ggufs import field_value, requantize_file, written_once
from verispec.models.loader import cache_dir

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, WINDOW = 640, 18, 4, 1, 256, 2048, 512
_VERSION = 1


def tiny_gemma3(tokenizer_file: str, log=print) -> Path:
    """The model as Q4_K_M, made once and cached."""
    root = cache_dir() / "bench-models"
    f32 = root / f"gemma3-tiny-v{_VERSION}.F32.gguf"
    out = root / f"gemma3-tiny-v{_VERSION}.Q4_K_M.gguf"
    if not out.exists():
        log(f"writing a tiny Gemma 3 (random weights) to {out}")
    written_once(f32, lambda tmp: _write(tmp, tokenizer_file))
    return written_once(out, lambda tmp: requantize_file(f32, tmp, "Q4_K_M"))


def _write(path: Path, tokenizer_file: str) -> None:
    reader = gguf.GGUFReader(tokenizer_file)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(path, "gemma3", use_temp_file=True)
    try:
        writer.add_name("verispec-bench-gemma3-tiny")
        writer.add_context_length(32768)
        writer.add_embedding_length(HIDDEN)
        writer.add_block_count(LAYERS)
        writer.add_feed_forward_length(FFN)
        writer.add_head_count(HEADS)
        writer.add_head_count_kv(KV_HEADS)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(1e6)
        writer.add_sliding_window(WINDOW)
        writer.add_vocab_size(vocab)
        for name, field in reader.fields.items():
            if name.startswith("tokenizer."):
                value, sub_type = field_value(field)
                writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
        _add_tensors(writer, vocab)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add_tensors(writer: gguf.GGUFWriter, vocab: int) -> None:
    """Gaussian matrices (scale 0.02); norms stored as llama.cpp's converter stores Gemma's, 1 + w,
    with w = 0."""
    rng = np.random.default_rng(3)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.02

    def norm(size: int = HIDDEN) -> np.ndarray:
        return np.ones(size, np.float32)

    writer.add_tensor("token_embd.weight", matrix(vocab, HIDDEN))
    writer.add_tensor("output_norm.weight", norm())
    for i in range(LAYERS):
        p = f"blk.{i}."
        for name, value in (("attn_norm", norm()), ("attn_q", matrix(HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_k", matrix(KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_v", matrix(KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_q_norm", norm(HEAD_DIM)), ("attn_k_norm", norm(HEAD_DIM)),
                            ("attn_output", matrix(HIDDEN, HEADS * HEAD_DIM)), ("post_attention_norm", norm()),
                            ("ffn_norm", norm()), ("ffn_gate", matrix(FFN, HIDDEN)), ("ffn_up", matrix(FFN, HIDDEN)),
                            ("ffn_down", matrix(HIDDEN, FFN)), ("post_ffw_norm", norm())):
            writer.add_tensor(p + name + ".weight", value)
