"""A GGUF file's tokenizer: converted once per vocabulary, its fast half answering as transformers does
(models/tokenizer_cache.py)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys

from conftest import run_fresh

from verispec.models.tokenizer_cache import FAST_FILE, FastTokenizer, hf_tokenizer, load_tokenizer

# Texts that reach a tokenizer's corners: byte fallback, runs of spaces, control-token text, digits.
CORPUS = ["Hello, world", " The capital of France is", "\n\n\t  x  \n", "naïve café 🙂 日本語 Привет",
          "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>",
          "if (a<=b) { return a >> 2; } // 0x1F", "1234567890 3.14159 1e-9", "a" * 300, "", " ", "<|endoftext|>x"]

def _entry(cache) -> os.PathLike:
    (entry,) = [p for p in (cache / "tokenizers").iterdir() if p.is_dir()]
    return entry

def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ  \n\t.,;:!?'\"()[]{}<>|/\\_-+=*&^%$#@~`0123456789éüßñç中文字日本🙂🚀\u200b\u00a0"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60))) for _ in range(n)]

def test_the_fast_half_encodes_and_decodes_as_transformers_does(smollm2_path, tmp_path, monkeypatch):
    """A warm load is a FastTokenizer; on every text and id sequence it answers as transformers'
    tokenizer loaded from the same entry (the oracle), special tokens kept or skipped."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    load_tokenizer(smollm2_path)  # converts, saving both halves
    fast = load_tokenizer(smollm2_path)
    assert isinstance(fast, FastTokenizer)
    oracle = AutoTokenizer.from_pretrained(str(_entry(tmp_path)))
    for text in CORPUS + _random_texts(200):
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == oracle.encode(text, add_special_tokens=special)
    rng = random.Random(1)
    size = len(oracle)
    sequences = [[rng.randrange(size) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    sequences += [[i] for i in range(0, size, 97)] + [oracle.all_special_ids]
    for ids in sequences:
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == oracle.decode(ids, skip_special_tokens=skip)
    assert (fast.eos_token_id, fast.bos_token_id) == (oracle.eos_token_id, oracle.bos_token_id)
    assert len(fast) == len(oracle)
    # Anything else is transformers' own answer, loaded on first use.
    assert fast.chat_template == oracle.chat_template
    assert fast.get_vocab() == oracle.get_vocab()
    assert type(hf_tokenizer(fast)) is type(oracle)

def test_a_warm_start_reads_its_tokenizer_without_importing_transformers(smollm2_path, tmp_path):
    """Importing transformers cost a warm `generate` 1.4 s of its 4: the fast half needs none of it.
    The chat template's half comes from transformers' own class, without importing torch."""
    env = dict(os.environ, VERISPEC_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    code = ("import json, sys\nfrom verispec.models.tokenizer_cache import load_tokenizer\n"
            f"tok = load_tokenizer({smollm2_path!r})\n"
            f"print(json.dumps([type(tok).__name__, 'transformers' in sys.modules, tok.encode({CORPUS[4]!r}),"
            " tok.decode(tok.encode('Hello, world')), tok.eos_token_id,"
            " tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False), 'torch' in sys.modules]))\n")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-1500:] for r in runs]
    (first, second) = [json.loads(r.stdout) for r in runs]
    assert second[:2] == ["FastTokenizer", False]
    assert first[2:-1] == second[2:-1]  # the converting start and the fast one agree
    assert second[3] == "Hello, world"
    assert second[-1] is False  # transformers' half, for the chat template, loads without torch (1.3 s, not 3.4)

def test_a_damaged_tokenizer_cache_is_rebuilt(smollm2_path, tmp_path, monkeypatch, caplog):
    """A damaged entry is converted again when transformers' half is needed; a damaged fast half is
    saved again at the next full load."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    first = load_tokenizer(smollm2_path)
    cached = _entry(tmp_path)
    assert not [p for p in (tmp_path / "tokenizers").iterdir() if ".tmp" in p.name]  # nothing left behind
    (cached / "tokenizer.json").write_text("{ not json")
    again = load_tokenizer(smollm2_path)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        assert again.hf.encode("Hello, world") == first.encode("Hello, world")
    assert "rebuilding the cached tokenizer" in caplog.text
    (cached / FAST_FILE).write_text("{ half")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verispec"):
        full = load_tokenizer(smollm2_path)
    assert "rebuilding the fast half" in caplog.text
    assert not isinstance(full, FastTokenizer) and full.encode("Hello") == first.encode("Hello")
    assert isinstance(load_tokenizer(smollm2_path), FastTokenizer)  # saved again

def test_a_tokenizer_whose_decode_is_not_the_backends_keeps_no_fast_half(smollm2_path, tmp_path, monkeypatch):
    """transformers may post-process a decode (clean-up of spaces): such a tokenizer is always loaded
    through transformers, never answered by a backend that would decode otherwise."""
    from verispec.models import tokenizer_cache

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    load_tokenizer(smollm2_path)
    oracle = hf_tokenizer(load_tokenizer(smollm2_path))

    class CleaningUp:
        backend_tokenizer = oracle.backend_tokenizer

        def encode(self, text, add_special_tokens=True):
            return oracle.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, skip_special_tokens=False):
            return oracle.decode(ids, skip_special_tokens=skip_special_tokens).replace(" .", ".")  # as a clean-up does

    target = tmp_path / "elsewhere"
    target.mkdir()
    tokenizer_cache._save_fast(CleaningUp(), target)
    assert not (target / FAST_FILE).exists()
    tokenizer_cache._save_fast(oracle, target)
    assert (target / FAST_FILE).exists()

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

def test_two_processes_starting_together_convert_a_tokenizer_once(smollm2_path, tmp_path):
    """A server's frontend and its engine core load the tokenizer at the same moment: one converts,
    the other waits and loads its result."""
    code = ("import logging, sys\nlogging.basicConfig(level=logging.INFO)\n"
            "from verispec.models.tokenizer_cache import load_tokenizer\n"
            "print(load_tokenizer(sys.argv[1]).encode('Hello, world'))\n")
    env = dict(os.environ, VERISPEC_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, smollm2_path], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1000:] for _, err in outs]
    assert sum(err.count("reading the tokenizer") for _, err in outs) == 1
    assert outs[0][0] == outs[1][0]


def _vocab_only(src: str, arch: str, target) -> str:
    """A GGUF file of `src`'s tokenizer under another architecture (which picks transformers' class)."""
    import gguf

    from benchmarks.ggufs import field_value

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(target), arch)
    for key, value in (("context_length", 2048), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("attention.head_count", 4), ("attention.head_count_kv", 4)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_eps", 1e-6)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            value, sub_type = field_value(field)
            writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(target)


def test_the_first_start_tokenizes_as_every_later_one(smollm2_path, tmp_path, monkeypatch):
    """transformers' tokenizer converted from a file can differ from the same tokenizer saved and
    loaded again (Qwen2's class adds NFC normalization when it loads): the first start answers
    with the loaded one, as every later start does, and its fast half agrees with both."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    qwen = _vocab_only(smollm2_path, "qwen2", tmp_path / "qwen2-vocab.gguf")
    text = "re\u0301sume\u0301 and the NFC form r\u00e9sum\u00e9"
    first = load_tokenizer(qwen)
    later = load_tokenizer(qwen)
    assert isinstance(later, FastTokenizer)
    assert first.encode(text) == later.encode(text) == later.hf.encode(text)
    assert later.encode(text) == later.encode("r\u00e9sum\u00e9 and the NFC form r\u00e9sum\u00e9")  # normalized
