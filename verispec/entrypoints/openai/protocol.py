"""Pydantic models of the OpenAI-compatible API: what clients send and what they get back.

Field names and shapes follow the OpenAI API (and vLLM's extensions where OpenAI has none:
`top_k`, `min_p`, `repetition_penalty`, `prompt_logprobs`, `logprobs_mode`, `logprob_token_ids` ...).
Unknown fields are ignored, as OpenAI's own server and vLLM do, so newer clients keep working.
Known fields are strict: `true` is no integer and `"3"` no number (a 400 naming the field).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from verispec.sampling_params import is_valid_text


def _check_unicode(value: Any) -> Any:
    """JSON may carry a lone surrogate ("\\ud800"), which no tokenizer or UTF-8 encoder takes."""
    if isinstance(value, str):
        if not is_valid_text(value):
            raise ValueError("text must be valid Unicode (it holds a lone surrogate)")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(_Model):
    model_config = ConfigDict(extra="ignore", strict=True)
    # Every field of every request model: no text reaches the tokenizer or the wire un-encodable.
    _unicode = field_validator("*")(_check_unicode)


# ------------------------------------------------------------------------------------- errors
class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


# ------------------------------------------------------------------------------------ requests
class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # verispec / vLLM extensions
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str | None = Field(
        default=None, description="raw_logprobs | raw_logits | processed_logprobs | processed_logits"
    )
    logprob_token_ids: list[int] | None = None
    cache_salt: str | None = Field(
        default=None, description="requests with different salts never share cached prefix blocks"
    )
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        default=None, description="one of json (a schema), regex, choice, grammar (Lark or GBNF), json_object"
    )
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # How each token came about (docs/server.md, "Token ids and token sources").
    speculative: bool = Field(default=True, description="false: no drafts for this request (plain decoding)")
    return_token_ids: bool = Field(default=False, description="the prompt's and each choice's token ids")
    return_token_sources: bool = Field(
        default=False, description="per output token: sampled, accepted (draft), recovered or bonus, and its step"
    )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    parse_special_tokens: bool = Field(
        default=False, description="read special-token text in text prompts as control tokens (default: as text)"
    )


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, valid against the function's parameters


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's answer to one of those calls.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    # "none" / "auto": a text answer (no tool-call parser runs); "required" or a named function:
    # the answer is forced by a grammar into tool calls whose arguments fit their schemas.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    parse_special_tokens: bool = False  # as on /v1/completions


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------------- responses
class UsageInfo(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(_Model):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(_Model):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TokenSource(_Model):
    """How an output token came about: a step without drafts (sampled), a draft the target
    accepted, the target's token where a draft was rejected (recovered), or the token after a step
    whose drafts were all accepted (bonus)."""

    kind: Literal["sampled", "accepted", "recovered", "bonus"]
    step: int = Field(description="the engine step that emitted it")
    drafts: int = Field(description="drafts that step verified for this request")


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # With return_token_ids / return_token_sources (in a stream: this chunk's tokens; the prompt's ids once).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    token_sources: list[TokenSource] | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # verispec's extension: the weights the answer was generated under (POST /update_weights_from_disk).
    weight_version: int | str | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Model):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # as in CompletionChoice
    token_sources: list[TokenSource] | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    weight_version: int | str | None = None  # as in CompletionResponse
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(_Model):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # as in CompletionChoice
    token_sources: list[TokenSource] | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    weight_version: int | str | None = None  # as in CompletionResponse; on chunks made from the engine's output
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "verispec"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Model):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Model):
    prompt: str


class TokenizerInfoResponse(_Model):
    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
    add_bos_token: bool | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class ReplicaHealth(_Model):
    """One data-parallel replica (engine core) behind the server."""

    dp_rank: int
    engine_core_pid: int | None = None
    alive: bool
    num_requests_in_flight: int = Field(description="routed to this replica and not finished")
    num_requests_routed: int = Field(description="requests routed to this replica since start")
    num_prefix_hits: int = Field(description="of which: routed where a block of the prompt was remembered")
    detail: str | None = None


class HealthResponse(_Model):
    # "degraded": some data-parallel replicas are down, the others serve (still a 200).
    status: Literal["ok", "degraded", "unhealthy"]
    engine_core_pid: int | None = None
    detail: str | None = None
    replicas: list[ReplicaHealth] | None = None  # with --data-parallel-size above 1
