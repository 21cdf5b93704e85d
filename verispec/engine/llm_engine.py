"""LLMEngine: add_request / abort / step(), tying scheduler, runner and output processing together."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from verispec.config import EngineConfig
from verispec.distributed.executor import TensorParallel, build_model, rank_threads
from verispec.distributed.sharding import max_kv_heads_per_rank
from verispec.engine.core_protocol import EngineStats
from verispec.worker.isolation import execute_isolating_failures
from verispec.core.kv_cache import BlockPool, num_kv_blocks
from verispec.engine.output_processor import OutputProcessor
from verispec.core.prefix_cache import PrefixCache
from verispec.worker.runner import ModelRunner
from verispec.core.scheduler import Scheduler
from verispec.engine.scoring import scoring_request
from verispec.engine.startup import RuntimeInfo, StartupLog
from verispec.core.step_types import SchedulerOutput
from verispec.distributed.weight_group import WeightGroupSpec
from verispec.worker.weight_sync import (UpdateWhileRunning, WeightGroupLink, WeightsLike, WeightUpdate, WeightVersion,
                                         WeightVersions, timed_update, update_model_weights)
from verispec.host_memory import keep_freed_memory
from verispec.models.compile import CompileSource, compile_wanted, compiled_step
from verispec.models.cpu_kernels import kernel_build, share_cores
from verispec.models.default import default_model_path
from verispec.models.loader import load_checkpoint, resolve_precision, weight_kinds
from verispec.models.tokenizer_cache import load_tokenizer
from verispec.outputs import RequestOutput
from verispec.core.request import Request, RequestStatus
from verispec.sample.grammar import GrammarCompiler, StructuredOutputs
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams, is_valid_text
from verispec.spec_decode.metrics import SpecDecodeMetrics
from verispec.spec_decode.registry import make_draft_policy
from verispec.tokenization import bad_word_ids

logger = logging.getLogger("verispec")


@dataclass(slots=True)
class _Parent:
    """A user request; with n > 1 it fans out into n engine requests (children)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)
    error: str | None = None  # set when the request raised inside the engine
    error_kind: str = "internal"  # or "invalid": the client's input failed (a grammar past its limits)
    weight_version: WeightVersion = 0  # the weights it is generated under, start to finish


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        model_path = config.model or default_model_path()
        self.model_path = model_path
        config.dtype, config.quantization = resolve_precision(model_path, config.dtype, config.quantization)
        # Tensor parallelism: this process is rank 0; the workers start (or are found) here.
        self.tp = TensorParallel(config, model_path) if config.tensor_parallel_size > 1 else None
        if config.device.type == "cpu":
            keep_freed_memory()
        self._threads_before = torch.get_num_threads()  # rank 0 shares the cores with its workers until shutdown
        torch.set_num_threads(rank_threads(config))  # not more than the process's cores (cores.py)
        self.startup = StartupLog()
        # Start-up work that waits on subprocesses or files runs beside the checkpoint read: the
        # kernels' compiler (once per machine) and the tokenizer (read from the GGUF file once).
        background = ThreadPoolExecutor(2, thread_name_prefix="verispec-start")
        kernels = background.submit(kernel_build, wait=False) if config.device.type == "cpu" else None
        self._tokenizer = background.submit(load_tokenizer, model_path)
        background.shutdown(wait=False)
        try:
            with self.startup.phase("checkpoint"):
                model_cfg, weights = load_checkpoint(model_path, config.dtype, config.quantization)
                model_cfg.rope_context = config.max_model_len or model_cfg.max_position_embeddings  # LongRoPE's pick
                self.model_config, self.weight_kinds = model_cfg, weight_kinds(weights)
            if kernels is not None:
                with self.startup.phase("kernels"):  # what the build needs past the checkpoint read
                    kernels.result()
                share_cores(start=True)  # the cores left to this engine, here and at each step (cores.py)
            with self.startup.phase("model"):
                if self.tp is not None:
                    self.tp.connect(model_cfg)
                self.model = build_model(model_cfg, weights, model_path, config.dtype, config.quantization,
                                         config.device, self.tp)
                del weights
            self._build(config, model_path, model_cfg)
        except BaseException:
            self.shutdown()  # the workers must not outlive an engine that failed to start
            raise

    def _build(self, config: EngineConfig, model_path, model_cfg) -> None:
        """Everything around the model: tokenizer, pool, prefix cache, drafter, scheduler, runner."""
        if self.tp is None and compile_wanted(config.enforce_eager, config.device):
            self.model.compiled = compiled_step(self.model, CompileSource(str(model_path), str(config.dtype)[6:],
                config.quantization, model_cfg.rope_context, config.block_size), config.compile_missing)
        with self.startup.phase("tokenizer"):
            self.tokenizer = self._tokenizer.result()
        limit = model_cfg.max_position_embeddings
        if config.max_model_len is None:
            config.max_model_len = limit
        elif config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length ({limit})")
        self.max_model_len = config.max_model_len
        self.vocab_size = model_cfg.vocab_size
        eos = set(model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

        # Under tensor parallelism each rank holds its KV heads' share of every block.
        heads = max_kv_heads_per_rank(model_cfg, self.tp.size) if self.tp is not None else None
        self.pool = BlockPool(num_kv_blocks(config, model_cfg, heads), config.block_size)
        spec = config.speculative
        # Everything engine-wide that changes the KV; the cache lives in this engine only, but a
        # key that names the weights and the tier keeps a hash meaningful on its own.
        engine_key = f"{model_path}|{config.dtype}|{config.quantization}|{spec.method if spec else None}"
        self.prefix_cache = PrefixCache(self.pool, engine_key, config.enable_prefix_caching,
                                        config.prompt_logprobs_cache_bytes)
        # The scheduler's draft policy decides every step's drafts (spec_decode/policy.py).
        self.drafts = make_draft_policy(config, self.model, self.tokenizer, self.tp) if spec else None
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.drafts,
                                   self.prefix_cache)
        # Model drafters draft inside the step, before the verify forward; the others after it.
        drafter = self.drafts.drafter if self.drafts is not None else None
        self.runner = ModelRunner(self.model, config, self.pool,
                                  drafter=drafter if drafter is not None and drafter.drafts_in_step else None)
        if self.model.compiled is not None:  # eager steps answer while the graphs build
            self.model.compiled.start()
        self.runtime = RuntimeInfo.of(config.dtype, config.quantization, config.device, self.model.compiled is not None,
                                      self.weight_kinds)
        logger.info("%s", self.runtime.line())
        logger.info("%s", self.startup.summary())
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.structured = StructuredOutputs(GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                            config.grammar_limits))
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}
        self.num_steps = 0
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self.weight_versions, self.weight_link = WeightVersions(), WeightGroupLink()

    @property
    def spec_metrics(self) -> SpecDecodeMetrics:
        return self.drafts.metrics if self.drafts is not None else SpecDecodeMetrics(0)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        if not is_valid_text(prompt):
            raise ValueError("prompt must be valid Unicode text (it holds a lone surrogate)")
        return self.tokenizer.encode(prompt)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        group: str | None = None, completion: list[int] | None = None,
    ) -> None:
        """`group`: the client request this one belongs to (default: itself); the scheduler shares
        the running slots fairly between groups. Every child (n > 1) is in the same group.
        `completion`: score these tokens after the prompt under `params` (engine/scoring.py)."""
        params = SamplingParams() if params is None else params  # frozen, validated when made
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        scored = None
        if completion is not None:
            params, scored = scoring_request(params, ids, completion, self.vocab_size)
            ids = ids + list(completion)
        self._check_prompt(ids)
        params.check_against_model(self.vocab_size, self.config.max_logprobs)
        max_tokens = self._max_tokens(ids, params)
        bad_words = bad_word_ids(self.tokenizer, params.bad_words)
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        mode = params.logprobs_mode or self.config.logprobs_mode
        # Compiled (and checked) before any child is queued: a bad grammar refuses the whole request.
        grammars = self.structured.matchers(params.structured_outputs, params.n)
        parent = _Parent(request_id, text, ids, weight_version=self.weight_versions.current)
        base_seed = params.seed
        if base_seed is None:
            base_seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        wants_logprobs = params.logprobs is not None or params.logprob_token_ids is not None
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=child_id,
                prompt=text,
                prompt_token_ids=ids,
                params=params,
                logprobs_mode=mode,
                noise=RequestNoise(base_seed if i == 0 else f"{base_seed}:{i}"),
                stop_ids=stop_ids,
                max_tokens=max_tokens,
                bad_words_token_ids=bad_words,
                keeps_logprobs=wants_logprobs,
                # Every child shares the prompt: only the first one scores it.
                scores_prompt=params.prompt_logprobs is not None and i == 0,
                # The others wait for the first to cache the prompt, then hit it.
                prefill_leader=parent.children[0] if i > 0 else None,
                grammar=grammars[i],
                group=group or request_id,
                scored=scored,
            )
            parent.children.append(req)
            self._child_parent[child_id] = request_id
            self.output.add(req)
            self.scheduler.add(req)
        self._parents[request_id] = parent

    def _max_tokens(self, ids: list[int], params: SamplingParams) -> int:
        """The request's output limit; a ValueError when prompt and output can never fit the pool."""
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if not self.pool.can_ever_fit(len(ids) + max_tokens):
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) needs "
                f"{self.pool.blocks_needed(len(ids) + max_tokens)} KV blocks but the pool has "
                f"{self.pool.num_blocks}; lower max_tokens or raise num_kv_blocks / kv_cache_bytes"
            )
        return max_tokens

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                             "the prompt must leave room for at least one generated token")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request; returns its last output (finish_reason "abort"), None for an unknown id."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for req in parent.children:
            if not req.is_finished:
                req.status = RequestStatus.FINISHED_ABORTED
            self.scheduler.finish(req)
        return self._parent_output(request_id)  # finished: the parent is forgotten

    def check_workers(self) -> None:
        """Raises WorkerDiedError if a tensor-parallel worker this engine started has exited."""
        if self.tp is not None:
            self.tp.check()

    def wait_for_compiled_step(self, timeout: float | None = None) -> bool:
        """Until the background compile ends (benchmarks, tests); whether the step now runs compiled."""
        return self.model.compiled is not None and self.model.compiled.wait(timeout)

    def shutdown(self) -> None:
        if (compiled := getattr(getattr(self, "model", None), "compiled", None)) is not None:  # a failed start: none
            compiled.stop()
        if self.tp is not None:
            self.tp.shutdown()
            torch.set_num_threads(self._threads_before)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (and its prompt rows); running requests keep their blocks."""
        self.prefix_cache.reset()

    def update_weights(self, weights: WeightsLike, weight_version: WeightVersion | None = None) -> WeightUpdate:
        """New weights in place (worker/weight_sync.py), then an empty prefix cache; only while no
        request is unfinished: each request runs under one weight version."""
        if (busy := self._busy()) is not None:
            raise busy
        done = timed_update(lambda: update_model_weights(self.model, self.tp, weights), self.weight_versions,
                            weight_version)
        self.prefix_cache.reset()
        return done

    def init_weights_update_group(self, spec: WeightGroupSpec) -> None:
        """Joins a trainer's process group (every tensor-parallel rank does); blocks until all have."""
        self.weight_link.join(spec, self.tp, self.config.device)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: WeightVersion | None = None) -> WeightUpdate:
        """update_weights with tensors the trainer broadcasts in the group, in this order."""
        busy = self._busy()
        done = timed_update(lambda: self.weight_link.receive(self.model, self.tp, names, dtypes, shapes, busy,
                                                             self.config.device), self.weight_versions, weight_version)
        self.prefix_cache.reset()
        return done

    def _busy(self) -> UpdateWhileRunning | None:
        if not self.scheduler.has_unfinished():
            return None
        return UpdateWhileRunning(f"{len(self._parents)} request(s) unfinished: pause generation (abort or wait) "
                                  "before updating the weights")

    def request_ids(self) -> list[str]:
        """The user-level ids of every request still held by the engine."""
        return list(self._parents)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.num_steps += 1
        result, failed = execute_isolating_failures(self.runner, sched)
        errored = self._fail_requests(sched, failed)
        emitted = self.output.process_step(sched, result, skip=errored, step=self.num_steps)
        for req, error in self.structured.follow(emitted):  # a grammar that refused a token fails its request now
            logger.warning("request %s failed: %s", req.request_id, error)
            self._fail(req, error, "invalid")
            errored.add(req.request_id)
        # The step's real cost (drafting the next one included) is a measure unless a request failed.
        self.scheduler.update_from_output(sched, result, skip=errored, started=None if failed else start)
        changed = errored | {r.request_id for r in emitted}
        parents = [self._child_parent[s.request.request_id] for s in sched.scheduled if s.request.request_id in changed]
        return [self._parent_output(pid) for pid in dict.fromkeys(parents)]

    def _fail_requests(self, sched: SchedulerOutput, failed: dict[str, tuple[str, str]]) -> set[str]:
        """Fails each request that raised, with its siblings (n > 1); returns the ids of every
        scheduled request that must not take this step's results."""
        for s in sched.scheduled:
            if s.request.request_id in failed:
                self._fail(s.request, *failed[s.request.request_id])
        return {s.request.request_id for s in sched.scheduled
                if self._parents[self._child_parent[s.request.request_id]].error is not None}

    def _fail(self, req: Request, message: str, kind: str = "internal") -> None:
        """A request that raised inside the engine: it and its siblings (n > 1) finish with an error."""
        parent = self._parents[self._child_parent[req.request_id]]
        parent.error, parent.error_kind = message, kind
        for child in parent.children:
            if not child.is_finished:
                child.status = RequestStatus.FINISHED_ABORTED
            self.scheduler.finish(child)

    def _parent_output(self, parent_id: str) -> RequestOutput:
        parent = self._parents[parent_id]
        outputs = [self.output.completion(req, i) for i, req in enumerate(parent.children)]
        finished = all(req.is_finished for req in parent.children)
        prompt_logprobs = self.output.state(parent.children[0]).prompt_logprobs
        if finished:
            del self._parents[parent_id]
            for req in parent.children:
                self._child_parent.pop(req.request_id, None)
                self.output.forget(req.request_id)
        return RequestOutput(
            request_id=parent_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            error=parent.error,
            error_kind=parent.error_kind if parent.error is not None else None,
            weight_version=parent.weight_version,
        )

    def engine_stats(self) -> EngineStats:
        """The engine's counters and gauges, the one place they are gathered."""
        m, cache, drafts = self.spec_metrics, self.prefix_cache, self.drafts
        adaptive = drafts.adaptive.stats if drafts is not None and drafts.adaptive else None
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_drafts=m.num_drafts,
            num_draft_tokens=m.num_draft_tokens,
            num_accepted_tokens=m.num_accepted_tokens,
            accepted_per_position=list(m.accepted_per_position),
            adaptive_steps=adaptive.num_steps if adaptive else 0,
            adaptive_budget_tokens=adaptive.budget_total if adaptive else 0,
            adaptive_drafted_tokens=adaptive.drafted_total if adaptive else 0,
            adaptive_admitted_tokens=adaptive.admitted_total if adaptive else 0,
            adaptive_drafting_steps=adaptive.drafting_steps if adaptive else 0,
            adaptive_probes=adaptive.probes if adaptive else 0,
            adaptive_capacity_histogram=list(adaptive.capacity_histogram) if adaptive else [],
            adaptive_calibration=[list(t) for t in adaptive.calibration] if adaptive else [],
            prefix_cache_queries=cache.num_queries,
            prefix_cache_hits=cache.num_hits,
            prefix_cache_prompt_rows_hits=cache.num_prompt_rows_hit,
            prefix_cache_blocks=self.pool.num_cached_blocks,
            prefix_cache_prompt_rows_bytes=cache.rows.num_bytes,
            weight_version=self.weight_versions.current,
            num_weight_updates=self.weight_versions.num_updates,
        )

    def stats(self) -> dict:
        return self.engine_stats().as_dict()
