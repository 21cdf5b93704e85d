"""What /v1/completions and /v1/chat/completions share: the serving context, request -> SamplingParams
translation with errors that name the field, and collecting a request's deltas."""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from verispec.engine.core_client import EngineDeadError
from verispec.engine.core_protocol import LogprobRow, RequestDelta
from verispec.engine.dp_client import DPEngineClient
from verispec.entrypoints.openai.metrics import ServerMetrics
from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.protocol import PromptLogprob, TokenSource, UsageInfo
from verispec.config import GrammarLimits
from verispec.entrypoints.openai.preprocess import PendingWork, Preprocessor
from verispec.sample.grammar import GrammarCompiler, GrammarError
from verispec.sampling_params import SamplingParams, StructuredOutputsParams
from verispec.tokenization import TextEncoder

# JSON has no -inf: a masked alternative's score is reported as this, as vLLM does.
NEG_INF_JSON = -9999.0

# Request fields copied to SamplingParams unchanged when the client sets them.
_PASSTHROUGH = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
    "allowed_token_ids", "bad_words", "logprobs_mode", "logprob_token_ids", "seed", "n", "stop",
    "cache_salt", "speculative", "return_token_sources",
)


def json_float(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_JSON


@dataclass(slots=True)
class ServingContext:
    client: DPEngineClient
    tokenizer: object
    model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    pending: PendingWork  # the server's limits on pending requests and sequences (ServerConfig)
    max_n: int = 16
    max_prompt_tokens: int | None = None
    encoder: TextEncoder | None = None  # None: no tokenizer
    preprocessor: Preprocessor = field(default_factory=Preprocessor)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # the engine core's own
    eos_token_ids: frozenset[int] = frozenset()  # the engine core's own (its grammars end with them)
    _token_text: dict[int, str] = field(default_factory=dict)
    _grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:  # as the core compiles them: its limits, its end-of-sequence ids
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids, self.grammar_limits)
        return self._grammars

    def check_grammar(self, params: StructuredOutputsParams, param: str) -> None:
        """Compiles the grammar here too, with the core's limits and within their time bound, so a
        bad one is a 400 naming the field before anything is queued (the core compiles it again)."""
        limit = self.grammar_limits.timeout_s
        try:
            self.preprocessor.within(limit, self.grammars.matcher, params)
        except TimeoutError:
            raise RequestError(f"{param} is invalid: compiling it took more than {limit} s (--grammar-timeout)",
                               param) from None
        except GrammarError as exc:
            raise RequestError(str(exc) if param == "structured_outputs" else f"{param} is invalid: {exc.detail}",
                               param) from None
        except ValueError as exc:  # no tokenizer
            raise RequestError(str(exc), param) from None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else ""
            self._token_text[token_id] = text
        return text

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_aliases:
            raise RequestError(f"model {name!r} is not served here; this server serves {self.model_name!r}", "model")

    @property
    def prompt_token_limit(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_model_len - 1

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuses, before tokenizing, a text whose length alone says it cannot fit."""
        limit = self.prompt_token_limit
        if self.encoder is not None and num_chars > self.encoder.max_chars(limit):
            raise RequestError(f"the {param} has {num_chars} characters, more than {limit} tokens can hold; "
                               f"this server accepts at most {limit} tokens", param)

    def check_prompt_len(self, num_tokens: int, max_tokens: int | None, param: str,
                         max_tokens_name: str = "max_tokens") -> None:
        """`max_tokens_name`: the field the client set (chat's max_completion_tokens, where given)."""
        if num_tokens == 0:
            raise RequestError(f"{param} must not be empty", param)
        # A server-set cap below the context gets its own message; the context check follows.
        limit = self.max_prompt_tokens
        if limit is not None and limit < self.max_model_len - 1 and num_tokens > limit:
            raise RequestError(
                f"the {param} has {num_tokens} tokens; this server accepts at most {self.max_prompt_tokens}", param
            )
        if num_tokens >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the {param} has "
                f"{num_tokens} tokens; it must leave room for at least one generated token", param
            )
        if max_tokens is not None and num_tokens + max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {num_tokens} prompt "
                f"tokens plus {max_tokens_name}={max_tokens} need {num_tokens + max_tokens}; lower {max_tokens_name}",
                max_tokens_name,
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise RequestError(f"{param} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})", param)


_FIELD_RE = re.compile(r"^([a-z_]+)")


def structured_outputs(req, tool_grammar: dict | None = None) -> tuple[str, dict] | None:
    """The request's grammar, from whichever one field sets it, as StructuredOutputsParams fields
    (`tool_grammar`: the schema a forced tool call imposes, entrypoints/openai/tools.py)."""
    found = [("tool_choice", {"json": tool_grammar})] if tool_grammar is not None else []
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError("response_format.json_schema.schema is required when type is json_schema",
                               "response_format")
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if len(found) > 1:
        raise RequestError(f"{found[1][0]} cannot be combined with {found[0][0]}: a request takes one grammar",
                           found[1][0])
    return found[0] if found else None


def grammar_field(req, tool_grammar: dict | None = None) -> str | None:
    """The field the request's grammar came in (already validated), if it has one."""
    found = structured_outputs(req, tool_grammar)
    return found[0] if found else None


def sampling_params(ctx: ServingContext, req, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, renames: dict[str, str] | None = None,
                    tool_grammar: dict | None = None) -> SamplingParams:
    """SamplingParams from a request; a ValueError becomes a 400 naming the request's field."""
    kw: dict = {"max_tokens": max_tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    grammar = structured_outputs(req, tool_grammar)
    if grammar is not None:
        kw["structured_outputs"] = grammar[1]
        renames = {**(renames or {}), "structured_outputs": grammar[0]}
    for name in _PASSTHROUGH:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.logit_bias is not None:
        kw["logit_bias"] = dict(req.logit_bias)
    if isinstance(kw.get("n"), int) and kw["n"] > ctx.max_n:
        raise RequestError(f"n must be at most {ctx.max_n}; got {kw['n']}", "n")
    try:
        params = SamplingParams(**kw)
        params.check_against_model(ctx.vocab_size, ctx.max_logprobs)
    except ValueError as exc:
        message = str(exc)
        match = _FIELD_RE.match(message)
        name = match.group(1) if match else None
        if name in (renames or {}):  # report the field by the name this route's clients use
            message = renames[name] + message[len(name):]
            name = renames[name]
        raise RequestError(message, name if name in type(req).model_fields else None) from None
    if grammar is not None:
        ctx.check_grammar(params.structured_outputs, grammar[0])
    return params


def token_extras(req, token_ids: list[int], sources: list[tuple[str, int, int]] | None) -> dict:
    """A choice's `token_ids` and `token_sources`, where the request asked for them."""
    out: dict = {}
    if req.return_token_ids:
        out["token_ids"] = list(token_ids)
    if req.return_token_sources:
        out["token_sources"] = [TokenSource(kind=k, step=s, drafts=d) for k, s, d in sources or ()]
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- collecting output
@dataclass(slots=True)
class ChoiceState:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    rows: list[LogprobRow] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sources: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, delta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs:
            self.rows.extend(delta.logprobs)
        if delta.sources:
            self.sources.extend(delta.sources)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class PromptResult:
    prompt_ids: list[int]
    choices: list[ChoiceState]
    prompt_rows: list[LogprobRow | None] | None = None
    weight_version: int | str | None = None


async def stream_request(ctx: ServingContext, request_id: str, prompt_ids: list[int], params: SamplingParams,
                         group: str | None = None, grammar_param: str | None = None) -> AsyncIterator[RequestDelta]:
    """The request's deltas, with errors mapped to HTTP errors and latency metrics recorded.
    `group`: the HTTP request it belongs to (the core shares its slots fairly between groups).
    `grammar_param`: the field its grammar came in, named by a grammar that fails mid-answer."""
    if ctx.client.dead:
        raise RequestError(f"the engine is not running: {ctx.client.dead_reason}", status=503)
    start = last = time.monotonic()
    first = True
    reason = "abort"
    try:
        async for delta in ctx.client.generate(request_id, prompt_ids, params, group=group):
            if delta.error is not None:
                reason = "error"
                invalid = delta.error_kind == "invalid"  # after the checks, only a grammar fails so
                raise RequestError(delta.error, grammar_param if invalid else None, 400 if invalid else 500)
            now = time.monotonic()
            if any(c.token_ids for c in delta.completions):
                ctx.metrics.observe_latency(now - start if first else None, None if first else now - last)
                first, last = False, now
                ctx.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in delta.completions))
            if delta.finished:
                reasons = [c.finish_reason for c in delta.completions if c.finish_reason]
                reason = reasons[-1] if reasons else "stop"
            yield delta
    except EngineDeadError as exc:
        reason = "error"
        raise RequestError(f"the engine is not running: {exc}", status=503) from None
    finally:
        ctx.metrics.finish_request(reason, time.monotonic() - start, len(prompt_ids))


