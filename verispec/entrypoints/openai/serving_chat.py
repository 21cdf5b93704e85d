"""POST /v1/chat/completions: messages through the chat template, logprobs as
`content[{token, logprob, bytes, top_logprobs}]`, streaming with optional usage."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from verispec.engine.core_protocol import LogprobRow
from verispec.entrypoints.chat_utils import chat_prompt_ids
from verispec.entrypoints.openai.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatStreamChoice, ChatTokenLogprob, DeltaMessage, DeltaToolCall, TopLogprob, UsageInfo,
)
from verispec.entrypoints.openai.tools import forces_tools, tool_calls, tool_schema
from verispec.entrypoints.openai.serving import (
    RequestError, ServingContext, collect, error_json, grammar_field, json_float, new_id, prompt_logprobs_json,
    sampling_params, sse, stream_request, token_extras, usage,
)


def _messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise RequestError(f"messages[{i}].content: only text parts are supported; got {part.type!r}",
                                       "messages")
                parts.append(part.text)
            content = "".join(parts)
        entry = {"role": msg.role, "content": content if content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(msg, key) is not None:
                entry[key] = getattr(msg, key)
        out.append(entry)
    return out


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest):
    """Everything before the engine: validation, the chat template, sampling params (in a worker thread)."""
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    if req.stream and req.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    if ctx.tokenizer is None:
        raise RequestError("this model has no tokenizer and chat template; use /v1/completions", "messages")
    tools = [t.model_dump() for t in req.tools] if req.tools else None
    messages = _messages(req)
    _check_size(ctx, messages, tools)
    try:
        ids = chat_prompt_ids(ctx.tokenizer, messages, req.add_generation_prompt, tools=tools)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs and req.logprob_token_ids is None else None
    params = sampling_params(ctx, req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
                             renames={"logprobs": "top_logprobs", "max_tokens": max_name}, tool_grammar=tool_schema(req))
    ctx.check_prompt_len(len(ids), max_tokens, "messages", max_name)
    return ids, params


def _check_size(ctx: ServingContext, messages: list[dict], tools: list[dict] | None) -> None:
    """Before the template runs: what the template renders of the client's text, counted in
    characters (JSON compactly), cannot exceed what the prompt limit's tokens can spell."""
    if len(messages) > ctx.prompt_token_limit:
        raise RequestError(f"messages holds {len(messages)} messages; this server accepts at most "
                           f"{ctx.prompt_token_limit} tokens", "messages")
    compact = {"separators": (",", ":"), "ensure_ascii": False}
    ctx.check_chars(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls") or "", **compact))
                        for m in messages), "messages")
    if tools:
        ctx.check_chars(len(json.dumps(tools, **compact)), "tools")


def _shows_logprobs(req: ChatCompletionRequest) -> bool:
    return req.logprobs or req.logprob_token_ids is not None


