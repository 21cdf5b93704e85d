"""Outputs: the user-facing, vLLM-shaped results and the device-side logprobs contract.

`LogprobsTensors` stays on the device until the step's single D2H copy; `LogprobsLists` is its host
twin. Both are unpacked by field name, never by position.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch


# ------------------------------------------------------------------------------- user-facing
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class TokenSource:
    """How one output token was produced (`SamplingParams.return_token_sources`)."""

    kind: str  # see TOKEN_SOURCE_KINDS
    step: int  # the engine step that emitted it (LLMEngine.num_steps, from 1)
    drafts: int = 0  # drafts the step verified for the request (0: none, the token was sampled)


# sampled: a step that verified no draft for the request; accepted: a draft the target kept;
# recovered: the target's own token where a draft was rejected; bonus: the token after a step's
# drafts were all accepted.
TOKEN_SOURCE_KINDS = ("sampled", "accepted", "recovered", "bonus")


def token_sources(num_emitted: int, num_verified: int, num_accepted: int, step: int) -> list[TokenSource]:
    """The sources of a step's emitted tokens: its accepted drafts, then one more token."""
    if num_verified == 0:
        return [TokenSource("sampled", step)] * num_emitted
    last = "bonus" if num_accepted == num_verified else "recovered"
    return [TokenSource("accepted", step, num_verified)] * num_accepted + [TokenSource(last, step, num_verified)]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_sources: list[TokenSource] | None = None  # one per token id, when asked for


@dataclass(slots=True)
class ScoreOutput:
    """`LLM.score`'s answer for one completion: each token's logprob dict, as the rollout's
    `CompletionOutput.logprobs` has it (the token and its top `logprobs`)."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # the completion
    logprobs: list[dict[int, Logprob]]
    weight_version: int | str = 0
    error: str | None = None

    @property
    def token_logprobs(self) -> list[float]:
        return [d[t].logprob for d, t in zip(self.logprobs, self.token_ids)]

    @property
    def cumulative_logprob(self) -> float:
        """Summed in order, as the rollout's `cumulative_logprob` is."""
        return sum(self.token_logprobs, 0.0)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    # Set when the request failed inside the engine (its outputs stop where it failed).
    error: str | None = None
    error_kind: str | None = None  # "invalid": the client's input (its grammar hit a limit); else "internal"
    weight_version: int | str = 0  # the weights the whole request ran under (LLM.update_weights)

    def to_dict(self) -> dict[str, Any]:
        def conv(obj):
            if isinstance(obj, (Logprob, TokenSource, CompletionOutput, RequestOutput)):
                return {f.name: conv(getattr(obj, f.name)) for f in fields(obj)}
            if isinstance(obj, dict):
                return {str(k): conv(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [conv(v) for v in obj]
            return obj

        return conv(self)


# ---------------------------------------------------------------------------- logprobs contract
@dataclass(slots=True)
class LogprobsLists:
    logprob_token_ids: np.ndarray  # [R, K+1] int64
    logprobs: np.ndarray  # [R, K+1] float32
    selected_token_ranks: np.ndarray  # [R] int64
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, i: int, num_generated: int | None = None) -> "LogprobsLists":
        """Rows of request i, which owns rows [cu[i], cu[i+1]); num_generated keeps only the
        first rows of that span (the emitted tokens)."""
        if self.cu_num_generated_tokens is None:
            raise ValueError("these rows carry no request boundaries")
        start, end = self.cu_num_generated_tokens[i], self.cu_num_generated_tokens[i + 1]
        if num_generated is not None:
            end = min(end, start + num_generated)
        return self.rows(start, end)

    def rows(self, start: int, end: int | None = None) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.selected_token_ranks[start:end]
        )

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    @staticmethod
    def cat(parts: "list[LogprobsLists]") -> "LogprobsLists":
        if len(parts) == 1:
            return parts[0]
        width = min(p.logprobs.shape[1] for p in parts)  # cached rows may be wider than asked for
        return LogprobsLists(
            np.concatenate([p.logprob_token_ids[:, :width] for p in parts]),
            np.concatenate([p.logprobs[:, :width] for p in parts]),
            np.concatenate([p.selected_token_ranks for p in parts]),
        )


@dataclass(slots=True)
class LogprobsTensors:
    logprob_token_ids: torch.Tensor  # [R, K+1] int64; column 0 = the row's sampled/actual token
    logprobs: torch.Tensor  # [R, K+1] float32 scores in the request's mode; invalid cells -inf
    selected_token_ranks: torch.Tensor  # [R] int64, 1-based
    # Device row boundaries: request i owns rows [cu[i], cu[i+1]). Verification decides them on
    # the device (adaptive), so the host learns them only with the step's copy. None: one request.
    cu_num_generated_tokens: torch.Tensor | None = None

    def to_cpu_nonblocking(self) -> "LogprobsTensors":
        if self.logprobs.device.type == "cpu":
            return self
        move = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        return LogprobsTensors(
            logprob_token_ids=move(self.logprob_token_ids),
            logprobs=move(self.logprobs),
            selected_token_ranks=move(self.selected_token_ranks),
            cu_num_generated_tokens=move(self.cu_num_generated_tokens),
        )

    def tolists(self) -> LogprobsLists:
        """Host lists; call only after the step's synchronisation point."""
        cu = self.cu_num_generated_tokens
        return LogprobsLists(
            logprob_token_ids=self.logprob_token_ids.numpy(),
            logprobs=self.logprobs.numpy(),
            selected_token_ranks=self.selected_token_ranks.numpy(),
            cu_num_generated_tokens=cu.tolist() if cu is not None else None,
        )

    @staticmethod
    def cat(chunks: list["LogprobsTensors"]) -> "LogprobsTensors":
        """Concatenates chunks of rows (without boundaries: a chunk may end inside a request);
        widths are padded with -inf / -1."""
        if any(c.cu_num_generated_tokens is not None for c in chunks):
            raise ValueError("chunks of rows carry no request boundaries; set them on the whole")
        if len(chunks) == 1:
            return chunks[0]
        width = max(c.logprobs.shape[1] for c in chunks)

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        return LogprobsTensors(
            logprob_token_ids=torch.cat([pad(c.logprob_token_ids, -1) for c in chunks]),
            logprobs=torch.cat([pad(c.logprobs, float("-inf")) for c in chunks]),
            selected_token_ranks=torch.cat([c.selected_token_ranks for c in chunks]),
        )
