"""The fast tier's fidelity bar: verispec's distributions against HF transformers fp32 on one file.

Teacher-forced on HF's own greedy output: HF generates from each chat prompt, then both systems
score the same token sequences. verispec prefills the prompt in one chunk and then feeds the
completion one token at a time, so the figures cover the step the engine really runs for decode
(the quantized kernels), not only the prefill path. Reported per token:
- mean KL(p_HF || p_verispec) in nats (bar: <= 2e-3);
- top-1 agreement (bar: >= 97 %);
- max |logprob difference| on HF's tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

KL_BAR = 2e-3
TOP1_BAR = 0.97
_BLOCK = 16


@dataclass(slots=True)
class Fidelity:
    tokens: int
    mean_kl: float
    top1: float
    max_logprob_diff: float

    @property
    def meets_bar(self) -> bool:
        return self.mean_kl <= KL_BAR and self.top1 >= TOP1_BAR

    def pooled(self, other: "Fidelity") -> "Fidelity":
        """Both samples' rows as one sample."""
        n = self.tokens + other.tokens
        return Fidelity(n, (self.mean_kl * self.tokens + other.mean_kl * other.tokens) / n,
                        (self.top1 * self.tokens + other.top1 * other.tokens) / n,
                        max(self.max_logprob_diff, other.max_logprob_diff))

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "mean_kl": self.mean_kl, "top1": self.top1,
                "max_logprob_diff": self.max_logprob_diff, "meets_bar": self.meets_bar}


def hf_greedy(hf_model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt], device=hf_model.device),
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf_model.device),
                                do_sample=False, max_new_tokens=max_tokens,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf_model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), vocab], on the CPU: HF's log-distribution for each completion token."""
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([prompt + completion[:-1]], device=hf_model.device)).logits
    return torch.log_softmax(logits[0, len(prompt) - 1:].double(), dim=-1).cpu()


def verispec_logprobs(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The same rows from verispec's model: the prompt in one chunk, then one token per step.
    With no completion: every row of the prompt's chunk."""
    from verispec.models.attention import SeqSpan, build_attention_metadata

    total = len(prompt) + len(completion)
    num_blocks = -(-total // _BLOCK)
    device = model.embed.device
    kv = model.new_kv_cache(num_blocks, _BLOCK)
    table = list(range(num_blocks))
    feeds = [prompt] + [[t] for t in completion[:-1]]
    rows, done = [], 0
    with torch.inference_mode():
        for ids in feeds:
            n = len(ids)
            meta = build_attention_metadata([SeqSpan(0, n, done + n, table)], _BLOCK, device, model.dtype)
            hidden = model(torch.tensor(ids, device=device), torch.arange(done, done + n, device=device), meta,
                           kv.layers)
            rows.append(model.compute_logits(hidden if not completion else hidden[-1:]).double().cpu())
            done += n
    return torch.log_softmax(torch.cat(rows), dim=-1)


def compare(ref: torch.Tensor, ours: torch.Tensor, tokens: list[int]) -> Fidelity:
    """The rows of one sequence: mean KL, top-1 agreement and max |logprob diff| on `tokens`."""
    kl = (ref.exp() * (ref - ours)).sum(-1)
    top1 = (ref.argmax(-1) == ours.argmax(-1)).double().mean()
    idx = torch.tensor(tokens)[:, None]
    diff = (ref.gather(1, idx) - ours.gather(1, idx)).abs().max()
    return Fidelity(len(tokens), float(kl.mean()), float(top1), float(diff))


def measure_prompt_rows(hf_model: Any, model: Any, prompts: list[list[int]]) -> Fidelity:
    """Fidelity on the prompts' own rows (prompt logprobs, as an evaluator scores): each prompt in
    one chunk, so past the quantized kernels' row limit verispec runs its dense prefill path."""
    parts = [compare(hf_logprobs(hf_model, p[:1], p[1:]), verispec_logprobs(model, p[:-1], []), p[1:])
             for p in prompts]  # the rows for tokens 1.. of each prompt
    return functools.reduce(Fidelity.pooled, parts)


def measure(hf_model: Any, model: Any, prompts: list[list[int]], max_tokens: int) -> Fidelity:
    """Fidelity of verispec's `model` against `hf_model` over HF's greedy continuations."""
    parts = []
    for prompt in prompts:
        completion = hf_greedy(hf_model, prompt, max_tokens)
        if completion:
            parts.append(compare(hf_logprobs(hf_model, prompt, completion),
                                 verispec_logprobs(model, prompt, completion), completion))
    if not parts:
        raise ValueError("HF generated no tokens for any prompt")
    return functools.reduce(Fidelity.pooled, parts)
