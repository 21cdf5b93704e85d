"""A tensor-parallel worker rank: its model shards, its share of the KV pool, and the ops rank 0
sends (verispec/distributed/executor.py), until Shutdown or until rank 0 is gone.

Started by rank 0's engine on one machine (`python -m verispec.distributed.worker ...`), or as
rank > 0 of a `torchrun` launch of any `verispec` command (verispec/entrypoints/cli.py).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import traceback

import torch

from verispec.distributed.comm import Rendezvous, TPGroup
from verispec.distributed.executor import (ComputeLogits, Forward, JoinWeightGroup, LoadModel, NewCache, Shutdown,
                                           UpdateFromWeightGroup, UpdateWeights, checked_update, load_shard,
                                           rank_device, update_shard)
from verispec.distributed.weight_group import join_weight_group, receive_weights
from verispec.host_memory import keep_freed_memory
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.llama import LlamaModel
from verispec.models.loader import load_checkpoint

logger = logging.getLogger("verispec.tp")


def run_worker(rv: Rendezvous, device: torch.device, num_threads: int, preload: tuple | None = None) -> None:
    """preload: (path, dtype, quantization) of the model rank 0 is about to load, read while rank 0
    reads its own copy; used when the first LoadModel names it."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rv.rank} %(levelname)s %(message)s")
    torch.set_num_threads(num_threads)
    device = rank_device(device, rv.rank)
    if device.type == "cpu":
        keep_freed_memory()
    early = None
    if preload is not None:
        try:
            early = (preload, load_checkpoint(*preload))
        except Exception:  # noqa: BLE001 - rank 0 meets the same error and reports it
            logger.warning("preloading %s failed; rank 0 reports why", preload[0])
    worker = _Worker(rv.rank, TPGroup(rv, device), device, early)
    with torch.inference_mode():
        while True:
            try:
                op = worker.group.recv_op()
            except RuntimeError:  # the control group's connection closed: rank 0 is gone
                logger.info("rank 0 is gone; worker %d exits", rv.rank)
                return
            if isinstance(op, Shutdown):
                return
            worker.handle(op)


class _Worker:
    """One rank's state: its model shards (by rank 0's model id), caches, and a trainer's group."""

    def __init__(self, rank: int, group: TPGroup, device: torch.device, early):
        self.rank, self.group, self.device, self.early = rank, group, device, early
        self.models: dict[int, LlamaModel] = {}
        self.configs: dict[int, object] = {}  # each model's whole config (a shard's is its own part)
        self.caches: dict[int, list] = {}
        self.weight_group = None  # a trainer's group (weight_group.py), once joined

    def handle(self, op) -> None:
        group, device = self.group, self.device
        if isinstance(op, LoadModel):
            self.load(op)
        elif isinstance(op, NewCache):
            self.caches[op.cache_id] = self.models[op.model_id].new_kv_cache(op.num_blocks, op.block_size).layers
        elif isinstance(op, Forward):
            model = self.models[op.model_id]
            ids_pos = group.broadcast(torch.empty(2, op.num_tokens, dtype=torch.long, device=device))
            meta = build_attention_metadata([SeqSpan(*s) for s in op.spans], op.block_size, device, model.dtype)
            model(ids_pos[0], ids_pos[1], meta, self.caches[op.cache_id], op.num_layers)
        elif isinstance(op, ComputeLogits):
            model = self.models[op.model_id]
            hidden = torch.empty(op.num_rows, model.cfg.hidden_size, dtype=op.dtype, device=device)
            model.compute_logits(group.broadcast(hidden))
        elif isinstance(op, UpdateWeights):
            values = {n: group.broadcast(torch.empty(shape, dtype=torch.float32, device=device))
                      for n, shape in op.tensors}
            if (error := update_shard(group, self.configs[op.model_id], self.models[op.model_id], values)) is not None:
                logger.warning("weight update not applied: %s", error)
        elif isinstance(op, JoinWeightGroup):
            self.weight_group = join_weight_group(op.spec, self.rank, device)
        elif isinstance(op, UpdateFromWeightGroup):
            named = receive_weights(self.weight_group, op.names, op.dtypes, op.shapes, device)
            refusal = ValueError("rank 0 refused the update") if op.refused else None
            update, error = checked_update(named, self.configs[op.model_id], refusal)
            if update_shard(group, self.configs[op.model_id], self.models[op.model_id], update, error) is not None:
                logger.warning("weight update from the trainer's group not applied")

    def load(self, op: LoadModel) -> None:
        failed = 0.0
        try:
            key = (op.path, op.dtype, op.quantization)
            early, self.early = self.early, None
            cfg, weights = early[1] if early is not None and early[0] == key else load_checkpoint(*key)
            cfg.rope_context = op.rope_context
            self.models[op.model_id] = load_shard(self.group, cfg, weights, op.dtype, self.device)
            self.configs[op.model_id] = cfg
            del weights
        except Exception:  # noqa: BLE001 - counted in the all-reduce below; rank 0 raises
            logger.error("loading %s failed:\n%s", op.path, traceback.format_exc())
            failed = 1.0
        self.group.all_reduce(torch.full((1,), failed, device=self.device))


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the engine that started it exits, however it exits."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the call
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verispec.distributed.worker")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--preload", nargs=2, metavar=("PATH", "DTYPE"), default=None)
    p.add_argument("--quantization", default=None, help="the preloaded model's (default: none, dense)")
    args = p.parse_args(argv)
    _die_with_parent()
    preload = None
    if args.preload:
        path, dtype = args.preload
        preload = (path, getattr(torch, dtype), args.quantization)
    run_worker(Rendezvous(args.host, args.port, args.rank, args.size), torch.device(args.device), args.threads, preload)


if __name__ == "__main__":
    main()
