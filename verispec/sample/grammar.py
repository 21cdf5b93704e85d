"""Structured output: a grammar mask per sampled row, from llguidance.

A request with `structured_outputs` gets an `llguidance.LLMatcher` that follows its output.
`StructuredOutputs` owns the matchers' life: it compiles them when a request is added and, after
each step, follows the tokens the request emitted. When a step's rows are built, the matcher
gives each candidate row its bitmask of allowed tokens: the first row's at the request's current
output, and for drafts, the matcher is advanced through them, a mask taken after each, then rolled
back. Drafts are cut to their longest grammar-valid prefix when they are proposed, so every
candidate row has a live grammar state.

The mask is the first processor (with `allowed_token_ids`): processed logprobs include it, raw
ones do not, prompt rows never get it. Grammars compile once per (kind, text), and each request
takes a copy of the compiled matcher. `GrammarLimits` bounds a grammar's cost (its size, a choice
list's length, llguidance's parser limits); compiling also computes the first mask and one step
beyond it, where llguidance finds most grammars that exceed its limits, so those are refused as
invalid up front. One that fails later fails its own request as the client's error (`GrammarFailed`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from verispec.config import GrammarLimits
from verispec.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# Compiled grammars kept for reuse (a JSON schema sent with every request compiles once).
_MAX_COMPILED = 256


class GrammarError(ValueError):
    """An invalid grammar: `detail` is llguidance's message, the text names the field."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"structured_outputs.{kind} is invalid: {detail}")
        self.detail = detail


class GrammarFailed(RuntimeError):
    """A grammar that passed its checks hit a limit later, inside a step: the request's own error
    (a client error, no traceback), which the step's crash isolation confines to it."""


@dataclass(slots=True)
class RequestGrammar:
    """One request's matcher, at the end of its emitted tokens."""

    matcher: Any  # llguidance.LLMatcher
    num_followed: int = 0  # output tokens the matcher has followed

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of the drafts the grammar allows, in order."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def row_masks(self, drafts: list[int]) -> list[bytes]:
        """Bitmasks of the rows after the output plus drafts[:j], j = 0 .. len(drafts). A grammar
        that exceeds llguidance's limits raises here: the step's crash isolation then fails this
        request alone."""
        masks = [self._mask()]
        for token in drafts:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"draft token {token} is not allowed by the grammar: {self.matcher.get_error()}")
            masks.append(self._mask())
        if drafts:
            self.matcher.rollback(len(drafts))
        return masks

    def _mask(self) -> bytes:
        mask = self.matcher.compute_bitmask()
        if self.matcher.is_error():
            raise GrammarFailed(f"structured output failed: {_first_line(self.matcher.get_error())}")
        return mask

    def follow(self, token_ids: list[int], num_prompt: int) -> None:
        """Follows the request's output (`token_ids` past the first `num_prompt`) beyond what it
        followed already: tokens sampled under this grammar's masks. Only the new tokens are
        sliced. It never raises: a token the grammar refuses leaves the matcher in its error
        state, which `error` reports (llguidance's mask offers some partial UTF-8 tokens its
        parser then refuses)."""
        tokens = token_ids[num_prompt + self.num_followed:]
        self.num_followed = len(token_ids) - num_prompt
        for token in tokens:
            if self.matcher.is_stopped() or not self.matcher.consume_token(token):
                return  # complete (what follows is EOS, which ends the request), or refused

    def error(self) -> str | None:
        """Why the matcher stopped following the output, if it did."""
        if not self.matcher.is_error():
            return None
        return f"structured output failed: {_first_line(self.matcher.get_error())}"


class StructuredOutputs:
    """The engine's grammars: compiled when a request is added (an invalid one refuses the whole
    request before anything is queued), and after each step advanced by what their requests
    emitted. The drafters and the step's rows only read them (`valid_prefix`, `row_masks`)."""

    def __init__(self, compiler: "GrammarCompiler"):
        self.compiler = compiler

    def matchers(self, params: StructuredOutputsParams | None, n: int) -> list[RequestGrammar | None]:
        """One matcher for each of a request's n samples (None: no grammar)."""
        return [self.compiler.matcher(params) if params is not None else None for _ in range(n)]

    def follow(self, emitted: list) -> list[tuple[Any, str]]:
        """Advances the grammars of the requests that emitted tokens this step (`Request`s);
        returns those still running whose grammar refused a token, with the reason."""
        refused = []
        for req in emitted:
            if req.grammar is not None:
                req.grammar.follow(req.token_ids, req.num_prompt_tokens)
                if not req.is_finished and (error := req.grammar.error()):
                    refused.append((req, error))
        return refused


