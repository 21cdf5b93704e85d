"""verispec command line: `verispec generate`, `verispec serve`, `verispec bench` (verispec alone) and
`verispec train-drafter` (a DSpark drafter trained on the target's own answers)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from verispec.envs import API_KEY, api_key
from verispec.config import SPEC_METHODS, GrammarLimits, user_options


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per engine option (EngineConfig's `_option` fields: name, default and help from
    there). A flag not given is left out of the namespace, so the config's own default applies."""
    for opt in user_options():
        flag = "--" + opt.name.replace("_", "-")
        said = opt.default is None or "default" in opt.help  # None: the help says what happens
        kw: dict = {"default": argparse.SUPPRESS, "help": opt.help if said else f"{opt.help} (default: {opt.default})"}
        if opt.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=opt.type, choices=opt.choices)
        if opt.name == "speculative_config":
            kw["metavar"] = "JSON"
            kw["help"] += "; overrides the --speculative-* flags"
        p.add_argument(flag, *opt.flags, **kw)
    # Shorthands for speculative_config.
    p.add_argument("--speculative-method", default=None, choices=SPEC_METHODS,
                   help="speculative decoding drafter (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step (k; default 3, or the tree depth, 24, for suffix)")
    p.add_argument("--draft-model", default=None, help="draft checkpoint for --speculative-method draft_model")
    p.add_argument("--draft-layers", type=int, default=None, help="target layers used by layer_skip")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the command line gave, as EngineConfig.create takes them."""
    options = {o.name: getattr(args, o.name) for o in user_options() if hasattr(args, o.name)}
    options["speculative_config"] = _speculative_config(args)
    return options


def _speculative_config(args: argparse.Namespace) -> dict | None:
    text = getattr(args, "speculative_config", None)
    if text:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        return spec
    if args.speculative_method:
        return {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
                "model": args.draft_model, "num_layers": args.draft_layers}
    return None


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=api_key(),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY})")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the file name)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core replicas behind the server, each a whole engine with its own KV cache "
                        "(default: 1); each core takes its share of the CPUs unless --num-threads is set")
    p.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    p.add_argument("--max-pending-requests", type=int, default=256,
                   help="requests admitted at once; more get 503 with Retry-After")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted (default: the context length less one)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20, help="largest request body (413 above)")
    p.add_argument("--max-pending-sequences", type=int, default=1024,
                   help="sequences (prompts x n) admitted at once over all requests; more get 503 with Retry-After")
    p.add_argument("--max-request-sequences", type=int, default=256,
                   help="sequences (prompts x n) one request may ask for (400 above)")
    p.add_argument("--open-tokenizer-routes", action="store_true",
                   help="/tokenize and /detokenize without the API key (for lm-eval's remote tokenizer)")
    limits = GrammarLimits()
    p.add_argument("--max-grammar-bytes", type=int, default=limits.max_bytes,
                   help="largest grammar text (a schema as JSON, a regex, choices as JSON)")
    p.add_argument("--max-grammar-choices", type=int, default=limits.max_choices, help="longest choice list")
    p.add_argument("--grammar-timeout", type=float, default=limits.timeout_s,
                   help="seconds a grammar may take to compile and check (400 beyond)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per generated token")
    p.add_argument("--prompt-logprobs", type=int, default=None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; `argv` (default: sys.argv's) says whether train-drafter's own
    flags are needed: its module imports torch and the trainer (2 s), which `--help` should not."""
    parser = argparse.ArgumentParser(prog="verispec", description="verispec: fast speculative decoding, exact logprobs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt (or a chat message with --chat)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print the full RequestOutput as JSON")
    _add_engine_args(gen)
    _add_sampling_args(gen)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine core in its own process)")
    _add_engine_args(serve)
    _add_server_args(serve)

    bench = sub.add_parser("bench", help="latency and throughput of verispec alone (peers: python -m benchmarks)")
    _add_engine_args(bench)
    from verispec.entrypoints.bench import add_arguments

    add_arguments(bench)
    trainer = sub.add_parser("train-drafter", help="train a DSpark drafter on the target's own answers (resumable)")
    _add_engine_args(trainer)
    if "train-drafter" in (sys.argv[1:] if argv is None else argv):
        from verispec.entrypoints import train_drafter

        train_drafter.add_arguments(trainer)
    return parser


