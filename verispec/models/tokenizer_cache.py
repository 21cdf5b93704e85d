"""Tokenizers: a checkpoint directory's own, through transformers; a GGUF file's, converted once per
vocabulary and kept in verispec's cache.

Converting a GGUF vocabulary takes several seconds, so the converted tokenizer is saved under
`<cache>/tokenizers/<key>`, keyed by the file's tokenizer fields (every quantization and copy of a
model shares it) and found again through a pointer named by the file's path, size and mtime.

Loading that entry through transformers still cost a warm start about 2 s (importing transformers
alone takes 1.4 s here), more than the model. Beside each entry verispec therefore keeps the
`tokenizers` backend exactly as transformers loaded it, with the special tokens' ids
(`verispec-fast.json`). transformers' own encode and decode are that backend's calls, so
`FastTokenizer` answers them from it without importing transformers, after a check at save time
that the two agree on probe texts (a tokenizer whose decode cleans up spaces, or that splits special
tokens, keeps no fast half). Everything else (a chat template, the vocabulary) loads transformers'
tokenizer the first time it is asked for.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
import threading
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from verispec import envs
from verispec.models.gguf_index import GGUFHeader, file_key
from verispec.models.model_path import resolve_model_path

logger = logging.getLogger("verispec")

FAST_FILE = "verispec-fast.json"
# Texts the fast half must encode and decode as transformers does before it is saved (the last but
# one is what a clean-up of tokenization spaces would change).
_PROBES = ("Hello, world!", " The capital of France is", "  two  spaces\tand a tab\n\nlines ",
           "café, naïve, 日本語, 🙂 and \u200b", "<|im_start|>user\nhi<|im_end|>\n", "<s></s><unk>",
           "def f(x):\n    return x ** 2  # ok", "re\u0301sume\u0301 a\u0300 la carte",
           "Yes , it is . Is it ? I 'm sure ! do n't", "")


class FastTokenizer:
    """A cached GGUF tokenizer's encode, decode and special ids on its `tokenizers` backend; any other
    attribute comes from transformers' tokenizer, loaded on first use (`hf`)."""

    def __init__(self, backend: Any, ids: dict, load_full: Callable[[], Any]):
        self.backend_tokenizer = backend
        self.eos_token_id: int | None = ids.get("eos_token_id")
        self.bos_token_id: int | None = ids.get("bos_token_id")
        self.pad_token_id: int | None = ids.get("pad_token_id")
        self._load_full = load_full
        self._full: Any = None
        self._lock = threading.Lock()

    @property
    def hf(self) -> Any:
        """transformers' tokenizer for the same entry (loaded once, on first use)."""
        with self._lock:
            if self._full is None:
                self._full = self._load_full()
            return self._full

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:  # transformers' len: the vocabulary with the added tokens
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_lock", "_load_full"):
            raise AttributeError(name)  # copying and pickling probe these before __init__ ran
        return getattr(self.hf, name)


def hf_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer behind `tokenizer` (itself unless it is a FastTokenizer)."""
    return tokenizer.hf if isinstance(tokenizer, FastTokenizer) else tokenizer


def load_tokenizer(model: str) -> Any:
    """The checkpoint's tokenizer and chat template; None if it has none."""
    path = resolve_model_path(model)
    if path.is_dir():
        from transformers import AutoTokenizer

        has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        return AutoTokenizer.from_pretrained(str(path)) if has_tok else None
    root = Path(envs.cache_root()) / "tokenizers"
    pointer = root / f"{file_key(path)}.key"
    key = pointer.read_text().strip() if pointer.exists() else _tokenizer_key(path)
    entry = _Entry(path, root / key)
    tok = entry.fast() or entry.full()
    _write_quietly(pointer, key)
    return tok


