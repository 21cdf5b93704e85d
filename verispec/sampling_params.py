"""SamplingParams: vLLM's field names and meanings, validated on construction and frozen after it
(`dataclasses.replace` makes a changed copy, validated again), so a request's parameters are
checked once per process and never change under it.

Every invalid value raises `ValueError` naming the field and the allowed range. Every integer must
fit a signed 64-bit int: that is what crosses to the engine-core process and to the device. Checks
that need the model (vocab size, context length) run in `check_against_model`, called when a request
is added. Clamps, as vLLM does: `top_k` at or above the vocabulary is no top-k, and `max_tokens` is
cut to what the context leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verispec.config import LogprobsMode

MAX_LOGPROB_TOKEN_IDS = 128
# Each is checked against every sampled token, in every step: a request's lists stay short, or one
# request slows everyone's steps (20,000 bad words made a neighbour's 32 tokens take 11x as long).
MAX_STOP_STRINGS = 256
MAX_BAD_WORDS = 256


def _brief(value: object, limit: int = 120) -> str:
    """A value's repr for an error message, cut short: a 7 MB list must not come back in full."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value: object) -> bool:
    """An int (not a bool) that fits a signed 64-bit integer."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def is_valid_text(value: object) -> bool:
    """A str that is valid Unicode (a lone surrogate cannot be tokenized or sent as UTF-8)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(value: object) -> bool:
    """A finite real number (ints too large for a float are not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one field is set. The engine
    compiles it with llguidance (sample/grammar.py)."""

    json: dict | str | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        set_ = [f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false; got {_brief(self.json_object)}")
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_ or 'none'}")
        if self.json is not None and not (isinstance(self.json, dict) or is_valid_text(self.json)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text); "
                             f"got {_brief(self.json)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (is_valid_text(value) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string; got {_brief(value)}")
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice and all(is_valid_text(c) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings; "
                             f"got {_brief(self.choice)}")

    @property
    def kind(self) -> str:
        return next(f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None) \
            if not self.json_object else "json_object"


