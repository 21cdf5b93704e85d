"""Host-side output processing: append tokens, detokenize, check stops, build logprob dicts.

The output processor owns what a request has emitted: it appends the step's tokens to the
request (cut at the first stop, which finishes it) and keeps each request's text, logprob dicts
and token sources in an `OutputState` of its own, by request id, from `add` to `forget`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tokenizers.decoders import DecodeStream

from verispec.core.request import Request, RequestStatus
from verispec.outputs import CompletionOutput, Logprob, LogprobsLists, TokenSource, token_sources

if TYPE_CHECKING:
    from verispec.core.step_types import SchedulerOutput, StepResult


@dataclass(slots=True)
class IncrementalText:
    """A request's output text, decoded a token at a time by the tokenizers library's DecodeStream:
    constant work per token instead of re-decoding the whole output every step. A token that ends
    inside a UTF-8 character is held back until a later one completes it."""

    stream: DecodeStream
    text: str = ""
    pending: int = 0  # tokens pushed since the last released text: an unfinished character

    def push(self, backend, token_id: int) -> None:
        chunk = self.stream.step(backend, token_id)
        if chunk is None:
            self.pending += 1
        else:
            self.text += chunk
            self.pending = 0


@dataclass(slots=True)
class OutputState:
    """What a request has emitted beyond its token ids (OutputProcessor's, by request id)."""

    text: str = ""
    detok: IncrementalText | None = None  # once a token has been decoded
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None  # when the request keeps them
    # Entry i belongs to prompt token i (None where nothing is scored); when the request scores its prompt.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    token_sources: list[TokenSource] | None = None  # one per output token, when asked for


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}
        # The Rust tokenizer under a fast HF tokenizer: what DecodeStream steps with.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._states: dict[str, OutputState] = {}

    # ------------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        """A new request: its empty output (prompt rows before the first scored one are None)."""
        self._states[req.request_id] = OutputState(
            logprobs=[] if req.keeps_logprobs else None,
            prompt_logprobs=[None] * (req.num_prompt_logprob_rows + 1) if req.scores_prompt else None,
            token_sources=[] if req.params.return_token_sources else None,
        )

    def state(self, req: Request) -> OutputState:
        return self._states[req.request_id]

    def forget(self, request_id: str) -> None:
        """The request's output has been delivered for the last time."""
        self._states.pop(request_id, None)

    # ------------------------------------------------------------------ text
    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ logprobs
    def logprob_dicts(
        self, lists: LogprobsLists, num_rows: int, width: int, custom: bool = False
    ) -> list[dict[int, Logprob]]:
        """One dict per row: the row's own token first (with its rank), then `width` alternatives
        (top-k, ranked 1..k, or custom ids, unranked). -1 means every column."""
        if width == -1:
            width = lists.logprobs.shape[1] - 1
        out = []
        for r in range(num_rows):
            ids = lists.logprob_token_ids[r]
            vals = lists.logprobs[r]
            chosen = int(ids[0])
            entry = {chosen: Logprob(float(vals[0]), int(lists.selected_token_ranks[r]), self.token_text(chosen))}
            for j in range(1, width + 1):
                tok = int(ids[j])
                if tok not in entry:
                    entry[tok] = Logprob(float(vals[j]), None if custom else j, self.token_text(tok))
            out.append(entry)
        return out

    # ------------------------------------------------------------------ one step
    def process_step(self, sched: "SchedulerOutput", result: "StepResult", skip: set[str] = frozenset(),
                     step: int = 0) -> list[Request]:
        """Appends one step's prompt logprobs and tokens to its requests (except those in `skip`),
        checks stops. Returns the requests that emitted tokens.
        `step` numbers the step for the token sources of requests that asked for them."""
        emitted = []
        for s in sched.scheduled:
            req = s.request
            if req.request_id in skip:
                continue
            if s.cached_prompt_rows is not None:
                self.append_prompt_logprobs(req, *s.cached_prompt_rows)
            record = result.get(req.request_id)
            if record is None:
                continue
            if record.prompt_logprobs is not None:
                self.append_prompt_logprobs(req, *record.prompt_logprobs)
            if record.sampled:
                before = req.num_tokens
                self.append_tokens(req, record.sampled, record.logprobs)
                state = self._states[req.request_id]
                if state.token_sources is not None:  # as many as append_tokens kept (a stop cuts)
                    sources = token_sources(len(record.sampled), record.num_verified, record.num_accepted, step)
                    state.token_sources.extend(sources[: req.num_tokens - before])
                emitted.append(req)
        return emitted

    # ------------------------------------------------------------------ tokens
    def append_tokens(self, req: Request, tokens: list[int], lists: LogprobsLists | None) -> None:
        """Appends sampled tokens one by one, stopping at the first stop condition."""
        p, state = req.params, self._states[req.request_id]
        dicts = None
        if lists is not None:
            custom = p.logprob_token_ids is not None
            width = len(p.logprob_token_ids) if custom else p.logprobs or 0
            dicts = self.logprob_dicts(lists, len(tokens), width, custom)
        for i, tok in enumerate(tokens):
            req.token_ids.append(tok)
            if dicts is not None:
                state.logprobs.append(dicts[i])
                state.cumulative_logprob += float(np.float32(lists.logprobs[i, 0]))
            n_out = req.num_output_tokens
            if tok in req.stop_ids and n_out > p.min_tokens:
                req.status = RequestStatus.FINISHED_STOPPED
                state.stop_reason = None if tok not in (p.stop_token_ids or []) else tok
                break  # the stop token itself is not part of the text
            self._detokenize(req, state, tok)
            if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
                req.status = RequestStatus.FINISHED_LENGTH
                break
            if p.stop and i + 1 < len(tokens) and self._stop_reached(req, state):
                break  # accepted drafts past a stop string are not output: plain decoding stops here
        self._update_text(req, state)

    def _stop_reached(self, req: Request, state: OutputState) -> bool:
        """Whether the text so far completes a stop string (checked between a step's tokens)."""
        if self.tokenizer is None:
            return False
        if self._backend is not None and state.detok is not None:
            text = state.detok.text
        else:
            text = self.decode(req.output_token_ids, req.params.skip_special_tokens)
        return self._find_stop(text, req.params.stop, len(state.text)) is not None

    def append_prompt_logprobs(self, req: Request, first: int, lists: LogprobsLists) -> None:
        """Rows predicting prompt tokens first+1 ...; entry i of the list belongs to prompt token i."""
        rows = self._states[req.request_id].prompt_logprobs
        if len(rows) != first + 1:
            raise RuntimeError(f"prompt logprobs out of order for {req.request_id}")
        rows.extend(self.logprob_dicts(lists, lists.logprobs.shape[0], req.params.prompt_logprobs))

    def _detokenize(self, req: Request, state: OutputState, token_id: int) -> None:
        if self._backend is None:
            return
        if state.detok is None:
            state.detok = IncrementalText(DecodeStream(skip_special_tokens=req.params.skip_special_tokens))
        state.detok.push(self._backend, token_id)

    def _update_text(self, req: Request, state: OutputState) -> None:
        if self.tokenizer is None:
            return
        p = req.params
        text = state.detok.text if state.detok is not None else ""
        if self._backend is None or (req.is_finished and state.detok is not None and state.detok.pending):
            # No Rust tokenizer to stream with, or an output ending inside a character (whose bytes
            # the full decode shows as U+FFFD): decode the whole output once.
            ids = req.output_token_ids[:-1] if req.status == RequestStatus.FINISHED_STOPPED else req.output_token_ids
            text = self.decode(ids, p.skip_special_tokens)
            if not req.is_finished:
                text = text.rstrip("\ufffd")  # incomplete UTF-8 is held back while the request runs
        if p.stop:
            hit = self._find_stop(text, p.stop, len(state.text))
            if hit is not None:
                pos, stop = hit
                text = text[: pos + len(stop)] if p.include_stop_str_in_output else text[:pos]
                req.status = RequestStatus.FINISHED_STOPPED
                state.stop_reason = stop
        state.text = text

    @staticmethod
    def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
        best = None
        for stop in stops:
            # Only text that is new this step can complete a stop string.
            pos = text.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def completion(self, req: Request, index: int) -> CompletionOutput:
        finished, state = req.is_finished, self._states[req.request_id]
        return CompletionOutput(
            index=index,
            text=state.text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=state.logprobs,
            finish_reason=req.status.value if finished else None,
            stop_reason=state.stop_reason if finished else None,
            token_sources=list(state.token_sources) if state.token_sources is not None else None,
        )