class _Entry:
    """One GGUF vocabulary's cache entry, for the file `gguf`."""

    def __init__(self, gguf: Path, cached: Path):
        self.gguf = gguf
        self.cached = cached

    def fast(self) -> FastTokenizer | None:
        """The entry's fast half, or None (no entry, none saved, saved by another transformers, damaged)."""
        saved_at = self.cached / FAST_FILE
        try:
            saved = json.loads(saved_at.read_text())
            if saved["transformers"] != _transformers_version():
                saved_at.unlink(missing_ok=True)  # another transformers may encode otherwise: checked again
                return None
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(saved["backend"])
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - damaged in any way: the full load saves it again
            logger.warning("rebuilding the fast half of the cached tokenizer %s (%s)", self.cached, exc)
            saved_at.unlink(missing_ok=True)
            return None
        return FastTokenizer(backend, saved["ids"], lambda: self._full_as(saved.get("class")))

    def _full_as(self, cls: list[str] | None) -> Any:
        """transformers' tokenizer through the class it was saved from: AutoTokenizer picks the same
        class but imports torch on the way (3.4 s for a server's frontend, against 1.3 s)."""
        if cls is not None:
            try:
                tok = getattr(importlib.import_module(cls[0]), cls[1]).from_pretrained(str(self.cached))
            except Exception as exc:  # noqa: BLE001 - damaged, or a class moved: the usual way below
                logger.debug("tokenizer class %s: %s", cls, exc)
            else:
                if [type(tok).__module__, type(tok).__qualname__] == cls:
                    return tok
        return self.full()

    def full(self) -> Any:
        """transformers' tokenizer: the cached entry, or converted from the GGUF file (once per vocabulary
        across processes: a server's frontend and its engine core start together)."""
        if (tok := self._cached()) is not None:
            return tok
        with _one_at_a_time(self.cached.with_name(self.cached.name + ".lock")):
            if (tok := self._cached()) is not None:
                return tok
            return self._convert()

    def _cached(self) -> Any:
        """The saved entry through transformers (saving its fast half if missing), or None (none yet, or
        damaged: removed, to be rebuilt)."""
        from transformers import AutoTokenizer

        if not (self.cached / "tokenizer_config.json").exists():
            return None
        try:
            tok = AutoTokenizer.from_pretrained(str(self.cached))
        except Exception as exc:  # noqa: BLE001 - damage of any kind (transformers raises many types): rebuilt
            logger.warning("rebuilding the cached tokenizer %s (%s)", self.cached, exc)
            shutil.rmtree(self.cached, ignore_errors=True)
            return None
        if not (self.cached / FAST_FILE).exists():
            _save_fast(tok, self.cached)
        return tok

    def _convert(self) -> Any:
        from transformers import AutoTokenizer

        logger.info("reading the tokenizer from %s (once per vocabulary, a few seconds; a large one longer)",
                    self.gguf.name)
        tok = converted = AutoTokenizer.from_pretrained(str(self.gguf.parent), gguf_file=self.gguf.name)
        tmp = self.cached.with_name(self.cached.name + f".tmp{os.getpid()}")
        try:
            converted.save_pretrained(str(tmp))
            # What every later start loads, so the first one tokenizes as they do: a converted
            # tokenizer can differ from its saved self (Qwen2's class adds NFC normalization at load).
            tok = AutoTokenizer.from_pretrained(str(tmp))
            _save_fast(tok, tmp)
            os.replace(tmp, self.cached)  # fails where another process cached it first: theirs stays
        except OSError:  # that, or a read-only home: not an error, only slower next time
            shutil.rmtree(tmp, ignore_errors=True)
        return tok


def _save_fast(tok: Any, directory: Path) -> None:
    """Saves `tok`'s backend and special ids as the entry's fast half, where they answer as `tok` does."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "split_special_tokens", False):
        return
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = False
    fast = FastTokenizer(copy, {}, lambda: tok)
    if not _agrees(fast, tok):
        logger.info("the tokenizer in %s keeps no fast half: its encode or decode is not the backend's", directory)
        return
    ids = {name: getattr(tok, name, None) for name in ("eos_token_id", "bos_token_id", "pad_token_id")}
    saved = {"transformers": _transformers_version(), "ids": ids, "backend": copy.to_str(),
             "class": [type(tok).__module__, type(tok).__qualname__]}
    _write_quietly(directory / FAST_FILE, json.dumps(saved))


def _agrees(fast: FastTokenizer, tok: Any) -> bool:
    """Whether `fast` encodes and decodes the probes, and a spread of ids, exactly as `tok` does."""
    size = fast.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    spread = list(range(0, size, max(1, size // 509)))
    try:
        for text in _PROBES:
            for special in (True, False):
                ids = tok.encode(text, add_special_tokens=special)
                if fast.encode(text, add_special_tokens=special) != list(ids):
                    return False
        for ids in [tok.encode(t) for t in _PROBES] + [spread, spread[::-1]]:
            for skip in (False, True):
                if fast.decode(ids, skip_special_tokens=skip) != tok.decode(ids, skip_special_tokens=skip):
                    return False
    except Exception:  # noqa: BLE001 - any failure means no fast half, never a failed start
        return False
    return True


def _transformers_version() -> str:
    """The installed transformers' version, read without importing it (a fast half is its behaviour)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return ""


@contextmanager
def _one_at_a_time(lock: Path):
    """An exclusive lock on `lock` across processes, where the cache is writable."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock, "a")  # noqa: SIM115 - closed below
    except OSError:  # a read-only home: no cache to share either
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tokenizer_key(path: Path) -> str:
    """What a GGUF file's tokenizer is made of: its architecture and every tokenizer field."""
    fields = GGUFHeader.read(path).fields
    mine = {k: v for k, v in fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    return "gguf-" + hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:16]


def _write_quietly(path: Path, text: str) -> None:
    """Writes `text` whole (a reader never sees half a file), or nothing in a read-only home."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
