"""The OpenAI-compatible HTTP server: FastAPI routes over an engine-core process.

`verispec serve` builds a `ServerConfig`, and `build_app` turns it into a FastAPI app whose lifespan
starts the core process (one per data-parallel replica) and loads the tokenizer. Every error leaves in the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`; invalid input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.config import EngineConfig
from verispec.entrypoints.openai.early_start import EarlyStart, start_early
from verispec.models.tokenizer_cache import hf_tokenizer
from verispec.entrypoints.openai.admin import add_control_routes
from verispec.entrypoints.openai.limits import BodySizeLimit, ConcurrencyLimit
from verispec.entrypoints.openai.preprocess import PendingWork
from verispec.entrypoints.openai.metrics import ServerMetrics
from verispec.entrypoints.openai.playground import add_playground_routes, playground_config
from verispec.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ErrorResponse, HealthResponse, ModelCard, ModelList, ReplicaHealth, TokenizeRequest,
    TokenizeResponse, TokenizerInfoResponse,
)
from verispec.entrypoints.openai.serving import RequestError, ServingContext, until_disconnect
from verispec.entrypoints.openai.serving_chat import create_chat, prepare_chat, stream_chat
from verispec.entrypoints.openai.serving_completion import (
    create_completion, prepare_completion, prompt_list, stream_completion,
)
from verispec.models.default import DEFAULT_MODEL_FILE

logger = logging.getLogger("verispec.server")


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_n: int = 16
    # Requests admitted but not finished; beyond this the server answers 503 with Retry-After.
    max_pending_requests: int = 256
    # Sequences (prompts x n) admitted but not finished, over all requests: the same 503 beyond
    # it, and a 400 for one request that asks for more on its own.
    max_pending_sequences: int = 1024
    max_request_sequences: int = 256  # prompts x n of one request (400 above)
    # /tokenize and /detokenize without the API key (lm-eval's remote tokenizer sends none).
    open_tokenizer_routes: bool = False
    max_request_bytes: int = 8 << 20
    max_prompt_tokens: int | None = None  # None: the context length less one generated token
    # Engine-core replicas behind this server, each a whole engine (engine/dp_client.py).
    data_parallel_size: int = 1

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = self.engine.model or DEFAULT_MODEL_FILE
        name = Path(path).name
        # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
        return name.split(".")[0] if name.endswith(".gguf") else name


# The error answers a route documents (OpenAPI), in the OpenAI shape.
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 413, 503)}


def _error(status: int, message: str, param: str | None = None, type_: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = RequestError(message, param, status, type_).response_body()
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


def _admit(ctx: ServingContext) -> None:
    if ctx.client.dead:
        raise RequestError(f"the engine is not running: {ctx.client.dead_reason}", status=503,
                           headers={"Retry-After": "30"})


def build_app(config: ServerConfig, early: EarlyStart | None = None) -> FastAPI:
    """The server's app: its lifespan starts the engine core and the tokenizer; routes added by
    kind (errors, /v1, operations, control, playground, tokenizer)."""
    metrics = ServerMetrics(config.model_name())
    pending = PendingWork(config.max_pending_requests, config.max_pending_sequences,
                          min(config.max_request_sequences, config.max_pending_sequences))
    # No trailing-slash redirects: Starlette builds their Location from the client's Host header.
    app = FastAPI(title="verispec", version="0.1.0", lifespan=_lifespan(config, metrics, pending, early),
                  redirect_slashes=False)
    # Outermost first: a request over the pending limit is refused before its body is read.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(ConcurrencyLimit, work=pending)
    _add_error_handlers(app, metrics)
    check_api_key = _api_key_check(config.api_key)
    _add_v1_routes(app, config, check_api_key)
    _add_operation_routes(app, metrics, check_api_key)
    add_control_routes(app, check_api_key, _ctx, _admit)
    add_playground_routes(app, playground_config(config.engine, config.model_name(), config.api_key is not None))
    _add_tokenizer_routes(app, [] if config.open_tokenizer_routes else [Depends(check_api_key)])
    return app


def _lifespan(config: ServerConfig, metrics: ServerMetrics, pending: PendingWork, early: EarlyStart | None):
    """Starts the engine core replicas and loads the tokenizer beside them (or takes those `verispec
    serve` started first); stops both at the end."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from verispec.models.default import default_model_path

        started = early if early is not None else start_early(config.engine, config.data_parallel_size)
        client = started.client
        client.add_stats_listener(metrics.update_engine)
        if client.data_parallel_size > 1:
            metrics.replicas = client.replica_info
        model_path = config.engine.model or default_model_path()
        tokenizer_task = asyncio.wrap_future(started.tokenizer)
        try:
            await client.start()
            tokenizer, encoder = await tokenizer_task
        except BaseException:
            tokenizer_task.cancel()
            await client.shutdown()
            raise
        ready = client.ready
        name = config.model_name()
        app.state.ctx = ServingContext(
            client=client, tokenizer=tokenizer, model_name=name,
            model_aliases=frozenset({name, model_path, config.engine.model or name}), metrics=metrics,
            max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, max_logprobs=ready.max_logprobs,
            max_n=config.max_n,
            max_prompt_tokens=min(config.max_prompt_tokens or ready.max_model_len - 1, ready.max_model_len - 1),
            encoder=encoder, pending=pending,
            grammar_limits=config.engine.grammar_limits, eos_token_ids=frozenset(ready.eos_token_ids),
        )
        metrics.update_engine(client.stats)
        metrics.runtime = ready.runtime
        logger.info("%s", ready.runtime_line)
        # llguidance's tokenizer takes about 0.4 s to build, holding the GIL up to 0.25 s at a time:
        # built before the first request is served, so it never stalls the loop.
        try:
            await asyncio.to_thread(app.state.ctx.grammars.warm)
        except Exception as exc:  # e.g. no EOS token: the first structured request names the problem
            logger.warning("structured output is not ready: %s", exc)
        pids = ", ".join(str(r.ready.pid) for r in client.replicas)
        logger.info("serving %s (engine core pid %s) on http://%s:%d", name, pids, config.host, config.port)
        try:
            yield
        finally:
            app.state.ctx.preprocessor.shutdown()
            await client.shutdown()

    return lifespan


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves in the OpenAI shape, counted by status."""
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        metrics.error(exc.status)
        return _error(exc.status, exc.message, exc.param, exc.type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        metrics.error(400)
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        metrics.error(exc.status_code)
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        metrics.error(500)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


def _api_key_check(api_key: str | None):
    """The dependency that asks for `Authorization: Bearer <api_key>` (nothing when None)."""
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise RequestError("a valid API key is required: send 'Authorization: Bearer <key>'", status=401,
                               type_="AuthenticationError")

    return check_api_key


def _add_v1_routes(app: FastAPI, config: ServerConfig, check_api_key) -> None:
    """/v1/completions, /v1/chat/completions and /v1/models, behind the API key."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    # With "stream": true the answer is server-sent events, not JSON. Before OpenAPI 3.2 (FastAPI
    # writes 3.1) an event stream's `schema` describes one event: its `data` is a JSON chunk or [DONE].
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
    streams = {**_ERRORS, 200: {"content": {"text/event-stream": {"schema": event}}}}

    async def generate(request: Request, body, num_prompts: int, prepare_fn, stream_fn, create_fn):
        """Bounds first (cheap, here), preparation in a worker thread, then the engine."""
        ctx = _ctx(request)
        _admit(ctx)
        ctx.pending.reserve(request.scope, num_prompts * body.n, "n" if body.n > 1 else "prompt")
        prepared = await ctx.preprocessor.run(prepare_fn, ctx, body)
        if body.stream:
            return StreamingResponse(stream_fn(ctx, body, prepared), media_type="text/event-stream")
        return await until_disconnect(request, create_fn(ctx, body, prepared))

    @v1.post("/completions", response_model=CompletionResponse, responses=streams)
    async def completions(body: CompletionRequest, request: Request):
        num_prompts = len(prompt_list(body.prompt))
        return await generate(request, body, num_prompts, prepare_completion, stream_completion, create_completion)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses=streams)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(request, body, 1, prepare_chat, stream_chat, create_chat)

    @v1.get("/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def models(request: Request):
        ctx = _ctx(request)
        return ModelList(data=[ModelCard(id=ctx.model_name, root=str(config.engine.model or ctx.model_name),
                                         max_model_len=ctx.max_model_len)])

    app.include_router(v1)



def _add_operation_routes(app: FastAPI, metrics: ServerMetrics, check_api_key) -> None:
    """/health, /metrics and /reset_prefix_cache."""
    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health(request: Request):
        client = _ctx(request).client
        replicas = None
        if client.data_parallel_size > 1:
            replicas = [ReplicaHealth(dp_rank=r.dp_rank, engine_core_pid=r.pid, alive=r.alive,
                                      num_requests_in_flight=r.in_flight, num_requests_routed=r.routed,
                                      num_prefix_hits=r.prefix_hits, detail=r.dead_reason or None)
                        for r in client.replica_info()]
        if client.dead:
            metrics.core_dead = True
            body = HealthResponse(status="unhealthy", engine_core_pid=client.core_pid, detail=client.dead_reason,
                                  replicas=replicas)
            return JSONResponse(body.model_dump(), status_code=503)
        if replicas and not all(r.alive for r in replicas):
            # Still a 200: the live replicas serve every request; the detail names the dead ones.
            down = [r.dp_rank for r in replicas if not r.alive]
            detail = f"{len(down)} of {len(replicas)} data-parallel replicas down: {client.dead_reason}"
            return HealthResponse(status="degraded", engine_core_pid=client.core_pid, detail=detail,
                                  replicas=replicas)
        return HealthResponse(status="ok", engine_core_pid=client.core_pid, replicas=replicas)

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def prometheus_metrics(request: Request):
        client = _ctx(request).client
        metrics.core_dead = client.dead
        # A replica that died sent no last message: its gauges leave the sum at the scrape.
        metrics.update_engine(client.stats)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", dependencies=[Depends(check_api_key)],
              responses={200: {"content": {"application/json": {}}}, 401: {"model": ErrorResponse},
                         503: {"model": ErrorResponse}})
    async def reset_prefix_cache(request: Request):
        """Forgets every cached prefix: requests sent after this answer hit nothing cached before."""
        ctx = _ctx(request)
        _admit(ctx)
        ctx.client.reset_prefix_cache()
        return Response(status_code=200)



