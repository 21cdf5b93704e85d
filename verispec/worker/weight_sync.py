"""The engine's side of in-place weight updates (`LLM.update_weights`): where the new values come
from, on which ranks they are written, and the weight version every output carries.

The model side (verispec/models/weights.py) checks, re-quantizes and writes the tensors. An
update runs only while no request is unfinished, so every request is generated under one weight
version from start to finish; the server pauses generation first (abort or wait)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.distributed.weight_group import WeightGroupSpec, join_weight_group, receive_weights
from verispec.models.weights import build_update, check_update, prepare, read_safetensors

WeightsLike = str | Path | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
WeightVersion = int | str


class UpdateWhileRunning(RuntimeError):
    """update_weights with requests unfinished: the caller pauses generation first."""


@dataclass(slots=True, frozen=True)
class WeightUpdate:
    """What `update_weights` did: the version now served, how many tensors, how long it took."""

    weight_version: WeightVersion
    num_tensors: int
    seconds: float


def named_tensors(weights: WeightsLike) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a safetensors path, a mapping or an iterable of pairs."""
    if isinstance(weights, (str, Path)):
        return read_safetensors(weights)
    if isinstance(weights, Mapping):
        return list(weights.items())
    pairs = list(weights)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError("weights must be a safetensors path, a mapping of name -> tensor, or (name, tensor) pairs")
    return pairs


def check_version(version) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
        raise ValueError(f"weight_version must be an integer or a string; got {type(version).__name__}")


def update_model_weights(model, tp, weights: WeightsLike) -> int:
    """Writes the new values into `model` (rank 0's `ShardedModel` under tensor parallelism: every
    rank writes its shard, or none does). Returns the number of tensors updated."""
    update = check_update(named_tensors(weights), model.cfg)
    if tp is not None:
        tp.update_weights(model, update)
    else:
        build_update(model, prepare(update, model)).commit()
    return len(update)


class WeightVersions:
    """The version the engine serves: the caller's, or the number of updates so far (0 as loaded)."""

    def __init__(self) -> None:
        self.current: WeightVersion = 0
        self.num_updates = 0

    def advance(self, given: WeightVersion | None) -> WeightVersion:
        self.num_updates += 1
        self.current = given if given is not None else self.num_updates
        return self.current


def timed_update(write, versions: WeightVersions, given: WeightVersion | None) -> WeightUpdate:
    """Runs `write()` (returns the number of tensors written) and advances the version."""
    check_version(given)
    start = time.perf_counter()
    n = write()
    return WeightUpdate(versions.advance(given), n, time.perf_counter() - start)


class WeightGroupLink:
    """The engine's membership of a trainer's process group (distributed/weight_group.py)."""

    def __init__(self) -> None:
        self.group = None

    def join(self, spec: WeightGroupSpec, tp, device: torch.device) -> None:
        self.group = tp.join_weight_group(spec) if tp is not None else join_weight_group(spec, 0, device)

    def receive(self, model, tp, names: list[str], dtypes: list[str], shapes: list[list[int]],
                refusal: Exception | None, device: torch.device) -> int:
        """Receives every announced tensor (the trainer's broadcast must complete), then writes
        them, or raises `refusal` (the engine is busy) or the check's ValueError."""
        if self.group is None:
            raise ValueError("no weight update group: call init_weights_update_group first")
        if tp is not None:
            return tp.update_from_weight_group(model, self.group, names, dtypes, shapes, refusal)
        named = receive_weights(self.group, names, dtypes, shapes, device)
        if refusal is not None:
            raise refusal
        return update_model_weights(model, None, named)
