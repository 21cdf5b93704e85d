"""Shared fixtures: tiny random HF checkpoints (fast oracles) and the bundled SmolLM2 (slow)."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines run eager unless a test asks for the compiled stack (tests/test_compile.py): compiling
# costs seconds to a minute per engine, and the suite builds hundreds.
os.environ.setdefault("VERISPEC_COMPILE", "0")

import pytest
import torch
from hypothesis import settings

TINY_VOCAB = 512

# Hypothesis profiles. "ci" (the default) is reproducible: the same examples on every run and
# machine, and a failure prints the blob that replays it. "explore" draws fresh random examples,
# ten times as many (README.md, "Developing").
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


# Two fp32 implementations of one forward differ by their reduction order, which changes with the
# CPU kind (AVX-512, AMX, AVX2 kernels block sums differently). That rounding grows with the
# magnitude of what is summed, so a bound is an absolute floor plus a part relative to the scale of
# the compared row (its largest |value|). 2e-5 is about 170 fp32 epsilons, the order of
# sqrt(hidden size x layers) roundings accumulated through a 30-layer, 576-wide model; a real bug
# (a wrong permutation, a dropped bias, a mis-scaled rope) moves logits by 1e-2 or more.
FP32_ATOL = 1e-5
FP32_RTOL = 2e-5


def fp32_tol(scale: float) -> float:
    """The bound for values computed in fp32 whose scale (largest |value| of the row) is `scale`."""
    return FP32_ATOL + FP32_RTOL * float(scale)


# SmolLM2's logits reach about |31|: two fp32 runs of it (another batch, another process) give
# logprobs within twice the logits' bound (log-softmax adds at most the largest logit error).
SMOLLM2_LOGPROB_TOL = 2 * fp32_tol(32.0)


def assert_close_to_oracle(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Row by row: |ours - ref| <= fp32_tol(max |ref| of the row). Returns the worst ratio to the bound."""
    bound = FP32_ATOL + FP32_RTOL * ref.abs().amax(-1, keepdim=True)
    ratio = ((ours - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"max |diff| {(ours - ref).abs().max().item():.3g} exceeds the fp32 bound (ratio {ratio:.2f})"
    return ratio


def examples(n: int) -> int:
    """A test's example budget under the loaded profile."""
    return n * 10 if HYPOTHESIS_PROFILE == "explore" else n


# Each family's features switched on at sizes a short test reaches: windows of 8 keys, soft-caps
# that bite (scores and logits of this scale reach them), a query scale that is not the head size,
# a second RoPE base with linear scaling, partial rotary with LongRoPE past a 64-token context.
FAMILY_OVERRIDES = {
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 3.0,
               "final_logit_softcapping": 6.0, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}},
    "phi3": {"sliding_window": 8, "pad_token_id": 0},
    "phi4mini": {"pad_token_id": 0, "partial_rotary_factor": 0.75, "max_position_embeddings": 512, "original_max_position_embeddings": 64,
                 "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                     "original_max_position_embeddings": 64,
                                     "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                     "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]}},
}
NEW_FAMILIES = ("gemma2", "gemma3", "phi3", "phi4mini")