def _add_tokenizer_routes(app: FastAPI, tokenizer_auth: list) -> None:
    """/tokenize, /detokenize and /tokenizer_info (open without the API key when the server says so)."""
    def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
        ctx.check_chars(len(body.prompt), "prompt")
        ids = ctx.encoder.encode([body.prompt], special_tokens=body.parse_special_tokens,
                                 add_special_tokens=body.add_special_tokens)[0]
        if len(ids) > ctx.prompt_token_limit:
            raise RequestError(f"the prompt has {len(ids)} tokens; this server accepts at most "
                               f"{ctx.prompt_token_limit}", "prompt")
        return ids

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS, dependencies=tokenizer_auth)
    async def tokenize(body: TokenizeRequest, request: Request):
        """The prompt's token ids, as /v1/completions would send them (the same limits apply)."""
        ctx = _ctx(request)
        ctx.check_model(body.model)
        if ctx.encoder is None:
            raise RequestError("this model has no tokenizer", "prompt")
        ids = await ctx.preprocessor.run(_tokenize, ctx, body)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=ctx.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS, dependencies=tokenizer_auth)
    async def detokenize(body: DetokenizeRequest, request: Request):
        ctx = _ctx(request)
        ctx.check_model(body.model)
        if len(body.tokens) > ctx.max_model_len:
            raise RequestError(f"tokens holds {len(body.tokens)} ids; at most max_model_len={ctx.max_model_len} "
                               "are accepted", "tokens")
        ctx.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await ctx.preprocessor.run(ctx.detokenize, body.tokens))

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses={404: {"model": ErrorResponse}})
    async def tokenizer_info(request: Request):
        ctx = _ctx(request)
        if ctx.tokenizer is None:
            raise RequestError("this model has no tokenizer", status=404)
        tok = hf_tokenizer(ctx.tokenizer)
        return TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, bos_token=tok.bos_token,
            pad_token=tok.pad_token, chat_template=getattr(tok, "chat_template", None),
            model_max_length=ctx.max_model_len, add_bos_token=getattr(tok, "add_bos_token", None),
        )


def run_server(config: ServerConfig, log_level: str = "info", early: EarlyStart | None = None) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        logger.warning("binding %s without --api-key: anyone who can reach this address can use the model",
                       config.host)
    uvicorn.run(build_app(config, early), host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=5)
