"""Routes that change what the server serves, for RL trainers (behind `--api-key` when set), in
SGLang's shapes: `POST /pause_generation` (mode `abort`, `wait` or `keep`), `POST
/continue_generation`, `POST /update_weights_from_disk` (a safetensors file or directory), and a
trainer's process group: `POST /init_weights_update_group`, `POST /update_weights_from_distributed`.
The engine core does the work (engine/pause.py); a refusal because of the engine's state is a
409, one because of the input a 400, both in the OpenAI error shape."""

from __future__ import annotations

from typing import Literal

from fastapi import Depends, FastAPI, Request

from verispec.engine.core_protocol import ControlReply
from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.protocol import ErrorResponse, _Model, _Request


class PauseGenerationRequest(_Request):
    mode: Literal["abort", "wait", "keep"] = "abort"


class UpdateWeightsFromDiskRequest(_Request):
    model_path: str  # a safetensors file, or a directory of them, readable by the server
    weight_version: int | str | None = None  # default: the number of updates so far


class InitWeightsUpdateGroupRequest(_Request):
    master_address: str
    master_port: int
    rank_offset: int  # the engine's first rank in the group (the trainer is rank 0)
    world_size: int
    group_name: str = "weights"
    backend: Literal["gloo", "nccl"] | None = None  # None: gloo on a CPU, nccl on CUDA


class UpdateWeightsFromDistributedRequest(_Request):
    names: list[str]  # the checkpoint's (HF) names, in the order the trainer broadcasts them
    dtypes: list[str]  # "float32", "bfloat16" or "float16", one per name
    shapes: list[list[int]]
    weight_version: int | str | None = None


class ControlResponse(_Model):
    success: bool
    message: str
    mode: str | None = None  # pause: the mode now in force
    num_aborted: int | None = None  # pause: requests finished with finish_reason "abort"
    num_kept: int | None = None  # pause: requests held (mode keep)
    num_joined: int | None = None  # continue: requests that arrived while paused and start now
    weight_version: int | str | None = None  # update: the version every later output carries
    num_tensors: int | None = None
    seconds: float | None = None


def add_control_routes(app: FastAPI, check_api_key, serving_context, admit) -> None:
    """`serving_context(request)` gives the ServingContext; `admit(ctx)` refuses when the engine is down."""
    auth = [Depends(check_api_key)]
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 409, 503)}

    @app.post("/pause_generation", response_model=ControlResponse, responses=errors, dependencies=auth)
    async def pause_generation(request: Request, body: PauseGenerationRequest | None = None):
        """Stops generating: `abort` ends unfinished requests now, `wait` answers once they
        finish, `keep` holds them. New requests wait until /continue_generation."""
        ctx = serving_context(request)
        admit(ctx)
        return _answer(await ctx.client.pause_generation((body or PauseGenerationRequest()).mode), "mode")

    @app.post("/continue_generation", response_model=ControlResponse, responses=errors, dependencies=auth)
    async def continue_generation(request: Request):
        ctx = serving_context(request)
        admit(ctx)
        return _answer(await ctx.client.continue_generation(), None)

    @app.post("/update_weights_from_disk", response_model=ControlResponse, responses=errors, dependencies=auth)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, request: Request):
        """New weights in place from the server's disk (LLM.update_weights); refused (409) while
        requests are unfinished: pause with mode abort or wait first."""
        ctx = serving_context(request)
        admit(ctx)
        return _answer(await ctx.client.update_weights_from_disk(body.model_path, body.weight_version), "model_path")

    @app.post("/init_weights_update_group", response_model=ControlResponse, responses=errors, dependencies=auth)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest, request: Request):
        """Joins the trainer's torch.distributed group; answers once every rank has joined."""
        ctx = serving_context(request)
        admit(ctx)
        return _answer(await ctx.client.init_weights_update_group(**body.model_dump()), None)

    @app.post("/update_weights_from_distributed", response_model=ControlResponse, responses=errors, dependencies=auth)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest, request: Request):
        """Receives the tensors the trainer broadcasts in the group, then writes them (409 while
        requests are unfinished, after receiving: the trainer's broadcast always completes)."""
        ctx = serving_context(request)
        admit(ctx)
        reply = await ctx.client.update_weights_from_distributed(body.names, body.dtypes, body.shapes,
                                                                 body.weight_version)
        return _answer(reply, "names")


def _answer(reply: ControlReply, param: str | None) -> ControlResponse:
    if not reply.ok:
        if reply.error_kind == "conflict":
            raise RequestError(reply.message, None, 409, "ConflictError")
        raise RequestError(reply.message, param)
    return ControlResponse(success=True, message=reply.message, **reply.result)
