"""Per-request engine state: token ids, progress through the cache, status and random noise keys."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.config import LogprobsMode
from verispec.sample.metadata import RowSpec
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from verispec.sample.grammar import RequestGrammar


@dataclass(slots=True, frozen=True)
class ScoredCompletion:
    """A request that scores a given completion (`LLM.score`): its prompt tokens from `start` on
    are the completion, and their rows are scored as the rollout's decode rows were, under the
    rollout's `params` (penalties, bad words and min_tokens see the completion as output)."""

    start: int  # index of the completion's first token in the engine prompt
    params: SamplingParams  # the rollout's parameters
    rows_key: tuple = ()  # what besides the prefix decides the rows (the prefix cache's key)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)  # identity: the scheduler's list lookups must not compare fields
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    logprobs_mode: LogprobsMode
    noise: RequestNoise  # position-keyed random draws (sample/noise.py)
    stop_ids: frozenset[int]  # EOS ids (unless ignore_eos) + stop_token_ids
    max_tokens: int
    # `bad_words` as token sequences, tokenized by the engine (each word alone and after a space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # prompt + output tokens; the cache holds the first num_computed_tokens of them
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # What the step computes besides the sampled tokens: logprob rows for each emitted token, and
    # the prompt's own logprobs (only the first of n > 1 samples scores the shared prompt), whose
    # first num_prompt_logprob_rows positions are done (kept across a preemption).
    keeps_logprobs: bool = False
    scores_prompt: bool = False
    num_prompt_logprob_rows: int = 0
    # With n > 1, the sibling whose prompt the others wait for (to hit it in the prefix cache).
    prefill_leader: "Request | None" = None
    grammar: "RequestGrammar | None" = None  # structured output: the matcher at the end of the output
    # The client request it belongs to (empty: its own id). The scheduler shares the running slots
    # fairly between groups, so one request of 3,000 prompts cannot starve a later one.
    group: str = ""
    arrival: int = -1  # queue order, set when first queued; a preempted request keeps its place
    scored: ScoredCompletion | None = None

    def __post_init__(self) -> None:
        if self.scored is not None:  # only the completion's rows are scored
            self.scores_prompt = True
            self.num_prompt_logprob_rows = self.scored.start - 1
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group:
            self.group = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    # ------------------------------------------------------------------ its rows
    def row(self, drafts: Sequence[int] = (), purpose: str = "sample",
            device_tail: torch.Tensor | None = None) -> RowSpec:
        """The row that emits the token after the request's tokens plus `drafts` (accepted, as
        far as this row knows: penalties and min_tokens see them). `device_tail`: the device
        values of the last drafts, when the host holds placeholders for them."""
        return RowSpec(params=self.params, prompt_ids=self.prompt_token_ids,
                       output_ids=self.output_token_ids + list(drafts), noise=self.noise, stop_ids=self.stop_ids,
                       mode=self.logprobs_mode, num_logprobs=self.params.logprobs, purpose=purpose,
                       bad_words_token_ids=self.bad_words_token_ids, device_tail=device_tail)

    def scored_rows(self, lo: int, hi: int) -> list[RowSpec]:
        """The rows at positions [lo, hi) of a scored completion (`LLM.score`), as the rollout's
        decode rows were: the rollout's parameters, the completion up to each row as output."""
        scored = self.scored
        prompt = self.prompt_token_ids[: scored.start]  # one list, shared by every row
        return [RowSpec(params=scored.params, prompt_ids=prompt, output_ids=self.prompt_token_ids[scored.start : p + 1],
                        noise=None, stop_ids=self.stop_ids, mode=self.logprobs_mode,
                        num_logprobs=self.params.prompt_logprobs, bad_words_token_ids=self.bad_words_token_ids)
                for p in range(lo, hi)]

