"""What crosses between the server frontend and the engine-core process: msgspec Structs over pyzmq.

Inputs are one tagged union (add / abort / reset the prefix cache / shutdown). Outputs carry *deltas*: only the tokens, text
and logprobs that are new since the last message, so a long generation costs O(n) on the wire.

msgspec decodes a union of a custom type only with None, so every optional part is `X | None` and a
logprob row is three parallel lists instead of a list of Logprob objects.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec


# ----------------------------------------------------------------------------------- to the core
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    # SamplingParams' public fields, already validated by the frontend; the core rebuilds and
    # re-validates them (SamplingParams.__post_init__), so nothing unchecked reaches the engine.
    params: dict[str, Any]
    # The client request it belongs to (None: itself): the core shares its slots fairly between groups.
    group: str | None = None


class AddRequests(msgspec.Struct, tag="add_many"):
    """Requests that arrived together (the prompts of one HTTP request): the core adds them in the
    same loop iteration, so they share their first step as they would in `LLM.generate`."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


PAUSE_MODES = ("abort", "wait", "keep")


class PauseGeneration(msgspec.Struct, tag="pause"):
    """Stop generating (engine/core_process.py, `GenerationGate`): `abort` finishes every unfinished
    request now (finish_reason "abort"), `wait` lets them finish, `keep` holds them where they
    are. Requests that arrive while paused wait for ContinueGeneration. Answered by a ControlReply
    once paused (for `wait`, once the last one finished)."""

    call_id: int
    mode: str = "abort"


class ContinueGeneration(msgspec.Struct, tag="continue"):
    call_id: int


class UpdateWeightsFromDisk(msgspec.Struct, tag="update_weights"):
    """LLM.update_weights on a safetensors file or directory; refused while requests are unfinished."""

    call_id: int
    path: str
    weight_version: int | str | None = None


class InitWeightsUpdateGroup(msgspec.Struct, tag="init_weights_group"):
    """LLM.init_weights_update_group: blocks the core until the trainer has joined."""

    call_id: int
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weights"
    backend: str | None = None


class UpdateWeightsFromDistributed(msgspec.Struct, tag="update_weights_distributed"):
    """LLM.update_weights_from_distributed: the trainer broadcasts these tensors in this order."""

    call_id: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    weight_version: int | str | None = None


CoreInput = (AddRequest | AddRequests | AbortRequests | ResetPrefixCache | Shutdown | PauseGeneration
             | ContinueGeneration | UpdateWeightsFromDisk | InitWeightsUpdateGroup | UpdateWeightsFromDistributed)