@dataclass(slots=True, frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    logprobs_mode: LogprobsMode | str | None = None
    # Requests with different salts never share cached prefix blocks (core/prefix_cache.py), so
    # one tenant cannot learn from timing that another sent the same prompt.
    cache_salt: str | None = None
    # A grammar the output must follow: StructuredOutputsParams, or a dict of its fields.
    structured_outputs: StructuredOutputsParams | dict | None = None
    # False: the engine's drafter proposes nothing for this request (plain decoding, same output).
    speculative: bool = True
    # True: each output token says how speculation produced it (CompletionOutput.token_sources).
    return_token_sources: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def _set(self, name: str, value) -> None:
        """Normalises a field while validating (a str stop to a list, a dict to its dataclass)."""
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ validation
    # long: one check per field, in the fields' order, each raising with that field's name; split
    # into groups it would only scatter a flat list.
    def validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer in [1, 2**63); got {_brief(self.n)}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0; got {_brief(self.temperature)}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1]; got {_brief(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer in [1, 2**63); got {_brief(self.top_k)}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1]; got {_brief(self.min_p)}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63); got {_brief(self.seed)}")
        if isinstance(self.structured_outputs, dict):
            try:
                self._set("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
            except TypeError as exc:
                raise ValueError(f"structured_outputs has an unknown field: {exc}") from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a dict or StructuredOutputsParams; "
                             f"got {_brief(self.structured_outputs)}")
        if self.structured_outputs is not None and self.min_tokens:
            # A grammar that is complete allows only the end of the answer, which min_tokens bans.
            raise ValueError(f"min_tokens must be 0 with structured_outputs; got {self.min_tokens}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be None or a non-empty string; got {_brief(self.cache_salt)}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an integer in [1, 2**63); got {_brief(self.max_tokens)}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer in [0, 2**63); got {_brief(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}); got {self.min_tokens}"
            )
        if isinstance(self.stop, str):
            self._set("stop", [self.stop])
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(is_valid_text(s) and s for s in self.stop):
                raise ValueError(
                    f"stop must be a non-empty string or a list of them, in valid Unicode; got {_brief(self.stop)}"
                )
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
        if self.stop_token_ids is not None:
            # Sets in meaning: duplicates go, so a list is never longer than the vocabulary.
            ids = self._int_list("stop_token_ids", self.stop_token_ids, lo=0)
            self._set("stop_token_ids", list(dict.fromkeys(ids)))
        if not _is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 100.0):
            raise ValueError(f"repetition_penalty must be in (0, 100]; got {_brief(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2]; got {_brief(value)}")
        if self.logit_bias is not None:
            self._set("logit_bias", self._check_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = self._int_list("allowed_token_ids", self.allowed_token_ids, lo=0)
            self._set("allowed_token_ids", list(dict.fromkeys(allowed)))  # a set in meaning, as stop_token_ids
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(
                is_valid_text(w) and w.strip() for w in self.bad_words
            ):
                raise ValueError(
                    f"bad_words must be a list of non-empty strings in valid Unicode; got {_brief(self.bad_words)}"
                )
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words holds {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are accepted")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(
                    f"{name} must be None, -1 (full vocabulary) or an integer in [0, 2**63); got {_brief(value)}"
                )
        if self.logprob_token_ids is not None:
            ids = self._int_list("logprob_token_ids", self.logprob_token_ids, lo=0)
            if not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(
                    f"logprob_token_ids must hold 1 to {MAX_LOGPROB_TOKEN_IDS} ids; got {len(ids)}"
                )
            if self.logprobs is not None and self.logprobs != len(ids):
                raise ValueError(
                    f"logprobs must equal len(logprob_token_ids) ({len(ids)}) when both are set; "
                    f"got {self.logprobs}"
                )
            self._set("logprob_token_ids", ids)
        if self.logprobs_mode is not None:
            self._set("logprobs_mode", LogprobsMode.parse(self.logprobs_mode))
        for name in ("speculative", "return_token_sources"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {_brief(getattr(self, name))}")

    @staticmethod
    def _int_list(name: str, value: object, lo: int) -> list[int]:
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) and v >= lo for v in value):
            raise ValueError(f"{name} must be a list of integers in [{lo}, 2**63); got {_brief(value)}")
        return list(value)

    @staticmethod
    def _check_logit_bias(bias: object) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias; got {_brief(bias)}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            # JSON objects have string keys, so "42" is token 42; 1.5 or True is not a token id.
            if _is_int(key):
                token = key
            elif isinstance(key, str) and key.strip().lstrip("-").isdigit():
                token = int(key)
            else:
                raise ValueError(f"logit_bias keys must be token ids; got {_brief(key)}")
            if not 0 <= token <= INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids in [0, 2**63); got {_brief(key)}")
            if not _is_number(value) or not (-100.0 <= value <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {_brief(value)} for {_brief(key)}")
            out[token] = float(value)
        return out

    # ------------------------------------------------------------------ derived
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_against_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the loaded model; raised when the request is added."""
        for name in ("allowed_token_ids", "stop_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if ids and max(ids) >= vocab_size:
                raise ValueError(f"{name} holds id {max(ids)}, outside the vocabulary [0, {vocab_size})")
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise ValueError(
                f"logit_bias holds id {max(self.logit_bias)}, outside the vocabulary [0, {vocab_size})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(
                    f"{name}={value} exceeds the vocabulary size ({vocab_size}); use -1 for the full vocabulary"
                )
        if max_logprobs != -1:
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(self, name)
                if value is not None and (value == -1 or value > max_logprobs):
                    raise ValueError(
                        f"{name}={value} exceeds max_logprobs={max_logprobs}; "
                        "start the engine with a larger max_logprobs (or -1 for no cap)"
                    )
