"""The CUDA check's figures: verispec on one GPU, both tiers, with and without drafts, HF beside it.

`python -m benchmarks.gpu [--model FILE] [--out DIR]` (about 4 minutes on one H200). Greedy,
exactly `--max-tokens` new tokens per prompt (EOS masked by `min_tokens`, as the CPU benchmark's
rows), median of `--runs` timed runs after one warm-up. Three workloads:
- chat, batch 1 and 16: the benchmark's sixteen chat questions (benchmarks.prompts);
- extractive, batch 1: the summary that copies its source, where prompt lookup pays.

Systems: verispec's exact tier (fp32) and fast tier (the GGUF blocks packed for torch's CUDA int4
kernel, bf16 activations), each plain, with ngram k = 5 and with the suffix drafter; HF
transformers in bf16 and fp32 on the same GPU (plain, and prompt lookup at batch 1). Then the fast
tier's fidelity on the GPU against HF fp32 (benchmarks.fidelity: mean KL, top-1 agreement).
The CPU benchmark (`python -m benchmarks`) stays the place for the CPU targets; this one says what
the same code does on a GPU, where a step costs launches more than bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.fidelity import measure as measure_fidelity
from benchmarks.peers import HFSystem
from benchmarks.prompts import Prompt, chat_prompts, extractive_prompt
from benchmarks.report import _render
from benchmarks.system import PLAIN, SPEC, SPEC_K

TIERS = {"exact": "float32", "fast": "auto"}
DRAFTERS: dict[str, dict | None] = {
    "plain": None,
    f"ngram k={SPEC_K}": {"method": "ngram", "num_speculative_tokens": SPEC_K},
    "suffix": {"method": "suffix"},
}
LEARNS_ACROSS_REQUESTS = {"suffix"}
FIDELITY_SIZE = (8, 64)  # prompts, HF greedy tokens each


@dataclass(slots=True)
class GpuRow:
    workload: str  # "chat b1", "chat b16", "extractive b1"
    system: str
    tok_s: float
    mean_acceptance_length: float | None = None


def workloads(tokenizer: Any) -> dict[str, list[Prompt]]:
    chats = chat_prompts(tokenizer, 16)
    return {"chat b1": chats[:1], "chat b16": chats, "extractive b1": [extractive_prompt(tokenizer)]}


def token_ids(loads: dict[str, list[Prompt]]) -> dict[str, list[list[int]]]:
    return {name: [p.ids for p in prompts] for name, prompts in loads.items()}


def _timed(run, runs: int) -> float:
    """Median seconds of `runs` calls of `run` after one warm-up."""
    run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def verispec_rows(model: str, tier: str, drafter: str, loads: dict[str, list[list[int]]], max_tokens: int,
                  runs: int, device: str = "cuda") -> list[GpuRow]:
    """One row per workload. A drafter that learns across requests (suffix) gets a fresh engine for
    every timed run, warmed on other prompts: one engine's second run would draft the answers it
    gave the first time, which measures a rerun, not serving."""
    from verispec import LLM, SamplingParams

    def engine() -> Any:
        return LLM(model, device=device, dtype=TIERS[tier], max_num_seqs=16, speculative_config=DRAFTERS[drafter])

    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)

    def timed(llm: Any, prompts: list[list[int]]) -> tuple[float, int, int]:
        """Seconds, drafting steps and accepted drafts of one run, prefilled in full."""
        llm.reset_prefix_cache()
        before, start = llm.stats(), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds, after = time.perf_counter() - start, llm.stats()
        drafts = after["num_drafts"] - before["num_drafts"]
        return seconds, drafts, after["num_accepted_tokens"] - before["num_accepted_tokens"]

    kept = None if drafter in LEARNS_ACROSS_REQUESTS else engine()
    rows = []
    for name, prompts in loads.items():
        if kept is not None:
            kept.generate(prompts, params, use_tqdm=False)  # warm-up
        results = []
        for _ in range(runs):
            llm = kept if kept is not None else engine()
            if kept is None:  # warmed on other prompts, so its tree holds no answer to these
                llm.generate([p for ps in loads.values() for p in ps if p not in prompts][:4], params, use_tqdm=False)
            results.append(timed(llm, prompts))
            if llm is not kept:
                llm.shutdown()
        times, drafts, accepted = (list(column) for column in zip(*results))
        rows.append(GpuRow(name, f"verispec {tier} + {drafter}", len(prompts) * max_tokens / statistics.median(times),
                           1 + sum(accepted) / sum(drafts) if sum(drafts) else None))
    if kept is not None:
        kept.shutdown()
    return rows


def hf_rows(hf: HFSystem, label: str, loads: dict[str, list[Prompt]], max_tokens: int, runs: int) -> list[GpuRow]:
    """The CPU benchmark's HF system (one left-padded batch; prompt lookup at batch 1, the only
    size HF's assisted generation takes) on whatever device its model is."""
    rows = []
    for name, prompts in loads.items():
        for variant in (PLAIN, SPEC) if len(prompts) == 1 else (PLAIN,):
            seconds = _timed(functools.partial(hf.generate, prompts, max_tokens, variant), runs)
            system = label if variant == PLAIN else f"{label} + prompt lookup k={SPEC_K}"
            rows.append(GpuRow(name, system, len(prompts) * max_tokens / seconds))
    return rows


