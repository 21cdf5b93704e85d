"""A GRPO-style RL loop on a CPU: verispec rollouts, an HF transformers trainer in fp32, and the
trainer's new weights pushed into the rollout engine after every optimizer step.

Each step samples `n` completions per prompt with verispec (processed logprobs: the distribution
the tokens were drawn from, temperature included), rewards them (a verifiable toy reward: is the
sum right?), and takes one clipped policy-gradient step with the rollout's logprobs as the "old"
logprobs. It prints, and plots with --plot:
- the reward;
- mean and max |rollout logprob - trainer logprob| over every sampled token, and the importance
  ratio's range (exp of that difference; 1 where the two agree);
- max |LLM.score - rollout|: the same completions re-scored by verispec (0.0: bit for bit);
- the time `LLM.update_weights` took.

    python examples/rl_loop.py                            # SmolLM2-135M, exact tier, 5 steps
    python examples/rl_loop.py --steps 8 --plot docs/rl_loop.png
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from verispec import LLM, SamplingParams

Reward = Callable[[int, str, list[int]], float]  # (prompt index, completion text, completion ids) -> reward


@dataclass(slots=True)
class StepStats:
    step: int
    reward: float
    gap_mean: float  # |rollout logprob - trainer logprob| over the sampled tokens
    gap_max: float
    ratio_min: float  # importance ratio exp(trainer - rollout)
    ratio_max: float
    score_gap: float  # max |LLM.score - rollout|
    update_s: float
    num_tokens: int


def load_trainer(model_path: str) -> torch.nn.Module:
    """The trainer's own copy of the model: HF transformers in fp32 (a GGUF file dequantized)."""
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        directory, name = os.path.split(model_path)
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def arithmetic_task(tokenizer, num_prompts: int, seed: int) -> tuple[list[list[int]], Reward]:
    """Chat prompts asking for a small sum; the reward is 1 when the answer holds the right number."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(2, 20), rng.randrange(2, 20)) for _ in range(num_prompts)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for a, b in pairs]
    return [list(p) for p in prompts], lambda i, text, ids: float(str(sum(pairs[i])) in text)


def trainer_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                     temperature: float) -> list[torch.Tensor]:
    """Each completion token's logprob under log_softmax(logits / T), as the rollout's processed
    logprobs define it; one right-padded batch, with gradients."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rows = logits[i, len(p) - 1 : len(p) + len(c) - 1].log_softmax(-1)
        out.append(rows.gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def grpo_loss(new: list[torch.Tensor], old: list[torch.Tensor], rewards: torch.Tensor, group: int,
              clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate with group-normalised advantages, averaged over tokens."""
    r = rewards.view(-1, group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    terms = []
    for lp, lp_old, a in zip(new, old, adv):
        ratio = (lp - lp_old).exp()
        terms.append(torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a))
    return -torch.cat(terms).mean()


def rl_step(llm: LLM, trainer: torch.nn.Module, optimizer, prompts: list[list[int]], reward: Reward,
            params: SamplingParams, step: int) -> StepStats:
    """One rollout, one optimizer step, one weight update."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    seq_prompts, completions, old, rewards = [], [], [], []
    for i, out in enumerate(outs):
        for c in out.outputs:
            seq_prompts.append(out.prompt_token_ids)
            completions.append(list(c.token_ids))
            old.append(torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
            rewards.append(reward(i, c.text, list(c.token_ids)))
    # The trainer's "old logprobs" straight from verispec: re-scoring gives the rollout's bits.
    scored = llm.score(seq_prompts, completions, params, use_tqdm=False)
    score_gap = max((torch.tensor(s.token_logprobs) - o).abs().max().item() for s, o in zip(scored, old))
    new = trainer_logprobs(trainer, seq_prompts, completions, params.temperature)
    diff = torch.cat([n.detach() - o for n, o in zip(new, old)])
    loss = grpo_loss(new, old, torch.tensor(rewards), params.n)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    done = llm.update_weights(trainer.state_dict(), weight_version=step + 1)
    return StepStats(step, sum(rewards) / len(rewards), diff.abs().mean().item(), diff.abs().max().item(),
                     diff.exp().min().item(), diff.exp().max().item(), score_gap, done.seconds, diff.numel())


def run(model_path: str, prompts: list[list[int]], reward: Reward, steps: int, n: int = 4, max_tokens: int = 32,
        temperature: float = 0.8, lr: float = 1e-5, seed: int = 0, llm: LLM | None = None) -> list[StepStats]:
    torch.manual_seed(seed)
    llm = llm or LLM(model_path, dtype="float32")
    trainer = load_trainer(model_path).train()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
    history = []
    for step in range(steps):
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed + step,
                                logprobs_mode="processed_logprobs")
        start = time.perf_counter()
        s = rl_step(llm, trainer, optimizer, prompts, reward, params, step)
        history.append(s)
        print(f"step {s.step}: reward {s.reward:.3f} | |rollout - trainer| mean {s.gap_mean:.2e} max {s.gap_max:.2e}"
              f" | ratio [{s.ratio_min:.5f}, {s.ratio_max:.5f}] | |score - rollout| {s.score_gap:.1f}"
              f" | update {s.update_s:.2f} s | {s.num_tokens} tokens, {time.perf_counter() - start:.1f} s", flush=True)
    return history


def plot(history: list[StepStats], path: str, bound: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in history]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    ax = axes[0]
    ax.semilogy(steps, [s.gap_mean for s in history], "o-", label="mean")
    ax.semilogy(steps, [s.gap_max for s in history], "s-", label="max")
    if bound is not None:
        ax.axhline(bound, color="gray", ls="--", label="fp32 bound")
    ax.set(title="|rollout - trainer| logprob", xlabel="step")
    ax.legend()
    ax = axes[1]
    ax.plot(steps, [s.ratio_max - 1 for s in history], "o-", label="max - 1")
    ax.plot(steps, [s.ratio_min - 1 for s in history], "s-", label="min - 1")
    ax.set(title="importance ratio exp(trainer - rollout)", xlabel="step")
    ax.legend()
    axes[2].plot(steps, [s.reward for s in history], "o-")
    axes[2].set(title="mean reward", xlabel="step")
    axes[3].plot(steps, [s.update_s for s in history], "o-")
    score = max(s.score_gap for s in history)
    axes[3].set(title=f"update_weights (s); |score - rollout| max {score:g}", xlabel="step", ylim=(0, None))
    for ax in axes:
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[StepStats]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF checkpoint or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--plot", default=None, help="write the figure to this PNG")
    args = parser.parse_args(argv)
    from verispec.models.default import default_model_path

    model_path = args.model or default_model_path()
    llm = LLM(model_path, dtype="float32")
    prompts, reward = arithmetic_task(llm.get_tokenizer(), args.prompts, seed=0)
    history = run(model_path, prompts, reward, args.steps, args.n, args.max_tokens, lr=args.lr, llm=llm)
    if args.plot:
        # SmolLM2's logits reach about |31|; at T = 0.8 the logprobs' fp32 bound is 2 * (1e-5 + 2e-5 * 31 / 0.8).
        plot(history, args.plot, bound=2 * (1e-5 + 2e-5 * 31 / 0.8))
    return history


if __name__ == "__main__":
    main()
