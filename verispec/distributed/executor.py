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
import traceback
from dataclasses import dataclass, replace

import torch
import torch.multiprocessing as mp

from verispec.config import EngineConfig
from verispec.distributed.comm import Rendezvous, TPGroup, WorkerDiedError
from verispec.distributed.sharding import ShardContext, make_shard, shard_checkpoint
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.config import ModelConfig
from verispec.models.llama import LlamaModel
from verispec.models.loader import load_checkpoint

logger = logging.getLogger("verispec.tp")


class ParallelGroupError(WorkerDiedError):
    """A mirrored op failed part-way: the ranks are out of step and the engine must stop."""


@dataclass(slots=True)
class LoadModel:
    model_id: int
    path: str
    dtype: torch.dtype
    quantization: str | None


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
class Shutdown:
    pass


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: one GPU per rank on a node (LOCAL_RANK under torchrun)."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


def rank_threads(config: EngineConfig) -> int:
    """Ranks on one machine share its cores."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_shard(group: TPGroup, cfg: ModelConfig, weights: dict, dtype, device) -> LlamaModel:
    ctx = ShardContext.create(group, cfg)
    local_cfg, local_weights = shard_checkpoint(cfg, weights, ctx.shard)
    return LlamaModel(local_cfg, local_weights, dtype=dtype, device=device, parallel=ctx).eval()


def build_model(cfg: ModelConfig, weights: dict, path, dtype, quantization, device,
                tp: "TensorParallel | None"):
    """The model the engine calls: a `LlamaModel`, or rank 0's `ShardedModel` under tensor parallelism."""
    if tp is None:
        return LlamaModel(cfg, weights, dtype=dtype, device=device).eval()
    return tp.load_model(cfg, weights, path, dtype, quantization)


class TensorParallel:
    """Rank 0's side of the group: starts or joins the workers and sends them ops."""

    def __init__(self, config: EngineConfig, cfg: ModelConfig):
        size = config.tensor_parallel_size
        for rank in range(size):  # a model that cannot split says so before any process starts
            make_shard(cfg, size, rank)
        self.procs: list[mp.Process] = []
        rv = Rendezvous.from_env()
        if rv is not None and rv.size > 1:  # torchrun / env:// across machines: the workers exist
            if rv.size != size or rv.rank != 0:
                raise ValueError(f"tensor_parallel_size={size} but this process is rank {rv.rank} of "
                                 f"WORLD_SIZE={rv.size}; launch one rank per device, WORLD_SIZE = the size")
        else:
            rv = Rendezvous("127.0.0.1", _free_port(), 0, size)
            ctx = mp.get_context("spawn")  # a fork of a process that ran torch threads is unsafe
            for r in range(1, size):
                proc = ctx.Process(target=run_worker, args=(replace(rv, rank=r), config),
                                   name=f"verispec-tp{r}", daemon=True)
                proc.start()
                self.procs.append(proc)
        self.device = rank_device(config.device, 0)
        self.group = TPGroup(rv, self.device)
        self._num_models = 0
        self._caches: dict[int, tuple[int, list]] = {}  # id(cache layers) -> (cache id, the layers)

    @property
    def size(self) -> int:
        return self.group.size

    def dead_workers(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode is not None]

    def check(self) -> None:
        """Raises WorkerDiedError if a worker this process started has exited."""
        dead = self.dead_workers()
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker died: {', '.join(dead)}")

    def send(self, op) -> None:
        self.check()
        try:
            self.group.send_op(op)
        except RuntimeError as exc:
            raise WorkerDiedError(f"tensor-parallel group lost a worker: {exc}") from exc

    def mirrored(self, op, fn, *args):
        """fn(*args) on this rank's shard once every worker was told to run `op`."""
        self.send(op)
        try:
            return fn(*args)
        except Exception as exc:
            dead = ", ".join(self.dead_workers()) or "no worker exited"
            raise ParallelGroupError(f"tensor-parallel op {type(op).__name__} failed ({dead}): {exc}") from exc

    def load_model(self, cfg: ModelConfig, weights: dict, path: str, dtype, quantization) -> "ShardedModel":
        model_id = self._num_models
        self._num_models += 1
        self.send(LoadModel(model_id, str(path), dtype, quantization))
        local = _load_shard(self.group, cfg, weights, dtype, self.device)
        failed = self.group.all_reduce(torch.zeros(1, device=self.device))  # each worker adds 1 on failure
        if failed.item():
            raise RuntimeError(f"{int(failed.item())} tensor-parallel worker(s) failed to load {path} (see their log)")
        return ShardedModel(self, model_id, cfg, local)

    def new_cache(self, model_id: int, local: LlamaModel, num_blocks: int, block_size: int):
        cache = local.new_kv_cache(num_blocks, block_size)
        cache_id = len(self._caches)
        self._caches[id(cache.layers)] = (cache_id, cache.layers)  # holding the list keeps its id unique
        return self.mirrored(NewCache(model_id, cache_id, num_blocks, block_size), lambda: cache)

    def cache_id(self, layers: list) -> int:
        return self._caches[id(layers)][0]

    def shutdown(self) -> None:
        try:
            if not self.dead_workers():
                self.group.send_op(Shutdown())
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
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

    def eval(self) -> "ShardedModel":
        return self

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


def run_worker(rv: Rendezvous, config: EngineConfig) -> None:
    """A worker rank: its shards, its caches, and the ops rank 0 sends, until Shutdown or until
    rank 0 is gone (the control group's connection closes)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rv.rank} %(levelname)s %(message)s")
    torch.set_num_threads(rank_threads(config))
    device = rank_device(config.device, rv.rank)
    group = TPGroup(rv, device)
    models: dict[int, LlamaModel] = {}
    caches: dict[int, list] = {}
    with torch.inference_mode():
        while True:
            try:
                op = group.recv_op()
            except RuntimeError:
                logger.info("rank 0 is gone; worker %d exits", rv.rank)
                return
            if isinstance(op, Shutdown):
                return
            if isinstance(op, LoadModel):
                weights = None
                try:
                    cfg, weights = load_checkpoint(op.path, op.dtype, op.quantization)
                    models[op.model_id] = _load_shard(group, cfg, weights, op.dtype, device)
                    failed = 0.0
                except Exception:  # noqa: BLE001 - reported to rank 0, which raises
                    logger.error("loading %s failed:\n%s", op.path, traceback.format_exc())
                    failed = 1.0
                del weights
                group.all_reduce(torch.full((1,), failed, device=device))
            elif isinstance(op, NewCache):
                caches[op.cache_id] = models[op.model_id].new_kv_cache(op.num_blocks, op.block_size).layers
            elif isinstance(op, Forward):
                model = models[op.model_id]
                ids_pos = group.broadcast(torch.empty(2, op.num_tokens, dtype=torch.long, device=device))
                meta = build_attention_metadata([SeqSpan(*s) for s in op.spans], op.block_size, device, model.dtype)
                model(ids_pos[0], ids_pos[1], meta, caches[op.cache_id], op.num_layers)
            elif isinstance(op, ComputeLogits):
                model = models[op.model_id]
                hidden = torch.empty(op.num_rows, model.cfg.hidden_size, dtype=op.dtype, device=device)
                model.compute_logits(group.broadcast(hidden))
