"""verispec: an LLM inference engine with fast speculative decoding and exact logprobs.

The public names are imported on first use, so `verispec --help` and the command line's parsing
run without importing torch (2 s)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "verispec.entrypoints.llm",
    "SamplingParams": "verispec.sampling_params",
    "LogprobsMode": "verispec.config",
    "EngineConfig": "verispec.config",
    "RequestOutput": "verispec.outputs",
    "ScoreOutput": "verispec.outputs",
    "CompletionOutput": "verispec.outputs",
    "Logprob": "verispec.outputs",
    "LogprobsTensors": "verispec.outputs",
    "LogprobsLists": "verispec.outputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from verispec.config import EngineConfig, LogprobsMode
    from verispec.entrypoints.llm import LLM
    from verispec.outputs import CompletionOutput, Logprob, LogprobsLists, LogprobsTensors, RequestOutput, ScoreOutput
    from verispec.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
