"""The one logprob scorer: the selected (or actual) token, top-k or custom ids, and ranks.

Sampled rows and prompt rows go through the same `RequestScoring.score`. Each row takes its
request's settings by gathering on the device, because under verification a row's request is
known only there. Scores are gathered first and cast after: the only [R, V]-sized work is the
max, the chunked log-sum-exp, the top-k selection and the rank comparison, never a full fp32 copy
made just to gather from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.config import LogprobsMode
from verispec.device_copy import to_device
from verispec.outputs import LogprobsTensors

# Columns per chunk of the streaming log-sum-exp: keeps its temporaries to [R, 8192].
LSE_CHUNK = 8192


def streaming_logsumexp(scores: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(scores))) per row in fp32, one vocab chunk at a time."""
    m = scores.amax(dim=-1).float()
    # A row of all -inf has no mass; keep it -inf instead of producing NaN.
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.zeros_like(m)
    for c in range(0, scores.shape[1], LSE_CHUNK):
        total += (scores[:, c : c + LSE_CHUNK].float() - safe_m[:, None]).exp().sum(dim=-1)
    return safe_m + total.log()


@dataclass(slots=True)
class RequestScoring:
    """Per-request logprob settings as device tensors; row r belongs to request row_req[r]."""

    is_raw: torch.Tensor  # [R] bool: raw scores (else processed)
    is_logprobs: torch.Tensor  # [R] bool: normalised (else logits)
    num_topk: int  # widest top-k asked (vocab for -1); 0 when nobody asks for top-k
    custom_ids: torch.Tensor | None  # [R, C] ids (padded by repeating the first); None: nobody
    is_custom: torch.Tensor | None  # [R] bool
    all_raw: bool
    all_processed: bool

    @classmethod
    def build(cls, modes: list[LogprobsMode], num_topk: list[int | None], custom: list[list[int] | None],
              vocab: int, device: torch.device) -> "RequestScoring | None":
        """One entry per request: its mode, its top-k (-1: the whole vocabulary; None: none) and
        its custom ids (None: none). None when no request wants logprobs."""
        if all(k is None for k in num_topk) and not any(custom):
            return None
        topks = [k for k, c in zip(num_topk, custom) if k is not None and not c]
        width = max((len(c) for c in custom if c), default=0)
        raw = [m.is_raw for m in modes]
        return cls(
            is_raw=to_device(raw, dtype=torch.bool, device=device),
            is_logprobs=to_device([m.is_logprobs for m in modes], dtype=torch.bool, device=device),
            num_topk=vocab if -1 in topks else max(topks, default=0),
            custom_ids=to_device([(c + c[:1] * (width - len(c))) if c else [0] * width for c in custom],
                                 dtype=torch.long, device=device) if width else None,
            is_custom=to_device([bool(c) for c in custom], dtype=torch.bool, device=device) if width else None,
            all_raw=all(raw),
            all_processed=not any(raw),
        )

    def score(self, raw: torch.Tensor, processed: torch.Tensor | None, selected: torch.Tensor,
              row_req: torch.Tensor) -> LogprobsTensors:
        """Scores rows [n] of requests row_req [n], each in its own request's mode. Ranks count
        the entries whose score is >= the selected token's (1-based); log-softmax is monotone
        per row, so counting on the scores gives the rank of the returned logprobs."""
        if self.all_raw or self.all_processed:
            scores = raw if self.all_raw else processed
        else:
            scores = torch.where(self.is_raw[row_req][:, None], raw.float(), processed)
        selected = selected.long()[:, None]
        chosen = scores.gather(1, selected)
        ranks = (scores >= chosen).sum(dim=-1)
        ids, vals = selected[:, :0], chosen[:, :0]
        if self.num_topk:
            vals, ids = scores.topk(min(self.num_topk, scores.shape[1]), dim=-1)
        if self.custom_ids is not None:
            c_ids = self.custom_ids[row_req]
            c_vals = scores.gather(1, c_ids)
            width = max(ids.shape[1], c_ids.shape[1])
            pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
            use = self.is_custom[row_req][:, None]
            ids = torch.where(use, pad(c_ids, 0), pad(ids, 0))
            vals = torch.where(use, pad(c_vals, float("-inf")), pad(vals, float("-inf")))
        values = torch.cat([chosen, vals], dim=1).float()
        lse = streaming_logsumexp(scores)
        values = values - torch.where(self.is_logprobs[row_req], lse, torch.zeros_like(lse))[:, None]
        return LogprobsTensors(logprob_token_ids=torch.cat([selected, ids], dim=1), logprobs=values,
                               selected_token_ranks=ranks)
