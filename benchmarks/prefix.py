"""Prefix caching, cache on against cache off, in one run (verispec only).

- `loglikelihood`: lm-eval's `local-completions` shape over HTTP. 50 questions x 4 choices after
  one shared 600-token few-shot context; each choice is its own request (`echo=True, logprobs=1,
  max_tokens=0`), sent one at a time as lm-eval does by default. Requests/s, and every logprob of
  the two servers compared.
- `chat5`: 5-turn chats over HTTP, each turn resending the whole conversation (streaming); time to
  first token of turn 5, median over the chats.
- `batch16`: the bench's 16 chat prompts at once, in process, cache on and off alternating; no
  prefix is shared across runs (the cache is reset before each), so this is the cache's overhead.

The HTTP servers run the exact tier on the GGUF codes (`--dtype float32 --quantization gguf`):
evaluators compare logprobs, and that tier computes a position alike whatever else is in the step
and however its prompt was chunked, so a hit must give the cold run's values bit for bit.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks.prompts import chat_prompts
from benchmarks.servers import Server
from benchmarks.texts import REPORT

SERVER_TIER = ("--dtype", "float32", "--quantization", "gguf")
CONTEXT_TOKENS = 600
CHOICES = (" the library", " the city council", " the regional fund", " nobody")
USER_TURNS = (
    "I am planning a weekend trip to Lisbon. What should I see first?",
    "Which of those places is best early in the morning, and why?",
    "Suggest a simple lunch nearby that is typical for the city.",
    "How do I get from there to the riverside by public transport?",
    "Summarize the whole plan for the day in a short list.",
)
TOPICS = ("Lisbon", "Kyoto", "Vienna")


@dataclass(slots=True)
class PrefixRow:
    workload: str
    metric: str  # what on/off measure
    off: float
    on: float
    target: float  # the ratio the issue asks for (lower is better for latency rows)
    note: str = ""
    higher_is_better: bool = True

    @property
    def ratio(self) -> float:
        if self.higher_is_better:
            return self.on / self.off if self.off else 0.0
        return self.off / self.on if self.on else 0.0

    @property
    def met(self) -> bool:
        return self.ratio >= self.target


@dataclass(slots=True)
class PrefixResults:
    rows: list[PrefixRow] = field(default_factory=list)
    ttft_by_turn: dict[str, list[float]] = field(default_factory=dict)  # "on"/"off" -> median per turn
    max_logprob_diff: float | None = None
    chats_identical: bool | None = None


# ------------------------------------------------------------------ an HTTP server per setting
class _Server(Server):
    def __init__(self, cache: bool, log_path: Path):
        super().__init__([sys.executable, "-m", "verispec", "serve", "--port", "{port}", *SERVER_TIER,
                          "--enable-prefix-caching" if cache else "--no-enable-prefix-caching", "--log-level",
                          "warning"], log_path)

    def stream_chat(self, messages: list[dict], max_tokens: int) -> tuple[float, str]:
        """(time to the first content chunk, the whole answer)."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        req = urllib.request.Request(self.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        start, first, text = time.perf_counter(), None, []
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first if first is not None else time.perf_counter() - start
                        text.append(piece)
        return (first if first is not None else time.perf_counter() - start), "".join(text)


# ------------------------------------------------------------------ workloads
def loglikelihood_requests(tokenizer: Any, questions: int) -> list[list[int]]:
    """One shared few-shot context of CONTEXT_TOKENS tokens, then a question and a choice."""
    context = tokenizer.encode("\n\n".join(REPORT) * 2)[:CONTEXT_TOKENS]
    out = []
    for q in range(questions):
        stem = tokenizer.encode(f"\n\nQuestion {q + 1}: who pays for item {q + 1} of the renovation?\nAnswer:")
        out.extend(context + stem + tokenizer.encode(choice) for choice in CHOICES)
    return out


def _loglikelihood(server: _Server, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    start, logprobs = time.perf_counter(), []
    for ids in prompts:
        body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
        logprobs.append(server.post("/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"])
    return time.perf_counter() - start, logprobs


def _chats(server: _Server, turns: int, max_tokens: int, topics: tuple[str, ...]) -> tuple[list[list[float]], list[str]]:
    """Per chat, the time to first token of every turn; and every answer, to compare."""
    ttfts, answers = [], []
    for topic in topics:
        messages, times = [], []
        for user in USER_TURNS[:turns]:
            messages.append({"role": "user", "content": user.replace("Lisbon", topic)})
            ttft, answer = server.stream_chat(messages, max_tokens)
            messages.append({"role": "assistant", "content": answer})
            times.append(ttft)
            answers.append(answer)
        ttfts.append(times)
    return ttfts, answers


def _batch16(tokenizer: Any, max_tokens: int, rounds: int, log: Callable[[str], None]) -> tuple[float, float]:
    """tok/s of cache off and on, alternating rounds, median of each; the default (fast) tier."""
    from verispec import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p.ids} for p in chat_prompts(tokenizer, 16)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    llms = {cache: LLM(enable_prefix_caching=cache) for cache in (False, True)}
    rates: dict[bool, list[float]] = {False: [], True: []}
    for llm in llms.values():
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    for r in range(rounds):
        for cache in ((False, True) if r % 2 == 0 else (True, False)):
            llms[cache].reset_prefix_cache()
            start = time.perf_counter()
            outs = llms[cache].generate(prompts, params, use_tqdm=False)
            rates[cache].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        log(f"prefix batch16 round {r + 1}: off {rates[False][-1]:.1f} tok/s, on {rates[True][-1]:.1f} tok/s")
    return statistics.median(rates[False]), statistics.median(rates[True])