def fidelity(model: str, hf_fp32: Any, tokenizer: Any, device: str = "cuda") -> dict[str, Any]:
    """The fast tier on the GPU against HF fp32 on the GPU, teacher-forced on HF's greedy output."""
    from verispec import LLM

    count, tokens = FIDELITY_SIZE
    llm = LLM(model, device=device, dtype="auto", num_kv_blocks=4)
    fid = measure_fidelity(hf_fp32, llm.engine.model, [p.ids for p in chat_prompts(tokenizer, count)], tokens)
    llm.shutdown()
    return fid.as_dict()


def format_rows(rows: list[GpuRow], markdown: bool = True) -> str:
    """One line per (workload, system), with its ratio to verispec exact plain on that workload."""
    base = {r.workload: r.tok_s for r in rows if r.system == "verispec exact + plain"}
    body = []
    for r in rows:
        ratio = f"{r.tok_s / base[r.workload]:.2f}x" if r.workload in base else "-"
        acc = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
        body.append([r.workload, r.system, f"{r.tok_s:.1f}", ratio, acc])
    return _render(["workload", "system", "tok/s", "/ verispec exact plain", "acceptance length"], body, markdown)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--out", type=Path, default=Path("bench-gpu"), help="where gpu.json and gpu.md go")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma list of %(default)s")
    p.add_argument("--no-hf", action="store_true", help="verispec's rows only: no HF rows, no fidelity check")
    args = p.parse_args(argv)
    args.drafters = [d for d in args.drafters.split(",") if d]
    if not args.drafters or set(args.drafters) - set(DRAFTERS):
        p.error(f"--drafters must name some of {list(DRAFTERS)}")
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    return args


def hf_part(model: str, tokenizer: Any, loads: dict[str, list[Prompt]], args: argparse.Namespace
            ) -> tuple[list[GpuRow], dict[str, Any] | None]:
    """HF's rows in fp32 and bf16, and the fast tier's fidelity against HF fp32, all on the GPU."""
    import torch

    if args.no_hf:
        return [], None
    hf = HFSystem(model, tokenizer)
    hf.model.to("cuda")
    fid = fidelity(model, hf.model, tokenizer)
    rows = hf_rows(hf, "HF fp32", loads, args.max_tokens, args.runs)
    hf.model.to(torch.bfloat16)
    return rows + hf_rows(hf, "HF bf16", loads, args.max_tokens, args.runs), fid


def main(argv: list[str] | None = None) -> int:
    import torch

    from verispec.models.default import default_model_path
    from verispec.models.tokenizer_cache import load_tokenizer

    args = parse_args(argv)
    model = args.model or default_model_path()
    tokenizer = load_tokenizer(model)
    loads, rows = workloads(tokenizer), []
    for tier in TIERS:
        for drafter in args.drafters:
            rows += verispec_rows(model, tier, drafter, token_ids(loads), args.max_tokens, args.runs)
            print(format_rows(rows[-len(loads):], markdown=False), flush=True)
    hf, fid = hf_part(model, tokenizer, loads, args)
    rows = sorted(rows + hf, key=lambda r: r.workload)
    device = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "max_tokens": args.max_tokens,
              "runs": args.runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps({"device": device, "rows": [asdict(r) for r in rows],
                                                   "fast_tier_fidelity": fid}, indent=2))
    text = f"{json.dumps(device)}\n\n{format_rows(rows)}\n\nfast tier vs HF fp32 on the GPU: {json.dumps(fid)}\n"
    (args.out / "gpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
