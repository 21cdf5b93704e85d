"""A step's verification over compact rows, in chunks of rows.

Candidate rows are what the host laid out: request i has d_i + 1 of them (one per draft, then the
bonus), in the flat batch and in the host-built metadata (processor inputs, noise keys, q rows).
Compact rows are the ones verified: request i keeps cap_i + 1 of them, where cap_i = d_i without
adaptive verification and the device's admission (spec_decode/adaptive.py) with it. The map from
compact rows to candidate rows is built on the device from the capacities (`cu_num_logits`), so
nothing here knows on the host which rows a request owns: only their total, R + B.

Per chunk of at most `max_rows` compact rows: logits for those rows only, the processors, the
per-row verification statistics and the logprob scores. Rows are independent, so a chunk may end
inside a request; `assemble` then reads every row's accept flag at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.device_copy import to_device
from verispec.outputs import LogprobsTensors
from verispec.sample.logprobs import RequestScoring
from verispec.sample.metadata import RowSpec, SamplingMetadata
from verispec.sample.noise import exponential_rows, uniform_values
from verispec.sample.processors import apply_processors
from verispec.spec_decode.adaptive import admit
from verispec.spec_decode.rejection import assemble, row_outcomes


@dataclass(slots=True)
class VerifyBatchOutput:
    sampled: torch.Tensor  # [R, K+1] emitted tokens, -1 padded
    num_sampled: torch.Tensor  # [R]
    capacities: torch.Tensor  # [R] drafts verified per request
    confidence: torch.Tensor | None  # [R, K] q peak at each draft (adaptive, model drafters)
    logprobs: LogprobsTensors | None  # compact rows, boundaries in cu_num_generated_tokens_tensor


@dataclass(slots=True)
class VerifyRequest:
    """What the runner knows of one sampled request on the host."""

    rows: list[RowSpec]  # its candidate rows: one per draft, then the bonus row
    first_flat_row: int  # the flat-batch row of its first candidate row
    host_drafts: list[int]  # draft values known on the host (placeholders for device drafts)
    device_drafts: torch.Tensor | None  # [d] drafts that live on the device
    q: torch.Tensor | None  # [d, V] draft probabilities (q-drafters)
    confidence: torch.Tensor | None  # [d] q peak at each draft position, on the device
    host_scores: list[float] | None  # [d] survival scores known on the host (ngram)

    @property
    def spec(self) -> RowSpec:
        """The request's first verify row: its parameters, mode and logprob settings."""
        return self.rows[0]


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def survival_scores(reqs: list[VerifyRequest], width: int, device: torch.device,
                    calibration: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R, width] survival scores on the device (-inf past each request's drafts), and the raw
    q peaks of model drafters' drafts [R, width] (zeros elsewhere).

    Host scores (ngram) are used as they are; q goes through the calibration table
    (edges, [greedy/random, bucket] acceptance rates), looked up on the device."""
    host = [(r.host_scores or []) + [float("-inf")] * (width - len(r.host_scores or [])) for r in reqs]
    scores = to_device(host, dtype=torch.float32, device=device)
    if calibration is None or all(r.confidence is None for r in reqs):
        return scores, None
    edges, table = calibration
    raw = torch.zeros(len(reqs), width, device=device)
    for i, r in enumerate(reqs):
        if r.confidence is not None and r.host_scores is None:
            raw[i, : r.confidence.shape[0]] = r.confidence.float()
    mode = to_device([0 if r.spec.params.greedy else 1 for r in reqs], dtype=torch.long, device=device)
    bucket = torch.searchsorted(edges, raw, right=True) - 1
    calibrated = table[mode[:, None], bucket].cumprod(dim=1)
    has = to_device([r.confidence is not None and r.host_scores is None for r in reqs], device=device)
    drafted = torch.arange(width, device=device)[None, :] < to_device(
        [len(r.host_drafts) for r in reqs], device=device)[:, None]
    scores = torch.where(has[:, None] & drafted, calibrated, scores)
    return scores, raw


def verify_batch(model, hidden: torch.Tensor, reqs: list[VerifyRequest], vocab: int, budget: int | None,
                 max_rows: int | None, calibration: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> VerifyBatchOutput:
    dev = hidden.device
    r = len(reqs)
    d = [len(x.host_drafts) for x in reqs]
    k = max(d)
    num_drafts = to_device(d, dtype=torch.long, device=dev)
    confidence = None
    if budget is None:
        capacities, n = num_drafts, r + sum(d)
    else:
        survival, confidence = survival_scores(reqs, k, dev, calibration)
        capacities, n = admit(survival, budget), r + budget
    cu = _exclusive_cumsum(capacities + 1)  # cu_num_logits: exists only here, on the device
    row_req = torch.repeat_interleave(torch.arange(r, device=dev), capacities + 1, output_size=n)
    row_j = torch.arange(n, device=dev) - cu[row_req]
    cand_base = to_device([0] + [x + 1 for x in d], dtype=torch.long, device=dev).cumsum(0)
    cand = cand_base[row_req] + row_j
    flat = to_device([x.first_flat_row for x in reqs], dtype=torch.long, device=dev)[row_req] + row_j

    drafts = to_device([x.host_drafts + [0] * (k + 1 - len(x.host_drafts)) for x in reqs],
                          dtype=torch.long, device=dev)
    for i, x in enumerate(reqs):
        if x.device_drafts is not None:
            drafts[i, : x.device_drafts.shape[0]] = x.device_drafts
    row_draft = drafts[row_req, row_j]
    is_bonus = row_j == capacities[row_req]

    rows = [spec for x in reqs for spec in x.rows]
    md = SamplingMetadata.build(rows, vocab, dev)
    greedy_req = to_device([x.spec.params.greedy for x in reqs], dtype=torch.bool, device=dev)
    race = None
    if not all(md.greedy):
        race = exponential_rows([spec.noise_key() for spec in rows], vocab, dev)
    q = uses_q = accept_u = recover = None
    with_q = [x.q is not None and not x.spec.params.greedy for x in reqs]
    if any(with_q):
        q = torch.cat([torch.cat([x.q, x.q.new_zeros(1, vocab)]) if x.q is not None else
                       hidden.new_zeros(len(x.rows), vocab, dtype=torch.float32) for x in reqs])
        uses_q = to_device(with_q, dtype=torch.bool, device=dev)
        keys = {"accept": [], "recover": []}
        for x, has in zip(reqs, with_q):
            for j, spec in enumerate(x.rows):
                real = has and j < len(x.host_drafts)
                for purpose in keys:
                    keys[purpose].append(spec.noise.key(purpose, spec.position) if real else None)
        accept_u = uniform_values(keys["accept"], dev)
        recover = exponential_rows(keys["recover"], vocab, dev)
    scoring = RequestScoring.build([x.spec for x in reqs], vocab, dev)

    accepts, selected, chunks = [], [], []
    step = max_rows or n
    for lo in range(0, n, step):
        sl = slice(lo, min(n, lo + step))
        c = cand[sl]
        logits = model.compute_logits(hidden[flat[sl]])
        processed = apply_processors(logits, md.select(c))
        out = row_outcomes(
            processed, row_draft[sl], is_bonus[sl], greedy_req[row_req[sl]],
            race[c] if race is not None else None,
            q[c] if q is not None else None, uses_q[row_req[sl]] if q is not None else None,
            accept_u[c] if q is not None else None, recover[c] if q is not None else None,
        )
        accepts.append(out.accept)
        selected.append(out.selected)
        if scoring is not None:
            chunks.append(scoring.score(logits, processed, out.selected, row_req[sl]))
    result = assemble(torch.cat(selected), torch.cat(accepts), row_req, row_j, r, k + 1)
    logprobs = None
    if chunks:
        whole = LogprobsTensors.cat(chunks)
        # Chunks are cut by rows, not requests: the boundaries belong to the whole.
        logprobs = LogprobsTensors(whole.logprob_token_ids, whole.logprobs, whole.selected_token_ranks,
                                   cu_num_generated_tokens_tensor=cu)
    return VerifyBatchOutput(result.sampled, result.num_sampled, capacities, confidence, logprobs)
