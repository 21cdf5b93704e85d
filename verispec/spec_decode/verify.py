"""One step's sampling, read top to bottom: draft → verify → accept → logprobs → output.

Every sampled request is verified, a request without drafts being one with zero drafts: its
only row is its bonus row, and the bonus row of a request is sampled exactly as plain sampling
would sample it. So there is one path for every sampled row.

Candidate rows are what the host laid out (spec_decode/metadata.py). Compact rows are the ones
verified: request i keeps cap_i + 1 of them, cap_i = d_i without adaptive verification and the
device's admission (spec_decode/adaptive.py) with it. The map from compact rows to candidate
rows is built on the device from the capacities (`cu_num_logits`), so nothing here knows on the
host which rows a request owns; without adaptive verification the host lays them out itself.
Per chunk of at most `max_rows` compact rows: logits for those
rows only, the processors, the rejection test and the logprob scores. Rows are independent, so a
chunk may end inside a request; `assemble` then reads every row's accept flag at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from verispec.device_copy import to_device
from verispec.outputs import LogprobsTensors
from verispec.sample.processors import apply_processors
from verispec.spec_decode.admission import admit
from verispec.spec_decode.metadata import PLACEHOLDER, SpecDecodeMetadata
from verispec.spec_decode.rejection import assemble, row_outcomes


@dataclass(slots=True)
class SampleOutput:
    """A step's sampled tokens on the device, until the step's one copy to the host."""

    sampled: torch.Tensor  # [R, K+1] output tokens: accepted drafts, then a recovered or bonus token; -1 padded
    num_sampled: torch.Tensor  # [R] 1 + accepted drafts
    num_verified: torch.Tensor | None  # [R] drafts verified (the capacity); None: every draft
    draft_confidence: torch.Tensor | None  # [R, K] q peaks (adaptive verification with a model drafter)
    logprobs: LogprobsTensors | None  # compact rows; request i owns rows cu[i] .. cu[i+1]-1

    def to_cpu_nonblocking(self) -> "SampleOutput":
        move = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        return SampleOutput(move(self.sampled), move(self.num_sampled), move(self.num_verified),
                            move(self.draft_confidence),
                            self.logprobs.to_cpu_nonblocking() if self.logprobs is not None else None)


@dataclass(slots=True)
class CompactRows:
    """The rows verified: request i owns cap_i + 1 of them (cu[i] .. cu[i+1]-1), the last its
    bonus row; cap_i = d_i unless adaptive verification admits fewer."""

    n: int
    req: torch.Tensor  # [n] the row's request
    j: torch.Tensor  # [n] its position among the request's rows
    flat: torch.Tensor  # [n] its flat-batch row
    is_bonus: torch.Tensor  # [n] bool
    drafts: torch.Tensor  # [n] the draft each row verifies (PLACEHOLDER on bonus rows)
    cu: torch.Tensor  # [R+1] cu_num_logits
    cand: torch.Tensor | None  # [n] its candidate row; None: the candidate rows, in order

    @classmethod
    def every_draft(cls, meta: SpecDecodeMetadata, device: torch.device) -> "CompactRows":
        """Every draft verified: the compact rows are the candidate rows, laid out on the host."""
        d = meta.num_draft_tokens
        req = [i for i, x in enumerate(d) for _ in range(x + 1)]
        j = [x for n in d for x in range(n + 1)]
        flat = [meta.first_flat_rows[i] + x for i, x in zip(req, j)]
        bonus = [int(x == d[i]) for i, x in zip(req, j)]
        drafts = [t for ids in meta.host_draft_ids for t in ids + [PLACEHOLDER]]  # the bonus row verifies none
        cu = list(itertools.accumulate((x + 1 for x in d), initial=0))
        n = len(req)
        host = to_device(req + j + flat + bonus + drafts + cu, dtype=torch.long, device=device)  # one copy
        cols = [host[c * n : (c + 1) * n] for c in range(5)]
        if meta.fill is not None:  # some drafts exist only on the device
            cols[4] = meta.draft_token_ids[cols[0], cols[1]]
        return cls(n, cols[0], cols[1], cols[2], cols[3].bool(), cols[4], host[5 * n :], None)

    @classmethod
    def admitted(cls, meta: SpecDecodeMetadata, capacities: torch.Tensor, n: int) -> "CompactRows":
        """Capacities decided on the device: the layout is built there, from n = R + B alone."""
        dev = capacities.device
        cu = torch.cat([capacities.new_zeros(1), (capacities + 1).cumsum(0)])
        req = torch.repeat_interleave(torch.arange(len(meta.requests), device=dev), capacities + 1, output_size=n)
        j = torch.arange(n, device=dev) - cu[req]
        d = meta.num_draft_tokens
        starts = to_device([meta.first_flat_rows, list(itertools.accumulate((x + 1 for x in d[:-1]), initial=0))],
                           dtype=torch.long, device=dev)  # first flat row, first candidate row
        return cls(n, req, j, starts[0][req] + j, j == capacities[req], meta.draft_token_ids[req, j], cu,
                   starts[1][req] + j)


def verify(model, hidden: torch.Tensor, meta: SpecDecodeMetadata, max_rows: int | None) -> SampleOutput:
    """Samples and verifies the step's rows from the forward's hidden states."""
    dev, r = hidden.device, len(meta.requests)
    # Verify: every draft, or the `budget` slots with the best survival scores (adaptive).
    if meta.survival is None:
        capacities, rows = None, CompactRows.every_draft(meta, dev)
    else:
        capacities = admit(meta.survival, meta.budget)
        rows = CompactRows.admitted(meta, capacities, r + meta.budget)
    step = max_rows or rows.n
    if rows.cand is None and step < rows.n:
        rows.cand = torch.arange(rows.n, device=dev)

    accepts, selected, scores = [], [], []
    for lo in range(0, rows.n, step):
        sl = slice(lo, min(rows.n, lo + step))
        cand = rows.cand[sl] if rows.cand is not None else None
        logits = model.compute_logits(hidden[rows.flat[sl]])
        processed = apply_processors(logits, meta.sampling if cand is None else meta.sampling.select(cand))
        # Accept: each row's rejection test, and the recovered or bonus token it would emit.
        draws = meta.draws if cand is None else meta.draws.select(cand)
        out = row_outcomes(processed, rows.drafts[sl], rows.is_bonus[sl], draws)
        accepts.append(out.accept)
        selected.append(out.selected)
        # Logprobs: of the token each row emits, in its request's own mode.
        if meta.scoring is not None:
            scores.append(meta.scoring.score(logits, processed, out.selected, rows.req[sl]))
    # Output: each request's leading run of accepted drafts, then one recovered or bonus token.
    width = max(meta.num_draft_tokens) + 1
    result = assemble(torch.cat(selected), torch.cat(accepts), rows.req, rows.j, r, width)
    logprobs = None
    if scores:
        logprobs = LogprobsTensors.cat(scores)
        logprobs.cu_num_generated_tokens = rows.cu  # chunks are cut by rows: the boundaries are the whole's
    return SampleOutput(result.sampled, result.num_sampled, capacities, meta.draft_confidence, logprobs)
