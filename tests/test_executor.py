"""Rank 0's side of tensor parallelism (verispec/distributed/executor.py), without starting worker
processes: each rank's device and thread count, the refusal of a torchrun launch whose size does not
match, a dead worker named with its exit code, a failed mirrored op made fatal, and `build_model`
without tensor parallelism. Two ranks computing one rank's logits: test_worker.py and, end to end,
test_tensor_parallel.py."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from verispec.distributed.comm import WorkerDiedError
from verispec.distributed.executor import (
    ParallelGroupError, Shutdown, TensorParallel, build_model, rank_device, rank_threads,
)
from verispec.models.llama import LlamaModel
from verispec.models.loader import load_checkpoint

CPU = torch.device("cpu")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def bare_tp(procs=(), group=None) -> TensorParallel:
    """Rank 0's object as `connect` leaves it, with the given worker processes and group."""
    tp = TensorParallel.__new__(TensorParallel)
    tp.size, tp.procs, tp.group, tp.device = 2, list(procs), group, CPU
    return tp


def test_a_cpu_rank_stays_on_the_cpu():
    assert rank_device(CPU, 3) == CPU


def test_threads_per_rank(no_torchrun, monkeypatch):
    assert rank_threads(SimpleNamespace(num_threads=3, tensor_parallel_size=2)) == 3  # asked for
    monkeypatch.setattr("verispec.distributed.executor.available_cores", lambda: 16)  # affinity and quota
    monkeypatch.setattr("verispec.distributed.executor.full_threads", lambda: 16)  # the thread's own count
    assert rank_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=4)) == 4  # the cores, shared
    monkeypatch.setattr("verispec.distributed.executor.full_threads", lambda: 8)  # OMP_NUM_THREADS=8
    assert rank_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=4)) == 2
    assert rank_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=32)) == 1
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=4)) == torch.get_num_threads()


def test_a_torchrun_launch_of_another_size_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but this process is rank 0 of WORLD_SIZE=4"):
        TensorParallel(SimpleNamespace(tensor_parallel_size=2, device=CPU), "unused")


def test_a_dead_worker_is_named_with_its_exit_code():
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(WorkerDiedError, match=r"tensor-parallel worker died: rank 1 \(exit code 3\)"):
        bare_tp([dead]).check()


def test_a_mirrored_op_that_fails_is_fatal():
    sent = []
    tp = bare_tp(group=SimpleNamespace(send_op=sent.append))

    def fails():
        raise RuntimeError("shape mismatch")

    with pytest.raises(ParallelGroupError, match="tensor-parallel op Shutdown failed: shape mismatch"):
        tp.mirrored(Shutdown(), fails)
    assert sent == [Shutdown()]  # the workers were told first
    assert issubclass(ParallelGroupError, WorkerDiedError)  # the engine treats it as fatal, never retried


def test_without_tensor_parallelism_the_model_is_a_plain_llama(tiny_llama):
    cfg, weights = load_checkpoint(tiny_llama, torch.float32, None)
    model = build_model(cfg, weights, tiny_llama, torch.float32, None, CPU, None)
    assert type(model) is LlamaModel and not model.training