class GrammarCompiler:
    """Turns StructuredOutputsParams into matchers; the llguidance tokenizer is built on first use.
    Thread-safe: the server's frontend compiles in worker threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 limits: GrammarLimits | None = None):
        self._hf_tokenizer = tokenizer
        self.limits = limits if limits is not None else GrammarLimits()
        self._parser_limits = _parser_limits(self.limits)
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()  # -> a template or the error text
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher; GrammarError (a ValueError naming the field) when the grammar is invalid."""
        kind = params.kind
        text = _grammar_text(params)
        key = (kind, text)
        self._check_size(kind, text, params)
        with self._lock:
            entry = self._compiled.get(key)
            owner = entry is None
            if owner:
                entry = self._compiled[key] = cf.Future()
                if len(self._compiled) > _MAX_COMPILED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        if owner:  # the first asker compiles; the same grammar asked meanwhile waits for it
            try:
                entry.set_result(self._compile(kind, text))
            except GrammarError as exc:  # kept too: a client repeating a grammar that fails costs once
                entry.set_result(exc.detail)
            except BaseException as exc:
                with self._lock:
                    if self._compiled.get(key) is entry:
                        del self._compiled[key]
                entry.set_exception(exc)
                raise
        template = entry.result()
        if isinstance(template, str):
            raise GrammarError(kind, template)
        return RequestGrammar(template.deep_copy())

    def _check_size(self, kind: str, text: str, params: StructuredOutputsParams) -> None:
        limits = self.limits
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise GrammarError(kind, f"the grammar is {size} bytes; this server accepts at most {limits.max_bytes} (--max-grammar-bytes)")
        if params.choice is not None and len(params.choice) > limits.max_choices:
            raise GrammarError(kind, f"{len(params.choice)} choices; this server accepts at most {limits.max_choices} (--max-grammar-choices)")

    def _compile(self, kind: str, text: str) -> Any:
        import llguidance

        try:
            grammar = llguidance.grammar_from(_FORMATS[kind], text)
        except ValueError as exc:
            raise GrammarError(kind, str(exc)) from None
        tok = self._tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=self._parser_limits)
        if failed:
            raise GrammarError(kind, messages[0])
        template = llguidance.LLMatcher(tok, grammar, log_level=0, limits=self._parser_limits)
        if template.is_error():
            raise GrammarError(kind, _first_line(template.get_error()))
        self._probe(kind, template)
        return template

    def _probe(self, kind: str, template: Any) -> None:
        """Computes the first mask and takes one step past it (on a copy): llguidance builds its
        lexer lazily, so a regex that explodes or a row past `max_items_in_row` shows only there."""
        mask = template.compute_bitmask()
        if template.is_error():
            raise GrammarError(kind, _first_line(template.get_error()))
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        if self._eos:
            bits[[e for e in self._eos if e < bits.size]] = 0
        allowed = np.flatnonzero(bits)
        if allowed.size == 0:
            return
        probe = template.deep_copy()
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise GrammarError(kind, _first_line(probe.get_error()))
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(kind, _first_line(probe.get_error()))

    def warm(self) -> None:
        """Builds llguidance's tokenizer now (about 1 s) instead of at the first grammar."""
        if self._hf_tokenizer is not None:
            self._tokenizer()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("structured_outputs needs a tokenizer; this model has none")
                self._ll_tokenizer = llguidance_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)
            return self._ll_tokenizer


_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def llguidance_tokenizer(tokenizer: Any, n_vocab: int, eos: list[int]) -> Any:
    """llguidance's view of `tokenizer` for a vocabulary size and EOS ids, built once (about 0.4 s):
    a server builds it while its core loads, and its compiler finds it here."""
    key = (n_vocab, tuple(sorted(eos)))
    with _LL_LOCK:
        built = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if key not in built:
            from llguidance.hf import from_tokenizer

            from verispec.models.tokenizer_cache import hf_tokenizer

            built[key] = from_tokenizer(hf_tokenizer(tokenizer), n_vocab=n_vocab, eos_token=list(key[1]))
        return built[key]


def _parser_limits(limits: GrammarLimits) -> Any:
    import llguidance

    own = ("max_bytes", "max_choices", "timeout_s")
    return llguidance.LLParserLimits(**{k: v for k, v in asdict(limits).items() if k not in own})


def _first_line(message: str) -> str:
    return message.splitlines()[0] if message else "the grammar exceeds the parser's limits"


_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


def _grammar_text(params: StructuredOutputsParams) -> str:
    if params.json_object:
        return '{"type": "object"}'
    if params.json is not None:
        return params.json if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
    if params.choice is not None:
        return json.dumps(params.choice)
    return params.regex if params.regex is not None else params.grammar


def bitmask_tensor(masks: list[bytes | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The rows' allowed tokens (all of them for a row without a grammar); None if no row has a
    grammar. On the CPU a [R, V] bool tensor, unpacked by numpy; elsewhere the [R, ceil(V / 32)]
    int32 words, 32 times less to copy, unpacked on the device."""
    import torch  # here: the server's frontend checks grammars with this module and never imports torch

    if all(m is None for m in masks):
        return None
    words = (vocab_size + 31) // 32
    out = np.full((len(masks), words), -1, dtype=np.int32)
    for i, m in enumerate(masks):
        if m is not None:
            row = np.frombuffer(m, dtype=np.int32)
            out[i, : min(words, row.size)] = row[:words]
    if device.type == "cpu":
        bits = np.unpackbits(out.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    return torch.from_numpy(out).pin_memory().to(device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """Tokens the grammar does not allow become -inf, in place."""
    import torch

    if allowed.dtype == torch.int32:  # packed words: bit j of word w is token 32 w + j
        shifts = torch.arange(32, dtype=torch.int32, device=allowed.device)
        allowed = ((allowed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