async def collect(ctx: ServingContext, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  group: str | None = None, grammar_param: str | None = None) -> PromptResult:
    result = PromptResult(prompt_ids, [ChoiceState() for _ in range(params.n)])
    async for delta in stream_request(ctx, request_id, prompt_ids, params, group, grammar_param):
        if delta.prompt_logprobs is not None:
            result.prompt_rows = delta.prompt_logprobs
        result.weight_version = delta.weight_version
        for comp in delta.completions:
            result.choices[comp.index].add(comp)
    return result


async def collect_all(ctx: ServingContext, base_id: str, prompts: list[list[int]],
                      params: SamplingParams, grammar_param: str | None = None) -> list[PromptResult]:
    """Runs every prompt of a request concurrently; the first failure cancels (aborts) the rest."""
    tasks = [asyncio.create_task(collect(ctx, f"{base_id}-{i}", ids, params, base_id, grammar_param))
             for i, ids in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnect(request: Request, coro):
    """Awaits `coro` unless the client goes away first; then cancels it, which aborts its engine
    requests and frees their KV blocks."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise RequestError("client disconnected", status=499)
    finally:
        if not task.done():
            task.cancel()


def usage(results: list[PromptResult]) -> UsageInfo:
    prompt = sum(len(r.prompt_ids) for r in results)
    completion = sum(len(c.token_ids) for r in results for c in r.choices)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def prompt_logprobs_json(rows: list[LogprobRow | None] | None) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` shape: per prompt position, token id -> {logprob, rank, decoded_token}."""
    if rows is None:
        return None
    out = []
    for row in rows:
        if row is None:
            out.append(None)
            continue
        out.append({
            str(t): PromptLogprob(logprob=json_float(lp), rank=rank, decoded_token=tok)
            for t, lp, rank, tok in zip(row.token_ids, row.logprobs, row.ranks, row.tokens)
        })
    return out


def error_json(exc: Exception) -> str:
    """The OpenAI error body for an exception (a RequestError keeps its status, type and field)."""
    if not isinstance(exc, RequestError):
        exc = RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500)
    return exc.response_body().model_dump_json()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
