"""Drafters propose draft tokens for the requests that are decoding.

Every drafter is a `Drafter`: it proposes at the end of a step, as many drafts as the draft policy
gives each request room for, and hears when a request leaves.
- `NgramDrafter` (and suffix decoding, spec_decode/suffix.py) propose values from the tokens
  already there.
- `ModelDrafter`s (layer_skip, draft_model) reserve PLACEHOLDER slots, then draft inside the next
  step, after scheduling and before the verify forward (`draft`): the drafts stay on the device
  with q, the processed draft distribution (spec_decode/metadata.py, `ModelDrafts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.config import SpeculativeConfig
from verispec.device_copy import to_device
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.kv_cache_tensors import LayerCache
from verispec.models.llama import LlamaModel
from verispec.core.request import Request
from verispec.core.step_types import Drafts
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.processors import apply_processors
from verispec.sample.sampler import sample
from verispec.spec_decode.metadata import PLACEHOLDER, ModelDrafts
from verispec.spec_decode.ngram import propose_ngram


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """What a model drafter reads of the engine, given to it explicitly by the runner."""

    target: LlamaModel
    target_kv: list[LayerCache]  # the target's cache, one entry per layer
    block_table: Callable[[str], list[int]]  # request id -> its blocks (shared by every cache)
    block_size: int
    num_blocks: int
    vocab_size: int
    device: torch.device


def needs_token_values(req: Request) -> bool:
    """Whether the request's processors read the values of earlier tokens (not just their count)."""
    p = req.params
    return bool(
        p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        or req.bad_words_token_ids
    )


class Drafter(Protocol):
    """What the draft policy (spec_decode/policy.py) asks of every drafter. `drafts_in_step`: a
    `ModelDrafter`, whose drafts are placeholders until it drafts inside the next step;
    `calibrated`: its confidences are chances of acceptance already (adaptive verification)."""

    drafts_in_step: bool
    calibrated: bool

    def propose(self, running: list[Request], rooms: list[int]) -> dict[str, Drafts]:
        """Drafts for the next step, by request id: at most rooms[i] for running[i] (0: none)."""

    def finish(self, request_id: str) -> None:
        """The request left the engine (finished, aborted or failed)."""


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's
    last n tokens."""

    drafts_in_step = False
    calibrated = False

    def __init__(self, cfg: SpeculativeConfig):
        self.n_min, self.n_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, running: list[Request], rooms: list[int]) -> dict[str, Drafts]:
        out = {}
        for req, room in zip(running, rooms):
            if room:
                drafts = propose_ngram(req.token_ids, room, self.n_min, self.n_max)
                if req.grammar is not None:  # only drafts the grammar allows can be verified
                    drafts = drafts[: req.grammar.valid_prefix(drafts)]
                out[req.request_id] = Drafts(tuple(drafts))
        return out

    def finish(self, request_id: str) -> None:
        pass


class ModelDrafter:
    """A drafter that runs a model inside the step (layer_skip, draft_model): it reserves
    placeholders at the end of a step, so the scheduler can budget and allocate them, then drafts
    after scheduling and before the verify forward (`draft`), and sees the target's every forward
    (`observe`) to keep its own cache in step."""

    drafts_in_step = True
    calibrated = False
    num_layers: int | None = None  # layers of the drafting model to run (None: all)
    # Of the last `draft`, the seconds spent catching up on the context of steps that did not
    # draft (DSpark's pending writes): paid once after a pause, not by every drafting step.
    catch_up_seconds: float = 0.0

    def propose(self, running: list[Request], rooms: list[int]) -> dict[str, Drafts]:
        # A constrained request is not drafted for: its drafts would appear on the device in
        # mid-step, and each one's grammar mask would need the host, a sync per draft.
        return {req.request_id: Drafts((PLACEHOLDER,) * room)
                for req, room in zip(running, rooms) if room and req.grammar is None}

    def finish(self, request_id: str) -> None:
        pass

    def model_and_cache(self, inputs: DraftInputs) -> tuple[LlamaModel, list[LayerCache]]:
        raise NotImplementedError

    def observe(self, inputs: DraftInputs, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Called with the target's flat batch after its forward; keeps the drafter's cache in step."""

    @torch.inference_mode()
    def draft(self, inputs: DraftInputs, scheduled) -> dict[str, ModelDrafts]:
        """Drafts for the placeholders of the scheduled requests (the step's `ScheduledRequest`s),
        by request id."""
        jobs = [s for s in scheduled if s.drafts]
        if not jobs:
            return {}
        model, kv_layers = self.model_and_cache(inputs)
        dev = inputs.device
        drafts: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        confidence: list[list[torch.Tensor]] = [[] for _ in jobs]
        device_drafts: list[list[torch.Tensor]] = [[] for _ in jobs]
        last = to_device([s.request.token_ids[s.request.num_computed_tokens] for s in jobs], device=dev)
        for j in range(max(len(s.draft_token_ids) for s in jobs)):
            # Step j feeds each request's newest token (the pending one, then its drafts) at its
            # position, through the drafting model and into the drafting model's cache.
            active = [i for i, s in enumerate(jobs) if len(s.draft_token_ids) > j]
            spans, positions = [], []
            for row, i in enumerate(active):
                req = jobs[i].request
                pos = req.num_computed_tokens + j
                positions.append(pos)
                spans.append(SeqSpan(row, 1, pos + 1, inputs.block_table(req.request_id)))
            meta = build_attention_metadata(spans, inputs.block_size, dev, model.dtype)
            index = to_device(active, dtype=torch.long, device=dev)
            hidden = model(last[index], to_device(positions, device=dev), meta, kv_layers, self.num_layers)
            rows = [jobs[i].request.row(drafts[i], purpose="draft",
                                        device_tail=device_tail(jobs[i].request, device_drafts[i])) for i in active]
            md = SamplingMetadata.build(rows, inputs.vocab_size, dev)
            processed = apply_processors(model.compute_logits(hidden), md)
            tokens = sample(processed, md)
            q = processed.softmax(dim=-1)
            # The slot's confidence for adaptive verification: q's peak. For a greedy request that
            # is q(x) itself. For a random one it must not be q(x): whether a draft is verified may
            # depend on the drafts before it but not on its own value, or the accepted tokens
            # would lean toward the drafter's favourites (docs/adaptive.md).
            conf = q.amax(dim=-1)
            last = last.index_copy(0, index, tokens)
            # Drafts stay on the device: the host keeps a placeholder per draft (their count), and
            # processors that read values (penalties, bad words) read the device tail.
            for row, i in enumerate(active):
                drafts[i].append(PLACEHOLDER)
                probs[i].append(q[row])
                confidence[i].append(conf[row])
                device_drafts[i].append(tokens[row])
        return {s.request.request_id: ModelDrafts(token_ids=torch.stack(t), probs=torch.stack(q),
                                                  confidence=torch.stack(c))
                for s, q, t, c in zip(jobs, probs, device_drafts, confidence)}


def device_tail(req: Request, drafted: list[torch.Tensor]) -> torch.Tensor | None:
    """The device values of a request's drafts so far, where its processors read values."""
    return torch.stack(drafted) if drafted and needs_token_values(req) else None
