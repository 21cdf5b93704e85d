"""`verispec train-drafter`: a DSpark drafter for a target, trained on the target's own answers.

1. Data (verispec/train/distill.py): the target answers the training prompts (verispec/train/
   prompts.py, written here), and one pass over each answer captures the context features and
   the target's next-token distribution. Shards under OUTPUT/data; a rerun reuses them.
2. A draft vocabulary: the tokens the answers use most, and the special token the block's masks
   use (one the answers never use).
3. Training (verispec/train/trainer.py), resumable from OUTPUT/train_state.pt; the loss log in
   OUTPUT/loss.jsonl.
4. The drafter in the published schema in OUTPUT/drafter, and its acceptance on held-out prompts
   (topics the training never saw) in OUTPUT/report.json.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.models.dspark import target_head_rows
from verispec.train.distill import build_shards, chat_ids, load_samples
from verispec.train.dspark_model import DrafterShape, TrainableDSpark, start_from
from verispec.train.prompts import held_out_prompts, training_prompts
from verispec.train.trainer import TrainConfig, train


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="directory for the data, the training state and the drafter; "
                                                    "run again to resume")
    p.add_argument("--prompts", type=int, default=None, help="training prompts to answer (default: all)")
    p.add_argument("--answer-tokens", type=int, default=192, help="longest answer per prompt")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--seqs-per-step", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--drafter-layers", type=int, default=1, help="decoder layers of the drafter")
    p.add_argument("--drafter-block", type=int, default=8, help="drafts per block")
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary's size")
    p.add_argument("--target-layers", default=None,
                   help="comma-separated target layers the drafter reads (default: 5 spread over the target)")
    p.add_argument("--top-k", type=int, default=16, help="entries of the target's distribution kept per position")
    p.add_argument("--eval-tokens", type=int, default=128, help="tokens per held-out answer in the report")


def target_layers(given: str | None, num_layers: int) -> tuple[int, ...]:
    """--target-layers, checked before an hour of data: layer numbers, none the target's last."""
    if not given:
        return spread_layers(num_layers)
    try:
        layers = tuple(sorted({int(x) for x in given.split(",")}))
    except ValueError:
        raise ValueError(f"--target-layers {given!r} must be comma-separated layer numbers") from None
    if not all(0 <= i < num_layers - 1 for i in layers):
        raise ValueError(f"--target-layers {given!r} must name layers 0..{num_layers - 2} of the target's "
                         f"{num_layers} (not its last, whose output is normed)")
    return layers


def spread_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` layers from the second to the third-last, evenly spaced (never the last)."""
    lo, hi = 1, max(1, num_layers - 3)
    return tuple(sorted({round(lo + i * (hi - lo) / max(1, count - 1)) for i in range(count)}))


def run(args: argparse.Namespace, options: dict) -> int:
    from verispec.entrypoints.llm import LLM

    torch.manual_seed(0)
    out = Path(args.output).expanduser()
    llm = LLM(**options)
    model, tokenizer = llm.engine.model, llm.get_tokenizer()
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("train-drafter needs a model with a tokenizer and a chat template (its prompts are chats)")
    cfg = model.cfg
    layers = target_layers(args.target_layers, cfg.num_layers)
    data = _data(llm, args, out, layers)
    samples, held = data
    draft_ids = draft_vocabulary(samples, args.draft_vocab, cfg.vocab_size)
    shape = DrafterShape(
        target_layer_ids=layers, mask_token_id=mask_token(tokenizer, samples), num_layers=args.drafter_layers,
        block_size=args.drafter_block, markov_rank=args.markov_rank, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, vocab_size=cfg.vocab_size)
    with torch.no_grad():
        embed = model.embed_tokens(torch.arange(cfg.vocab_size, device=model.embed.device)).float().cpu()
    drafter = TrainableDSpark(shape, embed, draft_ids, head=target_head_rows(model).cpu())
    if not (out / "train_state.pt").exists():  # else the state holds them
        start_from(drafter, model.norm.weight.detach().cpu(), [s.features for s in samples])
    config = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors=args.anchors, lr=args.lr)
    with tqdm(total=args.steps, desc="training", unit="step") as bar:
        def progress(step, total, entry):
            bar.n = step
            bar.set_postfix(loss=f"{entry['loss']:.3f}", top1=f"{entry['top1']:.2f}", refresh=False)
            bar.refresh()

        log = train(drafter, samples, held, config, out, progress)
    drafter.export(out / "drafter")
    llm.shutdown()
    report = evaluate(options, out / "drafter", args.eval_tokens) | {"final": log[-1] if log else None}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "final"}, indent=2))
    return 0


def _data(llm, args, out: Path, layers: tuple[int, ...]):
    prompts = training_prompts()[: args.prompts]
    shards = -(-len(prompts) // 64)
    with tqdm(total=shards, desc="answers and features", unit="shard") as bar:
        def progress(done, total):
            bar.n = done
            bar.refresh()

        paths = build_shards(llm, prompts, out / "data" / "train", layers, args.answer_tokens, args.top_k, progress)
    held = build_shards(llm, held_out_prompts(), out / "data" / "held_out", layers, args.answer_tokens, args.top_k)
    return load_samples(paths), load_samples(held)


def draft_vocabulary(samples, size: int, vocab: int) -> torch.Tensor:
    """The `size` tokens the answers use most (then the lowest ids, if they use fewer), sorted."""
    counts = Counter(int(t) for s in samples for t in s.ids[s.answer_start:])
    ids = [t for t, _ in counts.most_common(size)]
    ids += [t for t in range(vocab) if t not in counts][: size - len(ids)]
    return torch.tensor(sorted(ids[:size]))


def mask_token(tokenizer, samples) -> int:
    """A special token the data never uses (its embedding is the masks' input)."""
    used = {int(t) for s in samples for t in s.ids}
    special = [tokenizer.convert_tokens_to_ids(t) for t in getattr(tokenizer, "additional_special_tokens", [])]
    special += sorted(set(tokenizer.all_special_ids))
    free = [t for t in special if t is not None and t not in used]
    if not free:
        raise ValueError("every special token of the tokenizer occurs in the data: none is free for the masks")
    return free[0]


def evaluate(options: dict, drafter: Path, tokens: int) -> dict:
    """Greedy answers to the held-out prompts with the drafter: acceptance per drafting step and
    per position."""
    from verispec.entrypoints.llm import LLM
    from verispec.sampling_params import SamplingParams

    llm = LLM(**{**options, "speculative_config": {"method": "dspark", "model": str(drafter)}})
    try:
        prompts = [chat_ids(llm.get_tokenizer(), p) for p in held_out_prompts()]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens), use_tqdm=False)
        s = llm.stats()
    finally:
        llm.shutdown()
    steps = max(1, s["num_drafts"])
    return {"held_out_prompts": len(prompts), "acceptance_length": 1 + s["num_accepted_tokens"] / steps,
            "accepted_per_position": [a / steps for a in s["accepted_per_position"]],
            "num_drafts": s["num_drafts"], "num_draft_tokens": s["num_draft_tokens"]}
