"""SpecDecodeMetadata: a step's drafts and sampled rows, built once, in one place.

Every sampled request is a verify request. Request i carries d_i draft tokens (d_i = 0 is plain
sampling, exactly) and owns d_i + 1 *candidate rows*: row j is the target's distribution after the
request's tokens plus drafts 1..j, and verifies draft j+1; the last one is the bonus row. A draft
id is a host value where the host knows it (ngram, or a model draft whose request's processors
read token values) and PLACEHOLDER where only the device does; `draft_token_ids` holds every
draft's device value.

Built after the adaptive plan and the model drafter, from host values and tensors already on the
device: nothing here reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.device_copy import to_device
from verispec.sample.logprobs import RequestScoring
from verispec.sample.metadata import RowSpec, SamplingMetadata
from verispec.spec_decode.adaptive import survival_scores
from verispec.spec_decode.rejection import RowDraws

if TYPE_CHECKING:
    from verispec.core.request import Request
    from verispec.core.step_types import AdaptivePlan, ScheduledRequest

# A draft whose value only the device knows. Not a token id: fed to the model unreplaced, it fails.
PLACEHOLDER = -1


@dataclass(slots=True)
class ModelDrafts:
    """One request's drafts from a model drafter, made inside the step; they stay on the device."""

    token_ids: torch.Tensor  # [d] int64
    probs: torch.Tensor | None  # [d, V] q: the processed draft distribution (None: a greedy request's, unused)
    confidence: torch.Tensor  # [d] q's peak at each position (adaptive verification)


@dataclass(slots=True)
class SpecDecodeMetadata:
    requests: list["Request"]  # the step's sampled requests, in batch order
    num_draft_tokens: list[int]  # d_i
    host_draft_ids: list[list[int]]  # per request: draft values known on the host, else PLACEHOLDER
    rows: list[RowSpec]  # candidate rows, request after request
    first_flat_rows: list[int]  # flat-batch row of each request's first candidate row
    # [R, K+1] int64 device values of the drafts, PLACEHOLDER padded; only where the host's
    # values are not enough (model drafts, or adaptive verification's device-side layout).
    draft_token_ids: torch.Tensor | None
    sampling: SamplingMetadata  # processor inputs, one per candidate row
    draws: RowDraws  # per candidate row: greedy flag, noise, q
    scoring: RequestScoring | None  # per request logprob settings; None: nobody asked
    # Adaptive verification: [R, K] survival scores (-inf past each request's drafts) and the
    # number of drafts the device admits; None: every draft is verified.
    survival: torch.Tensor | None = None
    budget: int = 0
    draft_confidence: torch.Tensor | None = None  # [R, K] q peaks, copied back for calibration
    # (flat rows, request, position) of model drafts that replace their placeholders in the batch
    fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, sampled: list["ScheduledRequest"], first_flat_rows: list[int], drafts: dict[str, ModelDrafts],
              plan: "AdaptivePlan | None", vocab: int, device: torch.device) -> "SpecDecodeMetadata":
        reqs = [s.request for s in sampled]
        model = [drafts.get(r.request_id) for r in reqs]
        # A model's drafts are placeholders on the host; rows read their values on the device.
        ids = [[PLACEHOLDER] * m.token_ids.shape[0] if m is not None else list(s.draft_token_ids)
               for s, m in zip(sampled, model)]
        d = [len(x) for x in ids]
        k = max(d)
        per_request = [[req.row(x[:j], device_tail=m.token_ids[:j] if m is not None and j else None)
                        for j in range(len(x) + 1)] for req, x, m in zip(reqs, ids, model)]
        for req, x, group in zip(reqs, ids, per_request):
            if req.grammar is not None:  # one mask per candidate row (model drafters skip these requests)
                for spec, mask in zip(group, req.grammar.row_masks(x)):
                    spec.grammar_mask = mask
        rows = [spec for group in per_request for spec in group]
        draft_ids = fill = None
        on_device = any(m is not None for m in model)
        if on_device or plan is not None:
            draft_ids = to_device([x + [PLACEHOLDER] * (k + 1 - len(x)) for x in ids], dtype=torch.long, device=device)
        if on_device:
            at = [(first + 1 + j, i, j) for i, (m, first) in enumerate(zip(model, first_flat_rows)) if m is not None
                  for j in range(m.token_ids.shape[0])]
            fill = tuple(to_device(list(col), dtype=torch.long, device=device) for col in zip(*at))
            draft_ids[fill[1], fill[2]] = torch.cat([m.token_ids for m in model if m is not None])
        meta = cls(
            requests=reqs,
            num_draft_tokens=d,
            host_draft_ids=ids,
            rows=rows,
            first_flat_rows=first_flat_rows,
            draft_token_ids=draft_ids,
            sampling=SamplingMetadata.build(rows, vocab, device),
            draws=RowDraws.build(per_request, _q_rows(sampled, model, d), vocab, device),
            scoring=RequestScoring.build([r.logprobs_mode for r in reqs], [r.params.logprobs for r in reqs],
                                         [r.params.logprob_token_ids for r in reqs], vocab, device),
            fill=fill,
        )
        if plan is not None:
            meta.budget = plan.budget
            meta.survival, meta.draft_confidence = survival_scores(
                plan, reqs, d, [m.confidence if m is not None else None for m in model], device)
        return meta

    def write_drafts(self, input_ids: torch.Tensor) -> None:
        """Model drafts replace their placeholders in the flat batch's input ids (on the device)."""
        if self.fill is not None:
            rows, req, j = self.fill
            input_ids[rows] = self.draft_token_ids[req, j]


def _q_rows(sampled: list["ScheduledRequest"], model: list[ModelDrafts | None],
            num_drafts: list[int]) -> list[torch.Tensor | list[tuple[list[int], list[float]]] | None]:
    """Each request's q rows: a model drafter's [d, V], on the device already, or a host drafter's
    (token ids, probabilities) per draft (suffix decoding), which stay sparse; None: one-hot."""
    return [m.probs if m is not None else list(s.drafts.q[:d]) if s.drafts.q and d else None
            for s, m, d in zip(sampled, model, num_drafts)]