def show_startup() -> None:
    """verispec's start-up lines (each phase that can pass 2 s, the runtime line) on stderr, where a
    command line user sees them."""
    import logging

    log = logging.getLogger("verispec")
    class Stderr(logging.StreamHandler):  # whatever sys.stderr is when a line is written
        stream = property(lambda self: sys.stderr, lambda self, value: None)

    if not any(type(h).__name__ == "Stderr" for h in log.handlers):
        handler = Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _generate(args: argparse.Namespace) -> int:
    from verispec.entrypoints.llm import LLM
    from verispec.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=getattr(args, "seed", None), stop=args.stop, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    show_startup()
    # One answer: the compiled step where its graphs are saved from an earlier start, no compile.
    llm = LLM(**engine_options(args), compile_missing=False)
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
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


def _serve(args: argparse.Namespace) -> int:
    from verispec.config import EngineConfig
    from verispec.engine.dp_client import check_data_parallel_size
    from verispec.entrypoints.openai.early_start import start_early

    check_data_parallel_size(args.data_parallel_size)  # before any model is loaded

    engine = EngineConfig.create(
        **engine_options(args),
        grammar_limits=GrammarLimits(max_bytes=args.max_grammar_bytes, max_choices=args.max_grammar_choices,
                                     timeout_s=args.grammar_timeout),
        resolve=False,  # the core resolves dtype and device: this process does without torch
    )
    engine.validate(resolve=False)
    # The cores load while this process imports its web stack (0.6 s) instead of after it.
    early = start_early(engine, args.data_parallel_size)
    from verispec.entrypoints.openai.api_server import ServerConfig, run_server

    config = ServerConfig(
        engine=engine, host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, max_n=args.max_n,
        max_pending_requests=args.max_pending_requests, max_request_bytes=args.max_request_bytes,
        max_prompt_tokens=args.max_prompt_tokens, data_parallel_size=args.data_parallel_size,
        max_pending_sequences=args.max_pending_sequences, max_request_sequences=args.max_request_sequences,
        open_tokenizer_routes=args.open_tokenizer_routes,
    )
    run_server(config, log_level=args.log_level, early=early)
    return 0


def _joined_as_worker(args: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the same command; ranks other than 0 serve rank 0's model
    calls until it stops, and return True."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp < 2:  # before the imports below: they bring torch, which a server's frontend does without
        return False
    from verispec.config import EngineConfig
    from verispec.distributed.comm import Rendezvous

    rv = Rendezvous.from_env()
    if rv is None or rv.size < 2:
        return False
    if getattr(args, "data_parallel_size", 1) > 1:
        raise ValueError("--data-parallel-size > 1 cannot run under torchrun: each replica starts its own "
                         "tensor-parallel ranks on one machine")
    if rv.size != tp:
        raise ValueError(f"--tensor-parallel-size={tp} but torchrun started "
                         f"WORLD_SIZE={rv.size} ranks; they must be equal")
    if rv.rank == 0:
        return False
    from verispec.distributed.executor import rank_threads
    from verispec.distributed.worker import run_worker

    config = EngineConfig.create(device=getattr(args, "device", "auto"), num_threads=getattr(args, "num_threads", None),
                                 tensor_parallel_size=tp)
    run_worker(rv, config.device, rank_threads(config))
    return True


def _leave(code: int) -> None:
    """Ends the process once a one-shot answer is out: the exit handlers run and the streams are
    flushed, and the interpreter's teardown, which unwinds torch's state and every module (0.8 s
    of a 5 s `verispec generate`), is skipped."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser(argv).parse_args(argv)
    try:
        if _joined_as_worker(args):
            return 0
        if args.command == "generate":
            code = _generate(args)
            if argv is None:  # this process's own command line: one answer, then out
                _leave(code)
            return code
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from verispec.entrypoints.bench import run

            return run(args, engine_options(args))
        if args.command == "train-drafter":
            from verispec.entrypoints.train_drafter import run as train

            return train(args, engine_options(args))
    except ValueError as exc:  # bad options: one clear line, no traceback
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