# --------------------------------------------------------------------------------- from the core
class LogprobRow(msgspec.Struct, array_like=True):
    """One position's logprobs: the position's own token first, then the alternatives.
    Floats are the engine's float32 values widened exactly to float64."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int | None]
    tokens: list[str | None]


class CompletionDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[LogprobRow] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sources: list[tuple[str, int, int]] | None = None  # (kind, step, drafts) per token: outputs.TokenSource


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    # Sent once, with the request's first delta; entry 0 is None (no logprob for the first token).
    prompt_logprobs: list[LogprobRow | None] | None = None
    # A request the core refused (bad params) or that failed inside the engine.
    error: str | None = None
    error_kind: str | None = None  # "invalid" (the client's fault) or "internal"
    weight_version: int | str | None = None  # the weights the request runs under (LLM.update_weights)


class EngineStats(msgspec.Struct):
    """The engine's counters and gauges, built in one place (`LLMEngine.engine_stats`): the core
    sends it with every output, `/metrics` reads it, `LLM.stats()` is its `as_dict()`."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)
    # Adaptive verification (zeros / empty when off): see spec_decode/adaptive.AdaptiveStats.
    adaptive_steps: int = 0
    adaptive_budget_tokens: int = 0
    adaptive_drafted_tokens: int = 0
    adaptive_admitted_tokens: int = 0
    adaptive_drafting_steps: int = 0
    adaptive_probes: int = 0
    adaptive_capacity_histogram: list[int] = msgspec.field(default_factory=list)
    adaptive_calibration: list[list[float]] = msgspec.field(default_factory=list)
    # Prefix caching, in tokens (queries: prompt tokens looked up at admission) and rows.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_prompt_rows_hits: int = 0
    prefix_cache_blocks: int = 0  # blocks the cache holds now
    prefix_cache_prompt_rows_bytes: int = 0  # cached prompt-logprob rows, bytes now
    weight_version: int | str = 0  # the weights served now (LLM.update_weights)
    num_weight_updates: int = 0

    def as_dict(self) -> dict:
        """`LLM.stats()`: the fields, with the ratios derived from them."""
        out = {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            # Tokens emitted per verify step: the accepted drafts plus the one recovered/bonus token.
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "kv_blocks_total": self.kv_blocks_total,
            "kv_blocks_free": self.kv_blocks_free,
            "kv_cache_usage": 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0,
            "prefix_cache_prompt_rows_hits": self.prefix_cache_prompt_rows_hits,
            "prefix_cache_blocks": self.prefix_cache_blocks,
            "prefix_cache_prompt_rows_bytes": self.prefix_cache_prompt_rows_bytes,
            "weight_version": self.weight_version,
            "num_weight_updates": self.num_weight_updates,
        }
        if self.adaptive_capacity_histogram:  # adaptive verification is on
            steps = self.adaptive_steps
            out["adaptive"] = {
                "num_steps": steps,
                "budget_total": self.adaptive_budget_tokens,
                "drafted_total": self.adaptive_drafted_tokens,
                "admitted_total": self.adaptive_admitted_tokens,
                "mean_admitted_per_step": self.adaptive_admitted_tokens / steps if steps else 0.0,
                # Steps that ran a draft through the forward, and refused requests' drafts verified
                # to renew their estimate (spec_decode/drafting_gate.py).
                "drafting_steps": self.adaptive_drafting_steps,
                "probes": self.adaptive_probes,
                "capacity_histogram": list(self.adaptive_capacity_histogram),
                # Per tenth of confidence: drafts tested, mean confidence, rate accepted.
                "calibration": [{"confidence": f"{i / 10:.1f}-{(i + 1) / 10:.1f}", "drafts": int(n),
                                 "predicted": total / n if n else None, "accepted": hit / n if n else None}
                                for i, (n, total, hit) in enumerate(self.adaptive_calibration)],
            }
        return out


class CoreOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[RequestDelta]
    stats: EngineStats


class CoreReady(msgspec.Struct, tag="ready"):
    """The core's first message: what the frontend needs to validate requests without a round trip."""

    pid: int
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    stats: EngineStats
    # The end-of-sequence ids the core's grammars allow where a grammar completes: the frontend's
    # check compiles with the same ones.
    eos_token_ids: list[int] = []
    runtime: dict[str, str] = {}  # RuntimeInfo.labels(): tier, capability, kernels, step
    runtime_line: str = ""  # RuntimeInfo.line()


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start (bad model path, out of memory ...), or must stop (a
    tensor-parallel worker died): the frontend reports the message."""

    message: str


class ControlReply(msgspec.Struct, tag="reply"):
    """The answer to a control input (pause, continue, update), by its call id."""

    call_id: int
    ok: bool
    message: str = ""
    error_kind: str | None = None  # "invalid" (the caller's input: 400) or "conflict" (the engine's state: 409)
    result: dict[str, Any] = {}


CoreMessage = CoreOutputs | CoreReady | CoreFailed | ControlReply


def split_encodable(encoder: msgspec.msgpack.Encoder, items: list) -> tuple[list, list[tuple[Any, Exception]]]:
    """For a message that failed to encode: its parts that encode alone, and (part, error) for the
    others, so each side fails only the requests whose own data cannot cross."""
    good, bad = [], []
    for item in items:
        try:
            encoder.encode(item)
            good.append(item)
        except Exception as exc:  # noqa: BLE001 - msgspec raises OverflowError, TypeError, ...
            bad.append((item, exc))
    return good, bad


def params_to_wire(params) -> dict:
    """SamplingParams' public fields as plain data (the engine-derived ones stay behind)."""
    out = {}
    for f in fields(params):
        if f.name.startswith("_"):
            continue
        value = getattr(params, f.name)
        out[f.name] = value.value if hasattr(value, "value") else value
    return out
