"""verispec command line: `verispec generate` and `verispec bench`."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of the request")
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft_model", "layer_skip"],
                   help="speculative decoding drafter (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens per step (k)")
    p.add_argument("--draft-model", default=None, help="draft checkpoint for --speculative-method draft_model")
    p.add_argument("--draft-layers", type=int, default=None, help="target layers used by layer_skip")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per generated token")
    p.add_argument("--prompt-logprobs", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="verispec: fast speculative decoding, exact logprobs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt (or a chat message with --chat)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print the full RequestOutput as JSON")
    _add_engine_args(gen)
    _add_sampling_args(gen)

    bench = sub.add_parser("bench", help="side-by-side benchmark against HF transformers and llama.cpp")
    from verispec.bench.runner import add_arguments

    add_arguments(bench)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from verispec import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=args.stop, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    spec = None
    if args.speculative_method:
        spec = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
                "model": args.draft_model, "num_layers": args.draft_layers}
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        logprobs_mode=args.logprobs_mode, max_logprobs=args.max_logprobs, speculative_config=spec,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    if args.json:
        print(json.dumps(out.to_dict(), indent=2, default=float))
        return 0
    completion = out.outputs[0]
    print(completion.text)
    if out.prompt_logprobs:
        print("\n--- prompt logprobs (token: logprob [rank]) ---", file=sys.stderr)
        for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            print(f"{entry[tok].decoded_token!r}: {entry[tok].logprob:.4f} [{entry[tok].rank}]", file=sys.stderr)
    if completion.logprobs:
        print("\n--- logprobs (token: logprob [rank]; top alternatives) ---", file=sys.stderr)
        for tok, entry in zip(completion.token_ids, completion.logprobs):
            chosen = entry[tok]
            alts = ", ".join(f"{lp.decoded_token!r}: {lp.logprob:.4f}" for t, lp in entry.items() if t != tok)
            print(f"{chosen.decoded_token!r}: {chosen.logprob:.4f} [{chosen.rank}]; {alts}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from verispec.bench.runner import run

            return run(args)
    except ValueError as exc:  # bad options: one clear line, no traceback
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
