"""A trainer's process group for pushing weights into a running engine, as SGLang's
`/init_weights_update_group` and `/update_weights_from_distributed` do: the trainer is rank 0, the
engine's tensor-parallel ranks are `rank_offset + tp_rank`; gloo on a CPU, NCCL on CUDA.

The trainer broadcasts each tensor (`broadcast_weights`); every engine rank receives every
tensor whole (`receive_weights`) and then writes its shard, as `LLM.update_weights` does. The
engine always receives everything the caller announced before it checks anything: a refusal
half-way would leave the trainer blocked in its broadcast.
"""

from __future__ import annotations

import atexit
import datetime
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=10)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True, frozen=True)
class WeightGroupSpec:
    master_address: str
    master_port: int
    rank_offset: int  # the engine's rank 0 in the group (the trainer is 0, so usually 1)
    world_size: int  # the trainer's ranks plus the engine's
    group_name: str = "weights"
    backend: str | None = None  # None: gloo on a CPU, nccl on CUDA

    def __post_init__(self):
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset must be in [1, world_size); got {self.rank_offset} of {self.world_size}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl'; got {self.backend!r}")


class WeightGroup:
    def __init__(self, process_group: dist.ProcessGroup, store: dist.TCPStore):
        self.process_group, self.store = process_group, store  # the group talks through the store
        # At interpreter exit the group must go before its store (gloo aborts the process otherwise).
        atexit.register(self.close)

    def close(self) -> None:
        self.process_group = None
        self.store = None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's (same shape and dtype)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.process_group.broadcast([tensor], opts).wait()
        return tensor


def _group(host: str, port: int, rank: int, size: int, name: str, backend: str) -> WeightGroup:
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=TIMEOUT)
    prefixed = dist.PrefixStore(name, store)
    if backend == "nccl":
        return WeightGroup(dist.ProcessGroupNCCL(prefixed, rank, size), store)
    return WeightGroup(dist.ProcessGroupGloo(prefixed, rank, size, TIMEOUT), store)


def join_weight_group(spec: WeightGroupSpec, tp_rank: int, device: torch.device) -> WeightGroup:
    """The engine side (each tensor-parallel rank): blocks until every rank has joined."""
    backend = spec.backend or ("nccl" if device.type == "cuda" else "gloo")
    return _group(spec.master_address, spec.master_port, spec.rank_offset + tp_rank, spec.world_size,
                  spec.group_name, backend)


def trainer_weight_group(master_address: str, master_port: int, world_size: int, group_name: str = "weights",
                         backend: str = "gloo") -> WeightGroup:
    """The trainer side, rank 0: hosts the store; blocks until the engine's ranks have joined."""
    return _group(master_address, master_port, 0, world_size, group_name, backend)


def broadcast_weights(group: WeightGroup, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The trainer: each tensor from rank 0, in the order announced to the engine."""
    for _, tensor in named:
        group.broadcast(tensor.detach().contiguous())


def receive_weights(group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The engine: every announced tensor, from the trainer's broadcast."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must be as long as each other; got {len(names)}, "
                         f"{len(dtypes)} and {len(shapes)}")
    bad = [d for d in dtypes if d.removeprefix("torch.") not in _DTYPES]
    if bad:  # nothing can be received into an unknown dtype: refused before the broadcast
        raise ValueError(f"dtypes: {bad[0]!r} is not one of {', '.join(_DTYPES)}")
    return [(name, group.broadcast(torch.empty(tuple(shape), dtype=_DTYPES[dtype.removeprefix("torch.")],
                                               device=device)))
            for name, dtype, shape in zip(names, dtypes, shapes)]
