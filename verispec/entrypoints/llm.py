"""LLM: the offline, in-process API, shaped like vLLM's."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from verispec.config import EngineConfig
from verispec.distributed.weight_group import WeightGroupSpec
from verispec.engine.llm_engine import LLMEngine
from verispec.worker.weight_sync import WeightsLike, WeightUpdate, WeightVersion
from verispec.entrypoints.chat_utils import chat_prompt_ids
from verispec.engine.scoring import score_output
from verispec.outputs import RequestOutput, ScoreOutput
from verispec.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **options: Any):
        """`model`: an HF checkpoint directory or a .gguf file (default: the bundled model).
        `options`: the engine's options (`verispec.config.EngineConfig`, the fields made with
        `_option`; `verispec serve --help` lists them with their defaults): dtype, quantization,
        device, max_model_len, max_num_seqs, speculative_config, ... An unknown one is a
        ValueError naming it."""
        config = EngineConfig.create(model=model, **options)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        """transformers' tokenizer of the model (the engine itself encodes without it where it can)."""
        from verispec.models.tokenizer_cache import hf_tokenizer

        return hf_tokenizer(self.engine.tokenizer)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix, as after a weight update."""
        self.engine.reset_prefix_cache()

    def update_weights(self, weights: WeightsLike, weight_version: WeightVersion | None = None) -> WeightUpdate:
        """Takes new weights in place, between calls to `generate`: `weights` is a safetensors file
        or directory, a mapping or an iterable of (name, tensor) in the checkpoint's own (HF) names,
        any subset of the model's tensors. Quantized tiers re-quantize them as they were loaded. A
        wrong name, shape or dtype is a ValueError naming the tensor, and nothing changes. Every
        later output carries `weight_version` (default: the number of updates so far); the prefix
        cache is emptied. No recompilation, no kernel rebuild (docs/rl.md)."""
        return self.engine.update_weights(weights, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weights", backend: str | None = None) -> None:
        """Joins a trainer's torch.distributed group (the trainer is rank 0; this engine's
        tensor-parallel ranks are rank_offset, rank_offset + 1, ...), as SGLang's route does.
        Blocks until every rank has joined (docs/rl.md)."""
        spec = WeightGroupSpec(master_address, master_port, rank_offset, world_size, group_name, backend)
        self.engine.init_weights_update_group(spec)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: WeightVersion | None = None) -> WeightUpdate:
        """`update_weights` with the tensors the trainer broadcasts in the group, in this order
        (`verispec.distributed.weight_group.broadcast_weights`): every announced tensor is received,
        then checked and written all or nothing."""
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, weight_version)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = self._normalize_prompts(prompts)
        return self._run(self._add(prompt_list, self._params_list(sampling_params, len(prompt_list))), use_tqdm)

    def score(
        self,
        prompts: PromptType | Sequence[PromptType],
        completions: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoreOutput]:
        """Teacher-forced logprobs: for each prompt and completion (token ids, as a rollout
        returned them), every completion token's logprob dict under `sampling_params`, the
        parameters that produced it (logprobs mode, temperature, top-k/p, penalties, ...;
        `logprobs` is the top-k width). Bit for bit the rollout's values in the batch-invariant
        tiers (docs/rl.md). prompt + completion must be shorter than max_model_len."""
        prompt_list = self._normalize_prompts(prompts)
        completion_list = [list(c) for c in completions]
        if len(completion_list) != len(prompt_list):
            raise ValueError(f"completions has {len(completion_list)} entries but there are {len(prompt_list)} prompts")
        params_list = self._params_list(sampling_params, len(prompt_list))
        outs = self._run(self._add(prompt_list, params_list, completion_list), use_tqdm)
        return [score_output(out, len(out.prompt_token_ids) - len(c)) for out, c in zip(outs, completion_list)]

    @staticmethod
    def _params_list(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(f"sampling_params has {len(params_list)} entries but there are {count} prompts")
        return params_list

    def _add(self, prompts: list, params_list: list[SamplingParams], completions: list | None = None) -> list[str]:
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params, completion=completions[i] if completions else None)
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt leaves no half-added batch behind
                self.engine.abort_request(rid)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    @staticmethod
    def _normalize_prompts(prompts) -> list[str | list[int]]:
        def one(p):
            if isinstance(p, str):
                return p
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    return list(p["prompt_token_ids"])
                if "prompt" in p:
                    return p["prompt"]
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            if isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return list(p)
            raise ValueError(f"prompts must be strings or lists of token ids; got {type(p).__name__}")

        if isinstance(prompts, (str, dict)):
            return [one(prompts)]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
                return [list(prompts)]  # one tokenized prompt
            return [one(p) for p in prompts]
        raise ValueError(f"prompts must be a string, a list of strings or token-id lists; got {type(prompts).__name__}")

    # ------------------------------------------------------------------ chat
    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": chat_prompt_ids(self.engine.tokenizer, conv, add_generation_prompt, chat_template)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
