"""verispec: an LLM inference engine with fast speculative decoding and exact logprobs."""

from verispec.config import EngineConfig, LogprobsMode
from verispec.entrypoints.llm import LLM
from verispec.outputs import CompletionOutput, Logprob, LogprobsLists, LogprobsTensors, RequestOutput, ScoreOutput
from verispec.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "LogprobsMode",
    "EngineConfig",
    "RequestOutput",
    "ScoreOutput",
    "CompletionOutput",
    "Logprob",
    "LogprobsTensors",
    "LogprobsLists",
]
__version__ = "0.1.0"
