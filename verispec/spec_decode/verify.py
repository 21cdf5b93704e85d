"""One step's sampling, read top to bottom: draft → verify → accept → logprobs → output.

Every sampled request is verified, a request without drafts being one with zero drafts: its
only row is its bonus row, and the bonus row of a request is sampled exactly as plain sampling
would sample it. So there is one path for every sampled row.

Candidate rows are what the host laid out (spec_decode/metadata.py). Compact rows are the ones
verified: request i keeps cap_i + 1 of them, cap_i = d_i without adaptive verification and the
device's admission (spec_decode/adaptive.py) with it. The map from compact rows to candidate
rows is built on the device from the capacities (`cu_num_logits`), so nothing here knows on the
host which rows a request owns. Per chunk of at most `max_rows` compact rows: logits for those
rows only, the processors, the rejection test and the logprob scores. Rows are independent, so a
chunk may end inside a request; `assemble` then reads every row's accept flag at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.outputs import LogprobsTensors
from verispec.sample.processors import apply_processors
from verispec.spec_decode.adaptive import admit
from verispec.spec_decode.metadata import SpecDecodeMetadata
from verispec.spec_decode.rejection import assemble, row_outcomes


@dataclass(slots=True)
class SampleOutput:
    """A step's sampled tokens on the device, until the step's one copy to the host."""

    sampled: torch.Tensor  # [R, K+1] output tokens: accepted drafts, then a recovered or bonus token; -1 padded
    num_sampled: torch.Tensor  # [R] 1 + accepted drafts
    num_verified: torch.Tensor  # [R] drafts verified (the capacity)
    draft_confidence: torch.Tensor | None  # [R, K] q peaks (adaptive verification with a model drafter)
    logprobs: LogprobsTensors | None  # compact rows; request i owns rows cu[i] .. cu[i+1]-1

    def to_cpu_nonblocking(self) -> "SampleOutput":
        move = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        return SampleOutput(move(self.sampled), move(self.num_sampled), move(self.num_verified),
                            move(self.draft_confidence),
                            self.logprobs.to_cpu_nonblocking() if self.logprobs is not None else None)


def verify(model, hidden: torch.Tensor, meta: SpecDecodeMetadata, max_rows: int | None) -> SampleOutput:
    """Samples and verifies the step's rows from the forward's hidden states."""
    dev, r = hidden.device, len(meta.requests)
    # Verify: every draft, or the `budget` slots with the best survival scores (adaptive).
    if meta.survival is None:
        capacities, n = meta.num_drafts, r + sum(meta.num_draft_tokens)
    else:
        capacities, n = admit(meta.survival, meta.budget), r + meta.budget
    # Compact rows: request i owns cap_i + 1 of them, the last its bonus row.
    cu = torch.cat([capacities.new_zeros(1), (capacities + 1).cumsum(0)])  # cu_num_logits
    row_req = torch.repeat_interleave(torch.arange(r, device=dev), capacities + 1, output_size=n)
    row_j = torch.arange(n, device=dev) - cu[row_req]
    cand = meta.cand_start[row_req] + row_j
    flat = meta.first_flat_rows[row_req] + row_j
    drafts = meta.draft_token_ids[row_req, row_j]
    is_bonus = row_j == capacities[row_req]

    accepts, selected, scores = [], [], []
    step = max_rows or n
    for lo in range(0, n, step):
        sl = slice(lo, min(n, lo + step))
        logits = model.compute_logits(hidden[flat[sl]])
        processed = apply_processors(logits, meta.sampling.select(cand[sl]))
        # Accept: each row's rejection test, and the recovered or bonus token it would emit.
        out = row_outcomes(processed, drafts[sl], is_bonus[sl], meta.draws.select(cand[sl]))
        accepts.append(out.accept)
        selected.append(out.selected)
        # Logprobs: of the token each row emits, in its request's own mode.
        if meta.scoring is not None:
            scores.append(meta.scoring.score(logits, processed, out.selected, row_req[sl]))
    # Output: each request's leading run of accepted drafts, then one recovered or bonus token.
    result = assemble(torch.cat(selected), torch.cat(accepts), row_req, row_j, r, meta.draft_token_ids.shape[1])
    logprobs = None
    if scores:
        logprobs = LogprobsTensors.cat(scores)
        logprobs.cu_num_generated_tokens = cu  # chunks are cut by rows: the boundaries are the whole's
    return SampleOutput(result.sampled, result.num_sampled, capacities, meta.draft_confidence, logprobs)
