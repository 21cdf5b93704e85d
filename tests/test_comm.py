"""The tensor-parallel group (verispec/distributed/comm.py) with two real gloo ranks as two threads
of this process: the one-shot all-reduce sums in rank order and leaves both ranks bit-identical,
broadcast and the column gather against the tensors each rank holds, op messages round-trip, and
the torchrun environment is read into a `Rendezvous`."""

from __future__ import annotations

import concurrent.futures as cf
import socket

import pytest
import torch

from verispec.distributed.comm import Rendezvous, TPGroup

CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_two_ranks(fn):
    """fn(group) on rank 0 and rank 1 at once; returns [rank 0's result, rank 1's]."""
    port = free_port()

    def rank(r):
        return fn(TPGroup(Rendezvous("127.0.0.1", port, r, 2), CPU))

    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(rank, r) for r in (0, 1)]
        return [f.result(timeout=60) for f in futures]


def part(rank: int) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))


def test_all_reduce_sums_the_ranks_parts_identically_on_both():
    out = on_two_ranks(lambda g: (g.all_reduce(part(g.rank).clone()), g.bytes_reduced))
    (a, n), (b, _) = out
    assert torch.equal(a, b)  # bit for bit: both add rank 0's part, then rank 1's
    assert torch.equal(a, part(0) + part(1)) and n == 3 * 5 * 4


def test_broadcast_gives_every_rank_rank_0s_tensor():
    a, b = on_two_ranks(lambda g: g.broadcast(part(g.rank).clone()))
    assert torch.equal(a, part(0)) and torch.equal(b, part(0))


def test_gather_columns_puts_each_ranks_block_side_by_side_on_rank_0():
    widths = [3, 2]

    def gather(g):
        local = torch.full((2, widths[g.rank]), float(g.rank + 1))
        return g.gather_columns(local, widths)

    on_0, on_1 = on_two_ranks(gather)
    assert on_0.tolist() == [[1, 1, 1, 2, 2]] * 2
    assert on_1.shape == (2, 3)  # the other ranks get their own (padded) block back


def test_op_messages_round_trip():
    op = {"op": "forward", "spans": [(0, 1, 5, [3, 4])]}

    def exchange(g):
        if g.rank == 0:
            g.send_op(op)
            return g.bytes_control
        return g.recv_op()

    sent_bytes, received = on_two_ranks(exchange)
    assert received == op and sent_bytes > 8


def test_the_torchrun_environment_gives_the_rendezvous(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert Rendezvous.from_env() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert Rendezvous.from_env() == Rendezvous("127.0.0.1", 29500, 1, 4)  # torchrun's defaults
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert Rendezvous.from_env() == Rendezvous("10.0.0.2", 1234, 1, 4)


@pytest.mark.parametrize("bad", [{"RANK": "0"}, {"WORLD_SIZE": "2"}])
def test_half_a_torchrun_environment_is_none(monkeypatch, bad):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for k, v in bad.items():
        monkeypatch.setenv(k, v)
    assert Rendezvous.from_env() is None
