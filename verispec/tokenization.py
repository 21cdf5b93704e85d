"""Client text -> token ids, with special-token text kept as text.

A chat template's control tokens (`<|im_start|>`, `<|im_end|>`, ...) are the template's own. The
same characters inside message content, a bad word or (by default) a completion prompt are text, so
a user cannot open a turn of their own. `TextEncoder` holds two views of one fast tokenizer: one that
reads special-token text as control tokens (for the template's own text) and one that reads it as
text. Both are used read-only, so threads may share them; `encode_batch` releases the GIL, so a long
text does not stall the server's event loop.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any


class TextEncoder:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._parsing = backend
        self._literal = None
        if backend is not None:
            self._literal = copy.deepcopy(backend)
            self._literal.encode_special_tokens = True
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in decoder.values() if getattr(t, "special", False)}
        specials |= set(getattr(tokenizer, "all_special_tokens", ()) or ())
        self.special_texts = tuple(sorted((s for s in specials if s), key=len, reverse=True))
        # No token stands for more characters than its vocabulary entry has (byte-level entries
        # spell one character per byte). A normalizer may merge characters first: allow 4x.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_token_chars = longest * (4 if backend is not None and backend.normalizer is not None else 1)

    def encode(self, texts: list[str], *, special_tokens: bool, add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text; `special_tokens=False` keeps special-token text as text."""
        if not texts:
            return []
        backend = self._parsing if special_tokens else self._literal
        if backend is not None:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        out = self.tokenizer(texts, add_special_tokens=add_special_tokens, split_special_tokens=not special_tokens)
        return [list(ids) for ids in out["input_ids"]]

    def find_special(self, text: str) -> str | None:
        """The first special token whose text occurs in `text`, if any."""
        return next((s for s in self.special_texts if s in text), None)

    def max_chars(self, max_tokens: int) -> int:
        """A text longer than this holds more than `max_tokens` tokens, whatever it says."""
        return max_tokens * self.max_token_chars


_ENCODERS: "weakref.WeakKeyDictionary[Any, TextEncoder]" = weakref.WeakKeyDictionary()


def text_encoder(tokenizer: Any) -> TextEncoder:
    """The tokenizer's encoder, built once (it copies the tokenizer and reads its vocabulary)."""
    enc = _ENCODERS.get(tokenizer)
    if enc is None:
        enc = _ENCODERS[tokenizer] = TextEncoder(tokenizer)
    return enc


def bad_word_ids(tokenizer: Any, words: list[str] | None) -> list[list[int]]:
    """`bad_words` as token sequences: each word alone and after a space, special-token text as
    text (banning "<|im_end|>" must not ban the control token)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this model has none")
    seqs = []
    variants = [v for word in words for v in (word, " " + word.lstrip())]
    for ids in text_encoder(tokenizer).encode(variants, special_tokens=False):
        if ids and ids not in seqs:
            seqs.append(ids)
    return seqs