def run_prefix(tokenizer: Any, quick: bool, max_tokens: int, runs: int, out: Path,
               log: Callable[[str], None]) -> PrefixResults:
    questions, topics = (3, TOPICS[:1]) if quick else (50, TOPICS)
    answer_tokens = min(max_tokens, 64)
    prompts = loglikelihood_requests(tokenizer, questions)
    res = PrefixResults()
    measured: dict[bool, dict[str, Any]] = {}
    out.mkdir(parents=True, exist_ok=True)
    for cache in (False, True):
        name = "on" if cache else "off"
        log(f"prefix: starting a server with the cache {name} ...")
        server = _Server(cache, out / f"prefix-server-{name}.log")
        try:
            server.wait_ready()
            seconds, logprobs = _loglikelihood(server, prompts)
            log(f"prefix loglikelihood, cache {name}: {len(prompts)} requests in {seconds:.1f}s")
            ttfts, answers = _chats(server, len(USER_TURNS), answer_tokens, topics)
            log(f"prefix chat, cache {name}: turn-5 TTFT {[round(t[-1], 3) for t in ttfts]}")
        finally:
            server.stop()
        measured[cache] = {"rps": len(prompts) / seconds, "logprobs": logprobs, "ttfts": ttfts, "answers": answers}
        res.ttft_by_turn[name] = [statistics.median(t[i] for t in ttfts) for i in range(len(USER_TURNS))]
    off, on = measured[False], measured[True]
    res.max_logprob_diff = max(abs(a - b) for x, y in zip(off["logprobs"], on["logprobs"])
                               for a, b in zip(x, y) if a is not None and b is not None)
    res.chats_identical = off["answers"] == on["answers"]
    res.rows.append(PrefixRow(
        "loglikelihood", "requests/s", off["rps"], on["rps"], 3.0,
        f"{questions} questions x {len(CHOICES)} choices, {CONTEXT_TOKENS}-token shared context; "
        f"max |logprob diff| {res.max_logprob_diff:.3g}"))
    res.rows.append(PrefixRow(
        "chat5", "turn-5 TTFT (s)", res.ttft_by_turn["off"][-1], res.ttft_by_turn["on"][-1], 5.0,
        f"{len(topics)} chat(s), {answer_tokens}-token answers; answers identical: {res.chats_identical}",
        higher_is_better=False))
    log("prefix: batch16 in process, cache off and on alternating ...")
    b_off, b_on = _batch16(tokenizer, max_tokens, max(runs, 1) * 2 - 1 if not quick else 1, log)
    res.rows.append(PrefixRow("batch16", "tok/s", b_off, b_on, 0.97, "16 chat prompts, no shared prefix across runs"))
    return res


# ------------------------------------------------------------------ report
def format_prefix_table(res: PrefixResults) -> str:
    head = "| workload | metric | cache off | cache on | ratio | target | status | notes |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in res.rows:
        better = "" if r.higher_is_better else " lower"
        lines.append(f"| {r.workload} | {r.metric} | {r.off:.3g} | {r.on:.3g} | {r.ratio:.2f}x{better} | "
                     f">= {r.target:g}x | {'met' if r.met else 'missed'} | {r.note} |")
    return "\n".join(lines)


def plot_prefix(path: Path, res: PrefixResults) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("off", "--"), ("on", "-")):
        times = res.ttft_by_turn.get(name, [])
        ax1.plot(range(1, len(times) + 1), times, style, marker="o", label=f"cache {name}")
    ax1.set_xticks(range(1, len(USER_TURNS) + 1))
    ax1.set_xlabel("chat turn")
    ax1.set_ylabel("time to first token (s)")
    ax1.set_title("multi-turn chat over HTTP")
    ax1.legend()
    rows = res.rows
    ax2.bar([r.workload for r in rows], [r.ratio for r in rows], color=["tab:green" if r.met else "tab:red" for r in rows])
    for i, r in enumerate(rows):
        ax2.plot([i - 0.4, i + 0.4], [r.target, r.target], color="black", linewidth=1)
    ax2.set_yscale("log")
    ax2.set_ylabel("cache on vs off (x, better is higher; line: target)")
    ax2.set_title("prefix caching, one run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_prefix(out: Path, machine: dict[str, Any], res: PrefixResults) -> str:
    """prefix.md, prefix.json and prefix.png under `out`; returns the Markdown for stdout."""
    md = format_prefix_table(res)
    (out / "prefix.md").write_text(md + "\n")
    rows = [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in res.rows]
    (out / "prefix.json").write_text(json.dumps(
        {"machine": machine, "rows": rows, "ttft_by_turn": res.ttft_by_turn,
         "max_logprob_diff": res.max_logprob_diff, "chats_identical": res.chats_identical}, indent=2))
    plot_prefix(out / "prefix.png", res)
    return md
