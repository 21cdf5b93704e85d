"""POST /v1/completions: prompts as text or token ids, echo, logprobs, prompt logprobs, streaming.

This is the route lm-eval's `local-completions` scores with: `echo=True, logprobs=1, max_tokens=0 or 1`
on token-id prompts. With echo and logprobs the prompt's own tokens come first, the first one with a
null logprob, and every sampled token's logprob is the same float as its entry in `top_logprobs`
(lm-eval tests greediness with `==`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from verispec.engine.core_protocol import LogprobRow
from verispec.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, UsageInfo,
)
from verispec.entrypoints.openai.serving import (
    ChoiceState, PromptResult, RequestError, ServingContext, collect_all, error_json, grammar_field, json_float, new_id,
    prompt_logprobs_json, sampling_params, sse, stream_request, token_extras, usage,
)


def prompt_list(prompt) -> list:
    """The request's prompts, from any of the four accepted shapes: strings or token-id lists."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    return list(prompt)


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt. Text is checked against the context by its length
    first, then tokenized in one batch; special-token text stays text unless the request says
    `parse_special_tokens`."""
    prompts = prompt_list(req.prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise RequestError("prompt must not be empty", "prompt")
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and ctx.encoder is None:
        raise RequestError("this model has no tokenizer: send prompt as token ids", "prompt")
    for text in texts:
        ctx.check_chars(len(text), "prompt")
    encoded = iter(ctx.encoder.encode(texts, special_tokens=req.parse_special_tokens, add_special_tokens=True)
                   if texts else [])
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, next(encoded)))
        else:
            ctx.check_token_ids(p, "prompt")
            out.append((None, list(p)))
    return out


class CompletionBuilder:
    """Turns engine rows into the OpenAI `logprobs` object, keeping running text offsets."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.offset = 0

    def token_text(self, token_id: int) -> str:
        return self.ctx.token_text(token_id)

    def add_prompt(self, lp: CompletionLogprobs, prompt_ids: list[int], rows: list[LogprobRow | None] | None) -> None:
        rows = rows or [None] * len(prompt_ids)
        for tok, row in zip(prompt_ids, rows):
            if row is None:  # the first prompt token has no logprob
                text = self.token_text(tok)
                lp.tokens.append(text)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                lp.text_offset.append(self.offset)
                self.offset += len(text)
            else:
                self.add_row(lp, row)

    def add_row(self, lp: CompletionLogprobs, row: LogprobRow) -> None:
        text = row.tokens[0] if row.tokens[0] is not None else self.token_text(row.token_ids[0])
        value = json_float(row.logprobs[0])
        lp.tokens.append(text)
        lp.token_logprobs.append(value)
        lp.text_offset.append(self.offset)
        self.offset += len(text)
        # The row's own token goes in first, so an alternative that decodes to the same text
        # never replaces its value: `token_logprobs[i] == top_logprobs[i][tokens[i]]` holds.
        top = {text: value}
        for t, v, s in zip(row.token_ids[1:], row.logprobs[1:], row.tokens[1:]):
            top.setdefault(s if s is not None else self.token_text(t), json_float(v))
        lp.top_logprobs.append(top)


def _wants_logprobs(req: CompletionRequest) -> bool:
    return req.logprobs is not None or req.logprob_token_ids is not None


def prepare_completion(ctx: ServingContext, req: CompletionRequest):
    """Everything before the engine: validation, tokenization, sampling params (in a worker thread)."""
    ctx.check_model(req.model)
    if req.max_tokens is not None and req.max_tokens < 0:
        raise RequestError(f"max_tokens must be >= 0; got {req.max_tokens}", "max_tokens")
    if req.stream and req.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs is not available with stream=true; use echo with logprobs",
                           "prompt_logprobs")
    prompts = _prompts(ctx, req)
    # max_tokens=0 scores the prompt only. The engine always samples once after the prompt, so it
    # runs with max_tokens=1 and the sampled token is dropped: the prompt's logprobs do not depend on it.
    prompt_only = req.max_tokens == 0
    if prompt_only and req.min_tokens:
        raise RequestError("min_tokens must be 0 when max_tokens is 0", "min_tokens")
    prompt_lp = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_lp is None:
        prompt_lp = req.logprobs
    params = sampling_params(ctx, req, max_tokens=1 if prompt_only else req.max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=prompt_lp)
    for _, ids in prompts:
        ctx.check_prompt_len(len(ids), params.max_tokens, "prompt")
    return prompts, params, prompt_only


def _choice(ctx: ServingContext, req: CompletionRequest, index: int, prompt_text: str | None, result: PromptResult,
            choice: ChoiceState, prompt_only: bool) -> CompletionChoice:
    text = "" if prompt_only else choice.text
    lp = None
    if req.echo:
        text = (prompt_text if prompt_text is not None else ctx.detokenize(result.prompt_ids)) + text
    if _wants_logprobs(req):
        lp = CompletionLogprobs()
        builder = CompletionBuilder(ctx)
        if req.echo:
            builder.add_prompt(lp, result.prompt_ids, result.prompt_rows)
        if not prompt_only:
            for row in choice.rows:
                builder.add_row(lp, row)
    return CompletionChoice(
        index=index, text=text, logprobs=lp,
        finish_reason="length" if prompt_only else choice.finish_reason,
        stop_reason=None if prompt_only else choice.stop_reason,
        prompt_logprobs=prompt_logprobs_json(result.prompt_rows) if req.prompt_logprobs is not None else None,
        prompt_token_ids=result.prompt_ids if req.return_token_ids else None,
        **token_extras(req, [] if prompt_only else choice.token_ids, None if prompt_only else choice.sources),
    )


