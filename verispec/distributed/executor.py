"""Tensor-parallel execution: rank 0 runs the engine, every rank runs the model on its shard.

Rank 0 keeps the scheduler, the runner, sampling, verification and logprobs; the other ranks
hold nothing but model shards and their share of the KV pool. Every model call rank 0 makes
(`ShardedModel`) first tells the workers what to run in one op message, then runs the same op on
its own shard, so the collectives inside the forward meet in the same order on every rank:
- `Forward`: the plan of a forward (its spans and block tables) in the message, the token ids
  and positions in one tensor broadcast (a model drafter's drafts exist only on the device);
- `ComputeLogits`: the hidden rows rank 0 chose, broadcast; each rank computes its vocabulary
  columns and rank 0 gathers the whole row;
- `LoadModel` / `NewCache`: the target or the draft model, and a cache for it.
A failure inside a mirrored op leaves the group out of step, so it is fatal (ParallelGroupError).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from verispec.config import EngineConfig
from verispec.cores import available_cores, full_threads
from verispec.distributed.comm import Rendezvous, TPGroup, WorkerDiedError
from verispec.distributed.sharding import ShardContext, make_shard, shard_checkpoint
from verispec.models.config import ModelConfig
from verispec.models.llama import LlamaModel
from verispec.models.packed_cache import layouts_for
from verispec.distributed.weight_group import WeightGroupSpec, join_weight_group, receive_weights
from verispec.models.weights import build_update, check_update, prepare

logger = logging.getLogger("verispec.tp")


class ParallelGroupError(WorkerDiedError):
    """A mirrored op failed part-way: the ranks are out of step and the engine must stop."""


@dataclass(slots=True)
class LoadModel:
    model_id: int
    path: str
    dtype: torch.dtype
    quantization: str | None
    rope_context: int | None = None  # the engine's context (ModelConfig.rope_context)


@dataclass(slots=True)
class NewCache:
    model_id: int
    cache_id: int
    num_blocks: int
    block_size: int


@dataclass(slots=True)
class Forward:
    model_id: int
    cache_id: int
    num_tokens: int
    spans: list[tuple[int, int, int, list[int]]]  # SeqSpan fields
    block_size: int
    num_layers: int | None


@dataclass(slots=True)
class ComputeLogits:
    model_id: int
    num_rows: int
    dtype: torch.dtype


@dataclass(slots=True)
class UpdateWeights:
    model_id: int
    tensors: list[tuple[str, tuple[int, ...]]]  # verispec's names and full shapes; fp32 values follow by broadcast


@dataclass(slots=True)
class JoinWeightGroup:
    spec: WeightGroupSpec


@dataclass(slots=True)
class UpdateFromWeightGroup:
    """Every rank receives the announced tensors from the trainer's group, then writes its shard."""

    model_id: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    refused: bool  # rank 0 refuses (requests unfinished): receive, and write nothing


@dataclass(slots=True)
class Shutdown:
    pass


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: one GPU per rank on a node (LOCAL_RANK under torchrun)."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


