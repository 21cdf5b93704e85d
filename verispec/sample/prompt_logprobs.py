"""Prompt logprobs, computed in chunks of rows so peak memory stays bounded for long prompts.

Row i of a prefill chunk predicts prompt token i+1. Each chunk of rows goes through the lm_head,
the request's position-independent processors (in processed modes) and the scorer, then is
released before the next chunk: peak extra memory is a few [chunk_rows, vocab] tensors, whatever
the prompt length.
"""

from __future__ import annotations

import torch

from verispec.outputs import LogprobsTensors
from verispec.sample.logprobs import compute_topk_scores
from verispec.sample.metadata import RowSpec, SamplingMetadata
from verispec.sample.processors import apply_processors


def score_prompt_rows(
    compute_logits,
    hidden: torch.Tensor,  # [N, hidden] rows predicting `targets`
    targets: torch.Tensor,  # [N] the actual next prompt tokens
    spec: RowSpec,
    num_topk: int,
    vocab_size: int,
    chunk_rows: int,
) -> LogprobsTensors:
    parts = []
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = compute_logits(hidden[start : start + chunk_rows])
        scores = logits
        if not spec.mode.is_raw:
            md = SamplingMetadata.build([spec] * logits.shape[0], vocab_size, logits.device)
            scores = apply_processors(logits, md)
            del logits
        parts.append(
            compute_topk_scores(scores, num_topk, targets[start : start + chunk_rows], None, spec.mode.is_logprobs)
        )
        del scores
    return LogprobsTensors.cat(parts)
