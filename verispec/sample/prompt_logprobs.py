"""Prompt logprobs, computed in chunks of rows so peak memory stays bounded for long prompts.

Row i of a prefill chunk predicts prompt token i+1. Each chunk of rows goes through the lm_head,
the request's position-independent processors (in processed modes) and the scorer, then is
released before the next chunk: peak extra memory is a few [chunk_rows, vocab] tensors, whatever
the prompt length.
"""

from __future__ import annotations

import torch

from verispec.config import LogprobsMode
from verispec.outputs import LogprobsTensors
from verispec.sample.logprobs import RequestScoring
from verispec.sample.metadata import RowSpec, SamplingMetadata
from verispec.sample.processors import apply_processors
from verispec.sampling_params import SamplingParams


def score_prompt_rows(
    compute_logits,
    hidden: torch.Tensor,  # [N, hidden] rows predicting `targets`
    targets: torch.Tensor,  # [N] the actual next prompt tokens
    spec: RowSpec | list[RowSpec],  # one position-independent spec, or one per row (LLM.score)
    vocab_size: int,
    chunk_rows: int,
) -> LogprobsTensors:
    """num_logprobs of the spec(s) is the prompt's top-k (-1: all); every row shares its mode."""
    first = spec[0] if isinstance(spec, list) else spec
    scoring = RequestScoring.build([first.mode], [first.num_logprobs], [None], vocab_size, hidden.device)
    parts = []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        raw = compute_logits(hidden[rows])
        processed = None
        if not first.mode.is_raw:
            specs = spec[rows] if isinstance(spec, list) else [spec] * raw.shape[0]
            processed = apply_processors(raw, SamplingMetadata.build(specs, vocab_size, raw.device))
            raw = None  # a processed mode never reads the raw scores: free them first
        row_req = torch.zeros(targets[rows].shape[0], dtype=torch.long, device=hidden.device)
        parts.append(scoring.score(raw, processed, targets[rows], row_req))
        del raw, processed
    return LogprobsTensors.cat(parts)


def prompt_rows_key(params: SamplingParams, mode: LogprobsMode) -> tuple:
    """Everything besides the prefix and the top-k count that decides a request's prompt-logprob
    rows: the mode and, in processed modes, the position-independent processors' parameters. Rows
    with equal keys over equal prefixes are equal (the prefix cache shares them)."""
    if mode.is_raw:
        return (mode.value,)
    bias = tuple(sorted((params.logit_bias or {}).items()))
    temperature = 1.0 if params.greedy else float(params.temperature)
    allowed = tuple(params.allowed_token_ids or ())
    return (mode.value, temperature, params.top_k, float(params.top_p), float(params.min_p), allowed, bias)
