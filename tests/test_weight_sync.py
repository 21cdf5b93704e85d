"""The engine's side of weight updates (verispec/worker/weight_sync.py): what `weights` may be,
when an update may run, the weight version on outputs and metrics, and the emptied prefix cache."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from prometheus_client import generate_latest
from safetensors.torch import load_file, save_file

from conftest import make_tiny_checkpoint, random_prompts
from verispec import LLM, SamplingParams
from verispec.engine.dp_client import sum_stats
from verispec.worker.weight_sync import UpdateWhileRunning, WeightVersions, named_tensors
from verispec.entrypoints.openai.metrics import ServerMetrics

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    return make_tiny_checkpoint(root / "a", "llama", seed=1), make_tiny_checkpoint(root / "b", "llama", seed=2)


def test_weights_come_from_a_path_a_mapping_or_pairs(pair, tmp_path):
    b = pair[1]
    tensors = load_file(os.path.join(b, "model.safetensors"))
    names = sorted(tensors)
    half = dict(list(tensors.items())[: len(names) // 2])
    save_file(half, tmp_path / "one.safetensors")
    save_file({n: t for n, t in tensors.items() if n not in half}, tmp_path / "two.safetensors")
    assert sorted(n for n, _ in named_tensors(b)) == names  # a checkpoint directory
    assert sorted(n for n, _ in named_tensors(tmp_path)) == names  # shards, every file read
    assert sorted(n for n, _ in named_tensors(tmp_path / "one.safetensors")) == sorted(half)
    assert [n for n, _ in named_tensors(tensors)] == list(tensors)
    assert [n for n, _ in named_tensors(iter(tensors.items()))] == list(tensors)
    for bad in (tmp_path / "missing", ["not a pair"], [(1, torch.ones(1))]):
        with pytest.raises(ValueError, match="weights"):
            named_tensors(bad)


def test_versions_count_updates_unless_given():
    v = WeightVersions()
    assert v.current == 0
    assert v.advance(None) == 1 and v.advance("step-7") == "step-7" and v.advance(None) == 3
    assert v.num_updates == 3


def test_an_update_waits_for_no_request(pair):
    a, b = pair
    llm = LLM(a, dtype="float32", enforce_eager=True)
    llm.engine.add_request("r", [5, 6, 7], PARAMS)
    with pytest.raises(UpdateWhileRunning, match="1 request"):
        llm.update_weights(b)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.update_weights(b).weight_version == 1


def test_outputs_carry_the_version_they_ran_under(pair):
    a, b = pair
    llm = LLM(a, dtype="float32", enforce_eager=True)
    prompts = random_prompts(2, 4, 8, seed=3)
    assert {o.weight_version for o in llm.generate(prompts, PARAMS, use_tqdm=False)} == {0}
    llm.update_weights(b, weight_version="ckpt-100")
    assert {o.weight_version for o in llm.generate(prompts, PARAMS, use_tqdm=False)} == {"ckpt-100"}
    with pytest.raises(ValueError, match="weight_version"):
        llm.update_weights(b, weight_version=1.5)
    stats = llm.stats()
    assert stats["weight_version"] == "ckpt-100" and stats["num_weight_updates"] == 1


def test_a_cached_prefix_is_not_served_across_an_update(pair):
    """The prompt's KV blocks and prompt-logprob rows were computed under the old weights."""
    a, b = pair
    prompt = random_prompts(1, 40, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    llm = LLM(a, dtype="float32", enforce_eager=True, block_size=4)
    llm.generate(prompt, params, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    llm.update_weights(b)
    after = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hits"] == hits
    fresh = LLM(b, dtype="float32", enforce_eager=True, block_size=4).generate(prompt, params, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert after.prompt_logprobs == fresh.prompt_logprobs


def test_metrics_show_the_version_and_replicas_agree_on_one(pair):
    a, b = pair
    llm = LLM(a, dtype="float32", enforce_eager=True)
    llm.update_weights(b, weight_version="v2")
    metrics = ServerMetrics("m")
    metrics.engine_stats = llm.engine.engine_stats()
    text = generate_latest(metrics.registry).decode()
    assert 'verispec:weight_version_info{model_name="m",weight_version="v2"} 1.0' in text
    assert 'verispec:weight_updates_total{model_name="m"} 1.0' in text
    stats = llm.engine.engine_stats()
    assert sum_stats([stats, stats], [True, True]).weight_version == "v2"
    assert sum_stats([stats, llm.engine.engine_stats().__class__()], [True, True]).weight_version == "mixed"