def rank_threads(config: EngineConfig) -> int:
    """Threads per rank: --num-threads, else torch's own count under torchrun (which sets
    OMP_NUM_THREADS per rank), else the ranks this engine starts share the cores this process
    may use (its affinity and cgroup quota: cores.py), never more than torch's own count."""
    if config.num_threads:
        return config.num_threads
    if Rendezvous.from_env() is not None:
        return torch.get_num_threads()
    return max(1, min(full_threads(), available_cores()) // config.tensor_parallel_size)


def _died(dead: list[str]) -> str:
    return f"tensor-parallel worker died: {', '.join(dead)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_shard(group: TPGroup, cfg: ModelConfig, weights: dict, dtype, device) -> LlamaModel:
    ctx = ShardContext.create(group, cfg)
    local_cfg, local_weights = shard_checkpoint(cfg, weights, ctx.shard)
    return LlamaModel(local_cfg, local_weights, dtype=dtype, device=device, parallel=ctx).eval()


def update_shard(group: TPGroup, cfg: ModelConfig, local: LlamaModel, update: dict[str, torch.Tensor] | None,
                 error: Exception | None = None) -> Exception | None:
    """Every rank: its part of a checked update (whole tensors, `cfg` the whole model's), built and
    checked on every rank before any rank writes, so that the ranks never hold different weights.
    `error`: this rank refuses already (every rank still takes part). Returns this rank's error, or
    a stand-in for another rank's, when nothing was written."""
    pending = None
    if error is None:
        try:
            _, new = shard_checkpoint(cfg, prepare(update, local), local.parallel.shard)
            pending = build_update(local, new)
        except ValueError as exc:
            error = exc
    failed = group.all_reduce(torch.full((1,), float(error is not None), device=local.embed.device))
    if failed.item():
        return error or ValueError("another tensor-parallel rank could not build its part of the update (see its log)")
    pending.commit()
    return None


def checked_update(named, cfg: ModelConfig, refusal: Exception | None) -> tuple[dict | None, Exception | None]:
    """(the update under verispec's names, None) or (None, why it is refused)."""
    if refusal is not None:
        return None, refusal
    try:
        return check_update(named, cfg), None
    except ValueError as exc:
        return None, exc


def build_model(cfg: ModelConfig, weights: dict, path, dtype, quantization, device,
                tp: "TensorParallel | None"):
    """The model the engine calls: a `LlamaModel`, or rank 0's `ShardedModel` under tensor parallelism."""
    if tp is None:
        with layouts_for(path, device):  # a GGUF file's packed matrices, saved at its first load
            return LlamaModel(cfg, weights, dtype=dtype, device=device).eval()
    return tp.load_model(cfg, weights, path, dtype, quantization)


class TensorParallel:
    """Rank 0's side of the group: starts or joins the workers and sends them ops."""

    def __init__(self, config: EngineConfig, model_path):
        """Starts the workers on this machine (or finds torchrun's); `connect` joins them. Started
        first, they import torch and read the checkpoint while rank 0 reads its own."""
        self.size, self.procs = config.tensor_parallel_size, []
        self.group: TPGroup | None = None
        self.device = rank_device(config.device, 0)
        self._num_models = 0
        self._caches: dict[int, tuple[int, list]] = {}  # id(cache layers) -> (cache id, the layers)
        rv = Rendezvous.from_env()
        if rv is not None and rv.size > 1:  # torchrun / env:// across machines: the workers exist
            if rv.size != self.size or rv.rank != 0:
                raise ValueError(f"tensor_parallel_size={self.size} but this process is rank {rv.rank} of "
                                 f"WORLD_SIZE={rv.size}; launch one rank per device, WORLD_SIZE = the size")
            self._rv = rv
            return
        self._rv = Rendezvous("127.0.0.1", _free_port(), 0, self.size)
        # Fresh interpreters, not multiprocessing children: the server's engine core is itself a
        # daemon process (which multiprocessing forbids to have children), and a fork of a process
        # that ran torch threads is unsafe.
        args = ["--host", self._rv.host, "--port", str(self._rv.port), "--size", str(self.size),
                "--device", str(config.device), "--threads", str(rank_threads(config)),
                "--preload", str(model_path), str(config.dtype).removeprefix("torch.")]
        if config.quantization is not None:
            args += ["--quantization", config.quantization]
        self.procs = [subprocess.Popen([sys.executable, "-m", "verispec.distributed.worker", "--rank", str(r), *args])
                      for r in range(1, self.size)]

    def connect(self, cfg: ModelConfig) -> None:
        """Checks that the model splits over the ranks, then forms the group with the workers."""
        for rank in range(self.size):
            make_shard(cfg, self.size, rank)
        self.group = TPGroup(self._rv, self.device)

    def dead_workers(self) -> list[str]:
        return [f"rank {r} (exit code {p.returncode})" for r, p in enumerate(self.procs, 1) if p.poll() is not None]

    def check(self) -> None:
        """Raises WorkerDiedError if a worker this process started has exited."""
        if dead := self.dead_workers():
            raise WorkerDiedError(_died(dead))

    def send(self, op) -> None:
        self.check()
        try:
            self.group.send_op(op)
        except RuntimeError as exc:
            raise self._failure(op, exc) from exc

    def mirrored(self, op, fn, *args):
        """fn(*args) on this rank's shard once every worker was told to run `op`."""
        self.send(op)
        try:
            return fn(*args)
        except Exception as exc:
            raise self._failure(op, exc) from exc

    def _failure(self, op, exc: Exception) -> ParallelGroupError:
        """The error for an op that failed: a dead worker's exit is often seen by the connection
        a moment before the process is reaped, so it gets a second to show up."""
        deadline = time.monotonic() + 1.0
        while not (dead := self.dead_workers()) and self.procs and time.monotonic() < deadline:
            time.sleep(0.02)
        if dead:
            return ParallelGroupError(f"{_died(dead)} (during {type(op).__name__})")
        return ParallelGroupError(f"tensor-parallel op {type(op).__name__} failed: {exc}")

    def load_model(self, cfg: ModelConfig, weights: dict, path: str, dtype, quantization) -> "ShardedModel":
        model_id = self._num_models
        self._num_models += 1
        self.send(LoadModel(model_id, str(path), dtype, quantization, cfg.rope_context))
        local = load_shard(self.group, cfg, weights, dtype, self.device)
        failed = self.group.all_reduce(torch.zeros(1, device=self.device))  # each worker adds 1 on failure
        if failed.item():
            raise RuntimeError(f"{int(failed.item())} tensor-parallel worker(s) failed to load {path} (see their log)")
        return ShardedModel(self, model_id, cfg, local)

    def update_weights(self, model: "ShardedModel", update: dict[str, torch.Tensor]) -> None:
        """Sends a checked update (verispec's names, whole tensors) to every rank, each writes its shard."""
        names = list(update)
        self.send(UpdateWeights(model.model_id, [(n, tuple(update[n].shape)) for n in names]))
        # fp32 on the wire: every floating dtype a trainer sends converts to it exactly.
        values = {n: self.group.broadcast(update[n].to(self.device, torch.float32).contiguous()) for n in names}
        if (error := update_shard(self.group, model.cfg, model.local, values)) is not None:
            raise error

    def join_weight_group(self, spec: WeightGroupSpec):
        """Every rank joins the trainer's group (rank 0's group is returned)."""
        self.send(JoinWeightGroup(spec))
        return join_weight_group(spec, 0, self.device)

    def update_from_weight_group(self, model: "ShardedModel", weight_group, names, dtypes, shapes,
                                 refusal: Exception | None) -> int:
        """Every rank receives the trainer's tensors and writes its shard, or none does."""
        self.send(UpdateFromWeightGroup(model.model_id, names, dtypes, shapes, refusal is not None))
        named = receive_weights(weight_group, names, dtypes, shapes, self.device)
        update, error = checked_update(named, model.cfg, refusal)
        if (error := update_shard(self.group, model.cfg, model.local, update, error)) is not None:
            raise error
        return len(update)

    def new_cache(self, model_id: int, local: LlamaModel, num_blocks: int, block_size: int):
        cache = local.new_kv_cache(num_blocks, block_size)
        cache_id = len(self._caches)
        self._caches[id(cache.layers)] = (cache_id, cache.layers)  # holding the list keeps its id unique
        return self.mirrored(NewCache(model_id, cache_id, num_blocks, block_size), lambda: cache)

    def cache_id(self, layers: list) -> int:
        return self._caches[id(layers)][0]

    def shutdown(self) -> None:
        try:
            if self.group is not None and not self.dead_workers():
                self.group.send_op(Shutdown())
        except RuntimeError:
            pass
        if self.group is None:  # never connected: the workers wait for a store that will not come
            for p in self.procs:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in a collective rank 0 left: no clean exit
                p.kill()
                p.wait()
        self.procs = []


class ShardedModel:
    """Rank 0's model under tensor parallelism, with `LlamaModel`'s calling interface: `cfg` is
    the whole model's, the calls run on every rank's shard."""

    compiled = None  # collectives stay outside Inductor's graph: tensor-parallel ranks run eager

    def __init__(self, tp: TensorParallel, model_id: int, cfg: ModelConfig, local: LlamaModel):
        self.tp, self.model_id, self.cfg, self.local = tp, model_id, cfg, local

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def embed(self) -> torch.Tensor:
        return self.local.embed

    def __call__(self, input_ids, positions, meta, kv_caches, num_layers: int | None = None) -> torch.Tensor:
        spans = [(s.start, s.num_query, s.context_len, s.block_table) for s in meta.spans]
        op = Forward(self.model_id, self.tp.cache_id(kv_caches), input_ids.shape[0], spans, meta.block_size, num_layers)

        def run():
            self.tp.group.broadcast(torch.stack([input_ids.long(), positions.long()]))
            return self.local(input_ids, positions, meta, kv_caches, num_layers)
        return self.tp.mirrored(op, run)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        def run():
            self.tp.group.broadcast(hidden.contiguous())
            return self.local.compute_logits(hidden)
        return self.tp.mirrored(ComputeLogits(self.model_id, hidden.shape[0], hidden.dtype), run)

    def new_kv_cache(self, num_blocks: int, block_size: int):
        return self.tp.new_cache(self.model_id, self.local, num_blocks, block_size)