async def create_completion(ctx: ServingContext, req: CompletionRequest, prepared) -> CompletionResponse:
    prompts, params, prompt_only = prepared
    request_id = new_id("cmpl")
    results = await collect_all(ctx, request_id, [ids for _, ids in prompts], params, grammar_field(req))
    choices = []
    for p, ((text, _), result) in enumerate(zip(prompts, results)):
        for i, choice in enumerate(result.choices):
            choices.append(_choice(ctx, req, p * params.n + i, text, result, choice, prompt_only))
    use = usage(results)
    if prompt_only:
        use = UsageInfo(prompt_tokens=use.prompt_tokens, completion_tokens=0, total_tokens=use.prompt_tokens)
    return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=use,
                              weight_version=results[0].weight_version if results else None)


def stream_completion(ctx: ServingContext, req: CompletionRequest, prepared) -> AsyncIterator[str]:
    return _stream(ctx, req, *prepared)


@dataclass(slots=True)
class _StreamState:
    """One completion stream's chunks: what has gone out per prompt, each choice's logprob builder."""

    ctx: ServingContext
    req: CompletionRequest
    prompts: list[tuple[str | None, list[int]]]
    n: int
    prompt_only: bool
    request_id: str = field(default_factory=lambda: new_id("cmpl"))
    created: int = field(default_factory=lambda: int(time.time()))
    builders: dict = field(default_factory=dict)  # (prompt, sample) -> CompletionBuilder
    num_tokens: list[int] = field(default_factory=list)  # per prompt
    prompt_sent: list[bool] = field(default_factory=list)  # the prompt's text (echo) or ids (return_token_ids) went out

    def __post_init__(self) -> None:
        self.builders = {(p, i): CompletionBuilder(self.ctx) for p in range(len(self.prompts)) for i in range(self.n)}
        self.num_tokens = [0] * len(self.prompts)
        self.prompt_sent = [False] * len(self.prompts)

    def chunk(self, delta, index: int, text: str, lp: CompletionLogprobs | None, finish: str | None = None,
              stop=None, **extras) -> str:
        """One choice's event, under the weight version of the engine delta it comes from."""
        body = CompletionResponse(
            id=self.request_id, created=self.created, model=self.ctx.model_name,
            choices=[CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop,
                                      **extras)],
            weight_version=delta.weight_version,
        )
        return sse(body.model_dump_json(exclude_unset=False))

    def events(self, p: int, delta) -> Iterator[str]:
        """The events of prompt p's engine delta: its echo first (once), then each choice's text."""
        req, wants_lp = self.req, _wants_logprobs(self.req)
        text_p, ids = self.prompts[p]
        if req.echo and not self.prompt_sent[p]:
            self.prompt_sent[p] = True
            echo_text = text_p if text_p is not None else self.ctx.detokenize(ids)
            for i in range(self.n):
                lp = None
                if wants_lp:
                    lp = CompletionLogprobs()
                    self.builders[(p, i)].add_prompt(lp, ids, delta.prompt_logprobs)
                yield self.chunk(delta, p * self.n + i, echo_text, lp,
                                 prompt_token_ids=ids if req.return_token_ids else None)
        self.num_tokens[p] += sum(len(c.token_ids) for c in delta.completions)
        for comp in delta.completions:
            index = p * self.n + comp.index
            if self.prompt_only:
                if comp.finish_reason is not None:
                    yield self.chunk(delta, index, "", None, "length")
                continue
            lp = None
            if wants_lp and comp.logprobs:
                lp = CompletionLogprobs()
                for row in comp.logprobs:
                    self.builders[(p, comp.index)].add_row(lp, row)
            extras = token_extras(req, comp.token_ids, comp.sources) if comp.token_ids else {}
            if not self.prompt_sent[p] and req.return_token_ids and "token_ids" in extras:
                self.prompt_sent[p] = True  # without echo, the prompt's ids ride on its first tokens
                extras["prompt_token_ids"] = ids
            if comp.text or lp is not None or comp.finish_reason is not None or extras:
                yield self.chunk(delta, index, comp.text, lp, comp.finish_reason, comp.stop_reason, **extras)

    def usage_event(self) -> str | None:
        """The usage chunk, when the client asked for it (stream_options.include_usage)."""
        if self.req.stream_options is None or not self.req.stream_options.include_usage:
            return None
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        completion_tokens = 0 if self.prompt_only else sum(self.num_tokens)
        body = CompletionResponse(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=[],
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens),
        )
        return sse(body.model_dump_json())


async def _stream(ctx, req, prompts, params, prompt_only) -> AsyncIterator[str]:
    """One server-sent-event stream from first chunk to [DONE]: an engine request per prompt, their
    deltas through one queue in arrival order; a failure ends the stream with an error event."""
    state = _StreamState(ctx, req, prompts, params.n, prompt_only)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, ids: list[int]) -> None:
        try:
            async for delta in stream_request(ctx, f"{state.request_id}-{p}", ids, params, state.request_id,
                                              grammar_field(req)):
                queue.put_nowait((p, delta))
        except Exception as exc:  # noqa: BLE001 - forwarded to the client as an error event
            queue.put_nowait((p, exc))
        finally:
            queue.put_nowait((p, None))

    tasks = [asyncio.create_task(pump(p, ids)) for p, (_, ids) in enumerate(prompts)]
    remaining = len(prompts)
    try:
        while remaining:
            p, delta = await queue.get()
            if delta is None:
                remaining -= 1
                continue
            if isinstance(delta, Exception):
                yield sse(error_json(delta))
                break
            for event in state.events(p, delta):
                yield event
        if (usage_event := state.usage_event()) is not None:
            yield usage_event
        yield sse("[DONE]")
    finally:
        for task in tasks:  # a disconnected client: cancelling aborts the engine requests
            task.cancel()

