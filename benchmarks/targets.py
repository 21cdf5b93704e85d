"""The project's speed targets (issue 7), each a ratio of two rows of one run.

Ratios inside one run are what the targets are about: on a shared VM absolute figures drift by
tens of percent between runs, and each ratio's two rows were measured minutes apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.report import Result
from benchmarks.tiers import FAST as FAST_TIER

FAST = FAST_TIER.key


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    scenario: str
    ours: tuple[str, str]  # (system, variant) of the numerator
    theirs: tuple[str, str]  # (system, variant) it is compared with
    at_least: float  # ours.score() / theirs.score() must reach this (score: tok/s, or 1/TTFT)
    # A time target ("TTFT <= 0.5x HF"): the ratio is ours' time over theirs', which must stay at
    # or below `at_least` (then a ceiling), so the table shows the figure the target names.
    lower_is_better: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    target: Target
    ratio: float | None  # None: a row is missing (peer skipped, scenario not run)
    busy: bool  # a row was measured while other processes took CPU

    @property
    def status(self) -> str:
        if self.ratio is None:
            return "not measured"
        bound, lower = self.target.at_least, self.target.lower_is_better
        met = self.ratio <= bound if lower else self.ratio >= bound
        return ("met" if met else "missed") + (" (busy)" if self.busy else "")


TARGETS: tuple[Target, ...] = (
    Target("single stream chat: verispec >= 2x HF generate", "single",
           ("verispec", "plain"), ("hf", "plain"), 2.0),
    Target("16 concurrent: verispec >= 5x HF batched", "batch16", ("verispec", "plain"), ("hf", "plain"), 5.0),
    Target("16 concurrent: verispec >= 3x llama-cpp-python", "batch16",
           ("verispec", "plain"), ("llamacpp", "plain"), 3.0),
    Target("extractive: verispec best drafter >= 2x verispec plain", "extractive",
           ("verispec", "spec"), ("verispec", "plain"), 2.0),
    Target("extractive: verispec best drafter >= llama-cpp-python plain", "extractive",
           ("verispec", "spec"), ("llamacpp", "plain"), 1.0),
    Target("TTFT, 2k-token prompt: verispec <= HF", "ttft", ("verispec", "plain"), ("hf", "plain"), 1.0),
    # The fast tier (benchmarks.tiers: packed 4-bit weights), against the same run's peers.
    Target("single stream chat: verispec fast >= 1.5x llama-cpp-python plain", "single",
           (FAST, "plain"), ("llamacpp", "plain"), 1.5),
    Target("16 concurrent: verispec fast >= 5x llama-cpp-python", "batch16",
           (FAST, "plain"), ("llamacpp", "plain"), 5.0),
    Target("extractive: verispec fast best drafter >= 1.8x verispec fast plain", "extractive",
           (FAST, "spec"), (FAST, "plain"), 1.8),
    Target("extractive: verispec fast best drafter >= 3.5x llama-cpp-python plain", "extractive",
           (FAST, "spec"), ("llamacpp", "plain"), 3.5),
    Target("TTFT, 2k-token prompt: verispec fast <= 0.5x HF fp32 (time ratio, lower is better)", "ttft",
           (FAST, "plain"), ("hf", "plain"), 0.5, lower_is_better=True),
)


def _row(results: list[Result], scenario: str, who: tuple[str, str]) -> Result | None:
    return next((r for r in results if r.scenario == scenario and (r.system, r.variant) == who and r.tokens), None)


def evaluate(results: list[Result], targets: tuple[Target, ...] = TARGETS) -> list[Outcome]:
    out = []
    for t in targets:
        ours, theirs = _row(results, t.scenario, t.ours), _row(results, t.scenario, t.theirs)
        if ours is None or theirs is None:
            out.append(Outcome(t, None, False))
        else:
            ratio = ours.score() / theirs.score()
            out.append(Outcome(t, 1.0 / ratio if t.lower_is_better else ratio, ours.busy or theirs.busy))
    return out


def format_targets(outcomes: list[Outcome], markdown: bool = False) -> str:
    if markdown:
        lines = ["| target | ratio in this run | status |", "|---|---|---|"]
        lines += [f"| {o.target.name} | {'-' if o.ratio is None else f'{o.ratio:.2f}x'} | {o.status} |"
                  for o in outcomes]
        return "\n".join(lines)
    width = max(len(o.target.name) for o in outcomes)
    return "\n".join(f"{o.target.name.ljust(width)}  {'-' if o.ratio is None else f'{o.ratio:.2f}x':>7}  {o.status}"
                     for o in outcomes)
