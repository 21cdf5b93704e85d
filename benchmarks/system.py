"""What every system of the benchmark shares: the variants, what a run returns, the peers' names.

Every system has a "plain" variant and a "spec" one: speculative decoding with prompt lookup,
each system's own implementation, all drafting the same number of tokens (`SPEC_K`). The systems
themselves live in benchmarks/peers.py (verispec, HF) and benchmarks/llamacpp.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from benchmarks.prompts import Prompt

# Draft tokens per step for every prompt-lookup variant. k=5 is verispec's best drafter on the
# extractive categories of the speculative sweep (docs/benchmarks.md); the peers draft as many,
# so the systems differ in how they verify, not in how much they guess.
SPEC_K = 5
PLAIN, SPEC = "plain", "spec"


class PeerUnavailable(RuntimeError):
    """An optional peer is not installed; the message says how to install it."""


@dataclass(slots=True)
class Generation:
    texts: list[str]
    token_ids: list[list[int]] | None  # None where the system's ids are not verispec's vocabulary/view
    lengths: list[int]  # tokens actually produced per prompt
    # Speculative variants: verify steps that carried a draft, and the tokens those steps emitted
    # (accepted drafts + the target's own token). Their ratio is the mean acceptance length.
    spec_steps: int | None = None
    spec_tokens: int | None = None
    # Logprob of each generated token (per prompt), where the system was asked for them.
    logprobs: list[list[float]] | None = None


class System(Protocol):
    key: str
    label: str
    compare: str  # "ids" or "text": what its output is compared to verispec's on

    def variant_label(self, variant: str) -> str: ...

    def generate(self, prompts: list[Prompt], max_tokens: int, variant: str = PLAIN,
                 logprobs: int | None = None) -> Generation: ...

    def close(self) -> None: ...


def acceptance_from_lengths(calls: list[tuple[int, int]], final_length: int) -> tuple[int, int]:
    """(steps with a draft, tokens those steps emitted) from a drafter's call log.

    Peers do not report acceptance, but their drafters are called once per verify step with the
    sequence so far: `calls` holds (sequence length at the call, draft tokens proposed). The
    sequence growth up to the next call (or to `final_length` after the last) is what that step
    emitted.
    """
    steps = tokens = 0
    ends = [length for length, _ in calls[1:]] + [final_length]
    for (length, drafted), end in zip(calls, ends):
        if drafted > 0:
            steps += 1
            tokens += end - length
    return steps, tokens



@dataclass(slots=True)
class PeerSpec:
    label: str
    install: str


PEERS: dict[str, PeerSpec] = {
    "hf": PeerSpec("HF transformers", "pip install transformers"),
    "llamacpp": PeerSpec("llama.cpp", "pip install llama-cpp-python"),
}