def _token_entry(ctx: ServingContext, token_id: int, logprob: float, text: str | None) -> TopLogprob:
    text = text if text is not None else ctx.token_text(token_id)
    return TopLogprob(token=text, logprob=json_float(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(ctx: ServingContext, rows: list[LogprobRow], k: int, custom: list[int] | None = None) -> ChatLogprobs:
    """`k` top alternatives per token; with `logprob_token_ids`, exactly those ids instead."""
    content = []
    for row in rows:
        chosen = _token_entry(ctx, row.token_ids[0], row.logprobs[0], row.tokens[0])
        alts = [_token_entry(ctx, t, lp, s) for t, lp, s in zip(row.token_ids[1:], row.logprobs[1:], row.tokens[1:])]
        # The engine lists the sampled token once, first. Among the top-k it belongs at its rank;
        # among custom ids, where the client put it.
        if custom is not None:
            if row.token_ids[0] in custom:
                alts.insert(custom.index(row.token_ids[0]), chosen)
            top = alts
        else:
            rank = row.ranks[0]
            if rank is not None and rank <= k:
                alts.insert(rank - 1, chosen)
            top = alts[:k]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


async def create_chat(ctx: ServingContext, req: ChatCompletionRequest, prepared) -> ChatCompletionResponse:
    ids, params = prepared
    request_id = new_id("chatcmpl")
    result = await collect(ctx, request_id, ids, params, grammar_param=grammar_field(req, tool_schema(req)))
    k = req.top_logprobs or 0
    choices = []
    for i, c in enumerate(result.choices):
        message, reason = _answer(req, c.text, c.finish_reason)
        choices.append(ChatChoice(
            index=i, message=message,
            logprobs=chat_logprobs(ctx, c.rows, k, req.logprob_token_ids) if _shows_logprobs(req) else None,
            finish_reason=reason, stop_reason=c.stop_reason, **token_extras(req, c.token_ids, c.sources),
        ))
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=usage([result]), weight_version=result.weight_version,
        prompt_logprobs=prompt_logprobs_json(result.prompt_rows) if req.prompt_logprobs is not None else None,
        prompt_token_ids=ids if req.return_token_ids else None,
    )


def _answer(req: ChatCompletionRequest, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The assistant's message: forced tool calls when the answer completed, else its text."""
    calls = tool_calls(req, text) if forces_tools(req) and reason == "stop" else None
    if calls is None:
        return AssistantMessage(content=text), reason
    return AssistantMessage(content=None, tool_calls=calls), "tool_calls"


def stream_chat(ctx: ServingContext, req: ChatCompletionRequest, prepared) -> AsyncIterator[str]:
    return _stream(ctx, req, *prepared)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, ids: list[int], params) -> AsyncIterator[str]:
    request_id = new_id("chatcmpl")
    created = int(time.time())
    k = req.top_logprobs or 0

    version = None  # the engine's, from its first output on

    def chunk(choices: list[ChatStreamChoice], use: UsageInfo | None = None, prompt_ids=None) -> str:
        body = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=use,
                                   weight_version=version, prompt_token_ids=prompt_ids)
        return sse(body.model_dump_json())

    for i in range(params.n):
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                    prompt_ids=ids if req.return_token_ids and i == 0 else None)
    completion_tokens = 0
    # Forced tool calls go out whole, once each answer is complete: arguments arrive as one delta.
    held = [""] * params.n if forces_tools(req) else None
    try:
        async for delta in stream_request(ctx, request_id, ids, params,
                                          grammar_param=grammar_field(req, tool_schema(req))):
            version = delta.weight_version
            for comp in delta.completions:
                completion_tokens += len(comp.token_ids)
                lp = chat_logprobs(ctx, comp.logprobs, k, req.logprob_token_ids) if _shows_logprobs(req) and comp.logprobs else None
                text, reason, calls = comp.text, comp.finish_reason, None
                if held is not None:
                    held[comp.index] += comp.text
                    text = ""
                    if reason is not None:
                        message, reason = _answer(req, held[comp.index], reason)
                        text, calls = message.content or "", message.tool_calls
                extras = token_extras(req, comp.token_ids, comp.sources) if comp.token_ids else {}
                if text or lp is not None or reason is not None or extras:
                    tool_deltas = [DeltaToolCall(index=j, **c.model_dump()) for j, c in enumerate(calls or [])]
                    yield chunk([ChatStreamChoice(
                        index=comp.index, delta=DeltaMessage(content=text or None, tool_calls=tool_deltas or None),
                        logprobs=lp, finish_reason=reason, stop_reason=comp.stop_reason, **extras,
                    )])
    except Exception as exc:  # noqa: BLE001 - after the headers went out, errors travel as an event
        yield sse(error_json(exc))
        yield sse("[DONE]")
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        use = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                        total_tokens=len(ids) + completion_tokens)
        yield chunk([], use)
    yield sse("[DONE]")
