"""Teacher-forced scoring (`LLM.score`): a completion's logprobs as its rollout returned them.

A scored request is an ordinary request whose prompt is the rollout's prompt plus its completion.
Only the completion's rows are scored, each under the rollout's parameters with the completion so
far as its output (`Request.scored_rows`), so penalties, bad words and min_tokens see what the
rollout's decode rows saw. The tiers that are batch-invariant (docs/rl.md) compute a prefill row as
they computed the decode row, so the values are the rollout's bit for bit. This is the trainer's
"old logprobs" without a second model.
"""

from __future__ import annotations

from dataclasses import replace

from verispec.outputs import RequestOutput, ScoreOutput
from verispec.core.request import ScoredCompletion
from verispec.sampling_params import SamplingParams


def scoring_request(params: SamplingParams, prompt_ids: list[int], completion: list[int],
                    vocab_size: int) -> tuple[SamplingParams, ScoredCompletion]:
    """The engine request that scores `completion` after `prompt_ids`: its own parameters (one
    generated token, the completion's rows as prompt logprobs) and its scoring state."""
    if not isinstance(completion, (list, tuple)) or not completion:
        raise ValueError("completion must be a non-empty list of token ids")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in completion):
        raise ValueError(f"completion token ids must be integers in [0, {vocab_size})")
    if params.structured_outputs is not None:
        raise ValueError("structured_outputs: LLM.score does not replay a grammar; score without it")
    if params.logprob_token_ids is not None:
        raise ValueError("logprob_token_ids: LLM.score returns each token with its top `logprobs`, "
                         "not custom ids")
    own = replace(params, n=1, max_tokens=1, min_tokens=0, stop=None, logprobs=None,
                  prompt_logprobs=params.logprobs or 0)
    start = len(prompt_ids)
    history = (params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
               or params.min_tokens or params.bad_words)
    # Rows that see the completion as output differ from plain prompt rows: they never share.
    key = (("scored", start, params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
            params.min_tokens, tuple(params.bad_words or ()), tuple(params.stop_token_ids or ()), params.ignore_eos)
           if history else ())
    return own, ScoredCompletion(start, params, key)


def score_output(out: RequestOutput, start: int) -> ScoreOutput:
    """The scored request's answer, without its one generated token."""
    ids = out.prompt_token_ids
    return ScoreOutput(prompt_token_ids=ids[:start], token_ids=ids[start:], logprobs=out.prompt_logprobs[start:],
                       weight_version=out.weight_version, error=out.error)
