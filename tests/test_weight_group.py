"""A trainer in another process pushes weights through torch.distributed
(verispec/distributed/weight_group.py): the engine joins the trainer's gloo group and receives the
tensors by broadcast; with tensor parallelism every rank receives and writes its shard. The result
equals a fresh engine on the new weights, and a refused update still drains the trainer's
broadcast (the trainer never hangs)."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
from safetensors.torch import load_file

from conftest import make_tiny_checkpoint, random_prompts
from server_utils import free_port
from verispec import LLM, SamplingParams
from verispec.distributed.weight_group import WeightGroupSpec
from verispec.worker.weight_sync import UpdateWhileRunning

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
PROMPTS = random_prompts(2, 4, 10, seed=21)

# The trainer: rank 0 of the group; broadcasts checkpoint B's tensors `rounds` times, in name order.
TRAINER = """
import sys, torch
from safetensors.torch import load_file
from verispec.distributed.weight_group import trainer_weight_group, broadcast_weights
port, world, rounds, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
group = trainer_weight_group("127.0.0.1", port, world)
tensors = sorted(load_file(path + "/model.safetensors").items())
for _ in range(rounds):
    broadcast_weights(group, tensors)
print("trainer done")
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    return make_tiny_checkpoint(root / "a", "qwen2", seed=1), make_tiny_checkpoint(root / "b", "qwen2", seed=2)


def announce(path: str) -> tuple[list[str], list[str], list[list[int]]]:
    tensors = sorted(load_file(os.path.join(path, "model.safetensors")).items())
    return ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])


def outputs(llm: LLM) -> list:
    llm.reset_prefix_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def trainer(port: int, world: int, rounds: int, path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(world), str(rounds), path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trainer_process_pushes_weights_by_broadcast(pair, tp):
    a, b = pair
    port = free_port()
    proc = trainer(port, 1 + tp, 2, b)
    llm = LLM(a, dtype="float32", enforce_eager=True, tensor_parallel_size=tp)
    try:
        llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=1 + tp)
        # Busy: every tensor is still received (the trainer's first round completes), nothing written.
        llm.engine.add_request("busy", [5, 6, 7], PARAMS)
        with pytest.raises(UpdateWhileRunning):
            llm.update_weights_from_distributed(*announce(b))
        llm.engine.abort_request("busy")
        before = outputs(llm)
        done = llm.update_weights_from_distributed(*announce(b), weight_version="pushed")
        assert done.weight_version == "pushed" and done.num_tensors == len(announce(b)[0])
        after = outputs(llm)
    finally:
        llm.shutdown()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "trainer done" in out, out
    fresh = LLM(b, dtype="float32", enforce_eager=True, tensor_parallel_size=tp)
    try:
        assert after != before and after == outputs(fresh)
    finally:
        fresh.shutdown()


def test_an_update_before_joining_and_a_bad_spec_are_refused(pair):
    llm = LLM(pair[0], dtype="float32", enforce_eager=True)
    with pytest.raises(ValueError, match="init_weights_update_group"):
        llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
    with pytest.raises(ValueError, match="rank_offset"):
        WeightGroupSpec("127.0.0.1", 1, rank_offset=0, world_size=2)
    with pytest.raises(ValueError, match="backend"):
        WeightGroupSpec("127.0.0.1", 1, rank_offset=1, world_size=2, backend="mpi")
