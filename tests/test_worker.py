"""A tensor-parallel worker's loop (verispec/distributed/worker.py), run as rank 1 in a thread of
this process while the test drives rank 0 (`TensorParallel` without its worker processes): a load
that fails on the worker is reported by rank 0, and Shutdown ends the loop. The ranks' forward is
tested with worker processes (test_tensor_parallel.py): two threads would share the step's
process-wide attention context."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from verispec.distributed.comm import Rendezvous, TPGroup
from verispec.distributed.executor import Shutdown, TensorParallel
from verispec.distributed.worker import run_worker
from verispec.models.loader import load_checkpoint

CPU = torch.device("cpu")


@pytest.fixture
def rank0():
    """(rank 0's TensorParallel, the worker thread), the group formed; shut down afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = threading.Thread(target=run_worker, args=(Rendezvous("127.0.0.1", port, 1, 2), CPU, torch.get_num_threads()),
                              daemon=True)  # the thread count is process-wide: keep it
    worker.start()
    tp = TensorParallel.__new__(TensorParallel)
    tp.size, tp.procs, tp.device, tp._num_models, tp._caches = 2, [], CPU, 0, {}
    tp.group = TPGroup(Rendezvous("127.0.0.1", port, 0, 2), CPU)
    yield tp, worker
    if worker.is_alive():
        tp.group.send_op(Shutdown())
    worker.join(30)


def test_a_load_that_fails_on_the_worker_is_reported_by_rank_0(rank0, tiny_llama, tmp_path):
    tp, worker = rank0
    cfg, weights = load_checkpoint(tiny_llama, torch.float32, None)
    # Rank 0 loads its own copy; the worker reads the path it is sent, which holds no checkpoint.
    with pytest.raises(RuntimeError, match="1 tensor-parallel worker\\(s\\) failed to load"):
        tp.load_model(cfg, dict(weights), str(tmp_path / "missing"), torch.float32, None)
    assert worker.is_alive()  # a failed load is reported, not fatal to the worker


def test_shutdown_ends_the_loop(rank0):
    tp, worker = rank0
    tp.group.send_op(Shutdown())
    worker.join(30)
    assert not worker.is_alive()