def make_tiny_checkpoint(path, arch: str = "llama", seed: int | None = None, **overrides) -> str:
    """A tiny random HF model saved with save_pretrained; weights scaled up so that greedy
    decoding is not a sea of near-ties."""
    from transformers import (
        Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
        MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
        Qwen3Config, Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    common.update(overrides)
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "phi4mini": (Phi3Config, Phi3ForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    for key, value in FAMILY_OVERRIDES.get(arch, {}).items():
        common.setdefault(key, value)
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    seeds = {"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4, "gemma2": 5, "gemma3": 6, "phi3": 7, "phi4mini": 8}
    torch.manual_seed(seeds[arch] if seed is None else seed)
    model = model_cls(cfg_cls(**common)).eval()
    model.save_pretrained(str(path))
    return str(path)


def run_fresh(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (what it imports is its own); fails the test with its stderr."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@pytest.fixture(scope="session", autouse=True)
def kernels_built_before_any_engine() -> None:
    """An engine does not wait for a first kernel build (it runs on torch's kernels and builds them in
    the background); the tests do, so every engine here runs on the kernels where they can exist."""
    from verispec.models.cpu_kernels import kernel_build

    kernel_build(wait=True)


@pytest.fixture(autouse=True)
def thread_count_restored():
    """Each test starts from the thread count the one before it started from: an engine's thread
    governor (verispec/cores.py) may leave its thread's count lowered after a step beside other
    work, until that engine's next step, and tests run in a random order."""
    import torch

    from verispec import cores

    before = torch.get_num_threads()
    yield
    cores._governors.clear()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cpu_kernels_loaded() -> None:
    """verispec's CPU kernels built and loaded; a failed build fails the test with its reason."""
    from verispec.models import cpu_kernels

    assert cpu_kernels.cpu_kernels_available(), cpu_kernels.kernel_build().reason


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory) -> str:
    """The tiny llama with a word-level tokenizer ("t0" .. "t511", one word per token id), so that
    text in and text out are token ids in and out, for tests that go through text (server, CLI)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "llama", "llama", max_position_embeddings=2048)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048}, f)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from verispec.models.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_llm():
    from verispec import LLM

    # The exact tier: tests compare it with the HF fp32 oracle.
    return LLM(dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers generate as the oracle: greedy, exactly max_new_tokens, one prompt."""
    ids = torch.tensor([prompt])
    # No EOS at all (rather than min_new_tokens, which would mask EOS and change the argmax):
    # this matches the engine's ignore_eos=True.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def assert_greedy_matches_hf(model, prompts: list[list[int]], ours: list[list[int]], expected: list[list[int]]) -> None:
    """Greedy tokens equal HF's, except where the two sides split at a near-tie: at the first token
    that differs, HF's own top logit and the logit of our token must then lie within the fp32
    bound of each other (a split anywhere else is a real difference)."""
    for prompt, got, want in zip(prompts, ours, expected):
        if got == want:
            continue
        j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():
            row = model(torch.tensor([prompt + want[:j]])).logits[0, -1].float()
        gap = (row.max() - row[got[j]]).item()
        assert gap <= 2 * fp32_tol(row.abs().max()), (
            f"greedy output differs from HF at token {j} ({got[j]} vs {want[j]}) with a logit gap of {gap:.3g}"
        )


def hf_processed(row: torch.Tensor, params, history: list[int]) -> torch.Tensor:
    """HF's processors in the engine's order: penalty, temperature, min_p, top_k, top_p."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = row.float()[None].clone()
    ids = torch.tensor([history], dtype=torch.long)
    if params.repetition_penalty != 1.0 and history:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if not params.greedy and params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return scores[0]


def score_rows(scores: torch.Tensor, num_topk: int, selected: torch.Tensor, custom_ids: torch.Tensor | None = None,
               as_logprobs: bool = True):
    """The engine's scorer on rows that are each their own request, all in one raw mode."""
    from verispec.config import LogprobsMode
    from verispec.sample.logprobs import RequestScoring

    r = scores.shape[0]
    mode = LogprobsMode.RAW_LOGPROBS if as_logprobs else LogprobsMode.RAW_LOGITS
    custom = [c.tolist() for c in custom_ids] if custom_ids is not None else [None] * r
    scoring = RequestScoring.build([mode] * r, [num_topk] * r, custom, scores.shape[1], scores.device)
    return scoring.score(scores, None, selected, torch.arange(r))


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny llama of 16 tokens (path, HF model): the chi-square tests' target."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("v16") / "m", "llama", vocab_size=16, initializer_range=0.3)
    return path, hf_model(path)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, small_vocab_model):
    """A draft model with the same shape and vocab but different weights (drafts often rejected)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("d16") / "d", "llama", seed=99, vocab_size=16,
                                initializer_range=0.3, num_hidden_layers=1)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory, smollm2_path) -> str:
    """A tiny random llama over SmolLM2's 49152-token vocabulary, with its tokenizer (a grammar
    needs real tokens)."""
    from verispec.models.tokenizer_cache import load_tokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tok") / "llama", vocab_size=49152)
    load_tokenizer(smollm2_path).save_pretrained(path)
    return path
