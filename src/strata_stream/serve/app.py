"""The FastAPI application: the OpenAI routes, the Anthropic Messages route (serve/anthropic.py),
/health and /metrics over one GenerationWorker."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    MutableMapping,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata_stream.engine_stats import StatsSource
from strata_stream.errors import ConfigError
from strata_stream.serve import anthropic
from strata_stream.serve.config import ServeConfig
from strata_stream.serve.errors import (
    APIError,
    bad_request,
    context_exceeded,
    model_not_found,
    queue_full,
    server_error,
)
from strata_stream.serve.generation import GenerationRequest, SamplingParams
from strata_stream.serve.health import PackProbe, pack_probe
from strata_stream.serve.jobs import Event, Finished, Job, Logprobs, TextChunk, TokenLogprob
from strata_stream.serve.lockstep import RequestChannel
from strata_stream.serve.mailbox import Mailbox
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.requests import (
    MAX_PROMPTS,
    MAX_STOPS,
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
    load_body,
    validate_body,
)
from strata_stream.serve.tokenizing import OwnTokenizer, max_prompt_chars
from strata_stream.serve.tool_calls import (
    Piece,
    TemplateSplitter,
    ToolCall,
    ToolCallSplitter,
    splitter,
    tool_syntax,
)
from strata_stream.serve.worker import GenerationWorker, QueueFullError, WorkerStoppedError

log = logging.getLogger("strata_stream.serve")

# Request bodies beyond this are refused (413) before they are held in memory.
MAX_BODY_BYTES = 16 * 2**20
# /health waits this long for its read of the pack (serve/health.py) before it says "degraded".
PROBE_TIMEOUT_S = 5.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


def create_app(
    model: Any,
    tokenizer: Any,
    config: ServeConfig,
    *,
    stats: StatsSource | None = None,
    lockstep: RequestChannel | None = None,
    engine: str | None = None,
) -> FastAPI:
    """An app serving `model` (the worker thread is its only user) and `tokenizer` (a
    TokenizerWrapper or a Hugging Face tokenizer). `stats` feeds the engine metrics (schema in
    engine_stats.py). The worker starts and stops with the app's lifespan.
    `engine`: "mlx-lm" (an mlx-lm model, batched) or "transformers" (a transformers
    PreTrainedModel, streamed or plain, batched on serve/transformers_continuous.py); None
    takes "transformers" for a torch module, else "mlx-lm".
    `lockstep`: rank 0 of a sharded model, whose followers run every request too
    (serve/lockstep.py; mlx-lm only)."""
    engine = engine or ("transformers" if _is_torch_module(model) else "mlx-lm")
    max_batch = config.max_batch
    if engine == "transformers":
        from strata_stream.serve.hf_tokenizer import HFTokenizer, model_eos_ids

        if lockstep is not None:
            raise ConfigError("lockstep serving (--pipeline/--tensor) is for mlx-lm models")
        if not isinstance(tokenizer, HFTokenizer):
            tokenizer = HFTokenizer(tokenizer, model_eos_ids(model))
    elif engine == "mlx-lm":
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
    else:
        raise ConfigError(f"engine must be mlx-lm or transformers, got {engine!r}")
    metrics = ServerMetrics()
    worker = GenerationWorker(
        model,
        tokenizer,
        max_queue=config.max_queue,
        metrics=metrics,
        max_batch=max_batch,
        prefill_chunk=config.prefill_chunk,
        stats=stats,
        stats_interval_s=config.stats_interval_s,
        lockstep=lockstep,
        engine=engine,
    )
    if lockstep is None:  # a sharded model's ranks keep no prompt cache (batch.py)
        worker.configure_prompt_cache(config.prompt_cache)
    routes = _Routes(model, tokenizer, config, worker, pack_probe(model))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)

    app = FastAPI(title="strata-stream", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.drain_s = config.drain_s

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        err = APIError(e.status_code, str(e.detail), code=code)
        return _error_response(request, err, e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _error_response(request, server_error(f"internal error: {type(e).__name__}"))

    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"])
    app.add_middleware(_CountRequests, metrics=metrics)
    return app


class _CountRequests:
    """Counts every answered request by route template and status (pure ASGI, so streamed
    responses pass through untouched and their disconnects still reach the route)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, str(status)).inc()


def _error_response(
    request: Request, e: APIError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """`e` in the shape of the API the path belongs to: Anthropic's under /v1/messages, else
    OpenAI's."""
    if request.url.path.startswith("/v1/messages"):
        body, status = anthropic.error_body(e), anthropic.error_status(e)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _is_torch_module(model: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a torch model imported it already
    return torch is not None and isinstance(model, torch.nn.Module)


def _model_field(model: Any, name: str) -> int | None:
    """A positive integer the model's config names: mlx-lm's `model.args`, transformers'
    `model.config`."""
    for holder in ("args", "config"):
        n = getattr(getattr(model, holder, None), name, None)
        if isinstance(n, int) and n > 0:
            return int(n)
    return None


def _context_length(model: Any, config: ServeConfig) -> int | None:
    if config.context_length is not None:
        return config.context_length
    return _model_field(model, "max_position_embeddings")


def _vocab_size(model: Any) -> int | None:
    return _model_field(model, "vocab_size")


class _Routes:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: ServeConfig,
        worker: GenerationWorker,
        probe: PackProbe | None = None,
    ) -> None:
        self._config = config
        self._worker = worker
        self._probe = probe
        self._context = _context_length(model, config)
        self._vocab = _vocab_size(model)
        # The handler threads encode and decode prompts with a copy of their own, never the
        # tokenizer the worker detokenizes with (serve/tokenizing.py); the event loop renders
        # log-probability entries' tokens with the worker's, under its lock, never waiting for
        # a long encode.
        self._tokenizer = tokenizer
        self._tokenizers = OwnTokenizer(tokenizer)
        self._max_chars = max_prompt_chars(self._context, tokenizer)
        self._created = int(time.time())
        # The served model's tool-call format (serve/tool_calls.py); None: requests with
        # tools are refused, as the template would not tell the model how to call them.
        self._tool_syntax = tool_syntax(tokenizer)
        self._mailbox: Mailbox[Event] | None = None  # the event loop's; set on it

    # ---- plain routes ------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        """Can a generation succeed now? "ok" (200) while the worker runs, the pack reads
        (serve/health.py: a few bytes, read now) and the engine's last error, if any, was
        followed by a generation that succeeded; "degraded" (503) when the pack cannot be
        read or the engine's last generation failed; "unavailable" (503) without a worker.
        A client's mistake (4xx) is refused before it runs and never counts."""
        alive = self._worker.alive
        errors = self._worker.errors
        pack_error = None if self._probe is None else await _probe(self._probe)
        ok = alive and pack_error is None and not errors.failing
        body = {
            "status": "ok" if ok else "degraded" if alive else "unavailable",
            "model": self._config.model_id,
            "queue_depth": self._worker.queue_depth,
            "queue_capacity": self._worker.max_queue,
            "batch": self._worker.in_flight,
            "max_batch": self._worker.max_batch,
            "pack": None
            if self._probe is None
            else {"path": str(self._probe.path), "error": pack_error},
            "errors": {
                "count": errors.count,
                "failing": errors.failing,
                "last": errors.last,
                "seconds_ago": None
                if not errors.count
                else round(time.perf_counter() - errors.last_at, 3),
            },
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self._config.model_id,
            "object": "model",
            "created": self._created,
            "owned_by": "strata-stream",
        }

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> JSONResponse:
        self._check_model(model_id)
        return JSONResponse(self._model_card())

    def _check_model(self, model: str) -> None:
        if model != self._config.model_id:
            raise model_not_found(model)

    # ---- generation routes -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        raw = await _read_body(request)
        req = await run_in_threadpool(self._parse, CompletionRequest, raw)
        gens: list[GenerationRequest] = []
        texts: list[str | None] = []  # each prompt as text, for echo (None: decode the ids)
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids = await run_in_threadpool(self._encode, prompt)
                texts.append(prompt)
            else:
                ids = prompt
                self._check_ids(ids)
                texts.append(None)
            gens.append(self._generation(req.token_budget(), ids, _sampling(req), req.stops(),
                                         param="prompt", logprobs=req.logprobs,
                                         echo=req.echo))  # fmt: skip
        fmt = _CompletionFormat(self._config.model_id, "cmpl", self._token_text)
        # The request's prompts take one queue place together, or none (503: none runs).
        follows = self._submit(request, gens)
        if req.stream:
            return self._stream(follows[0], fmt, req.include_usage, gens[0].logprobs is not None)
        # Several prompts run as several jobs at once: they batch like separate clients.
        outs = await asyncio.gather(*(self._collect(f) for f in follows))
        if any(o is None for o in outs):
            return Response(status_code=499)  # the client went away; nobody reads this answer
        choices = []
        for i, (out, gen, text) in enumerate(zip(outs, gens, texts, strict=True)):
            assert out is not None
            _raise_for(out.end)
            if gen.echo:
                prompt_text = text if text is not None else await run_in_threadpool(
                    self._decode, list(gen.prompt))  # fmt: skip
                out.text = prompt_text + out.text
            choices.append(fmt.choice(i, out, gen.logprobs is not None))
        return JSONResponse(fmt.complete(choices, [o.end for o in outs if o is not None]))

    async def chat_completions(self, request: Request) -> Response:
        raw = await _read_body(request)
        req = await run_in_threadpool(self._parse, ChatCompletionRequest, raw)
        tools = req.tool_specs()
        self._check_tools(tools)
        ids = await run_in_threadpool(self._encode_chat, req.template_messages(), tools)
        gen = self._generation(req.token_budget(), ids, _sampling(req), req.stops(),
                               param="messages", logprobs=req.top())  # fmt: skip
        fmt = _ChatFormat(self._config.model_id, "chatcmpl", self._token_text)
        split = await run_in_threadpool(self._splitter, tools, "call_", ids)
        (follow,) = self._submit(request, [gen])
        events = _split_tools(follow, split)
        if req.stream:
            return self._stream(events, fmt, req.include_usage, gen.logprobs is not None)
        out = await self._collect(events)
        if out is None:
            return Response(status_code=499)
        _raise_for(out.end)
        return JSONResponse(fmt.complete([fmt.choice(0, out, gen.logprobs is not None)], [out.end]))

    async def messages(self, request: Request) -> Response:
        """The Anthropic Messages API (serve/anthropic.py) on the same queue and batch."""
        raw = await _read_body(request)
        req = await run_in_threadpool(self._parse, anthropic.MessagesRequest, raw)
        tools = req.tool_specs()
        self._check_tools(tools)
        ids = await run_in_threadpool(self._encode_chat, req.template_messages(), tools)
        gen = self._generation(req.token_budget(), ids, req.sampling(), req.stops(),
                               param="messages")  # fmt: skip
        split = await run_in_threadpool(self._splitter, tools, "toolu_", ids)
        (follow,) = self._submit(request, [gen])
        events = _split_tools(follow, split)
        msg_id = anthropic.new_message_id()
        model = self._config.model_id
        if req.stream:
            pieces = _pieces(events)
            return StreamingResponse(
                anthropic.message_events(pieces, msg_id, model, len(ids), _raise_for),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        out = await self._collect(events)
        if out is None:
            return Response(status_code=499)
        _raise_for(out.end)
        return JSONResponse(anthropic.message_body(msg_id, model, out.pieces, out.end))

    async def count_tokens(self, request: Request) -> JSONResponse:
        """The Messages API's token count: the prompt's tokens as the request would run."""
        raw = await _read_body(request)
        body = load_body(raw)
        body.setdefault("max_tokens", 1)  # not part of a count request
        req = await run_in_threadpool(self._parse_body, anthropic.MessagesRequest, body)
        tools = req.tool_specs()
        self._check_tools(tools)
        ids = await run_in_threadpool(self._encode_chat, req.template_messages(), tools)
        return JSONResponse({"input_tokens": len(ids)})

    def _check_tools(self, tools: list[dict[str, Any]] | None) -> None:
        if tools and self._tool_syntax is None:
            raise bad_request(
                "The model's chat template defines no tool-call format this server can parse: "
                "it cannot be given tools",
                param="tools", code="invalid_value",
            )  # fmt: skip

    def _splitter(
        self, tools: list[dict[str, Any]] | None, id_prefix: str, ids: list[int]
    ) -> ToolCallSplitter | TemplateSplitter | None:
        """The answer's tool-call splitter (on a handler thread: a response_template's parser
        reads the prompt, decoded here); None without tools."""
        if not tools or self._tool_syntax is None:
            return None
        return splitter(self._tool_syntax, tools, id_prefix, lambda: self._decode(ids))

    # ---- checks before anything runs (on a handler thread: a large body takes a while) -------
    def _parse(self, cls: type[_Req], raw: bytes) -> _Req:
        """The body as `cls`, every field checked against the model: a 400 naming the field
        (404 for another model). Prompts that cannot fit the context are refused here, before
        the fields are validated or anything is tokenized."""
        return self._parse_body(cls, load_body(raw))

    def _parse_body(self, cls: type[_Req], body: dict[str, Any]) -> _Req:
        self._check_lengths(body)
        req = validate_body(cls, body)
        req.check()
        self._check_model(req.model)
        if self._vocab is not None and req.top_k >= self._vocab:
            raise bad_request(
                f"Invalid value for 'top_k': must be below the vocabulary size {self._vocab} "
                "(0: no top-k)", param="top_k", code="invalid_value",
            )  # fmt: skip
        return req

    def _check_lengths(self, body: dict[str, Any]) -> None:
        """Refuses, from the raw JSON and before its fields are validated (validating a list
        of a million items holds the interpreter, and with it every stream, for seconds): more
        prompts or stop sequences than allowed, a token-id prompt of the context's length or
        more, more messages and content parts than the context has tokens (each spells at
        least one), and a text that cannot fit the context, without tokenizing it whole
        (`_check_text`)."""
        ctx = self._context
        prompt = body.get("prompt")
        prompts: list[Any] = [prompt]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompts = prompt  # several prompts
            if len(prompts) > MAX_PROMPTS:
                raise bad_request(
                    f"Invalid value for 'prompt': at most {MAX_PROMPTS} prompts per request",
                    param="prompt", code="invalid_value",
                )  # fmt: skip
        for p in prompts:
            if isinstance(p, str):
                self._check_text([p], "prompt")
            elif isinstance(p, list) and ctx is not None and len(p) >= ctx:
                raise context_exceeded(
                    f"This model's maximum context length is {ctx} tokens. However, your "
                    f"prompt has {len(p)} tokens. Please reduce the length of the prompt.",
                    param="prompt",
                )
        stop = body.get("stop")
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise bad_request(
                f"Invalid value for 'stop': at most {MAX_STOPS} stop sequences",
                param="stop", code="invalid_value",
            )  # fmt: skip
        tools = body.get("tools")
        if isinstance(tools, list) and len(tools) > MAX_TOOLS:
            raise bad_request(
                f"Invalid value for 'tools': at most {MAX_TOOLS} tools",
                param="tools", code="invalid_value",
            )  # fmt: skip
        messages = body.get("messages")
        if isinstance(messages, list):
            system = body.get("system")  # the Messages API's system prompt
            texts: list[str] = [system] if isinstance(system, str) else []
            items = len(messages)
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                parts = content if isinstance(content, list) else [content]
                items += len(parts) if isinstance(content, list) else 0
                for part in parts:
                    text = part.get("text") if isinstance(part, dict) else part
                    if isinstance(text, str):
                        texts.append(text)
            if ctx is not None and items > ctx:
                raise context_exceeded(
                    f"This model's maximum context length is {ctx} tokens. However, your "
                    f"messages hold {items} messages and content parts, each at least one "
                    "token. Please reduce the number of messages.",
                    param="messages",
                )
            self._check_text(texts, "messages")

    def _check_text(self, texts: list[str], param: str) -> None:
        """Texts of more characters than the context's tokens can spell (serve/tokenizing.py)
        are refused after tokenizing no more than that many of their first characters: those
        alone reach the context (a tokenizer that folds unknown text into one token could
        spell more per token; then the whole is tokenized as usual, off the batch)."""
        bound, ctx = self._max_chars, self._context
        chars = sum(len(t) for t in texts)
        if bound is None or ctx is None or chars <= bound:
            return
        parts, left = [], bound
        for t in texts:
            parts.append(t[:left])
            left -= len(parts[-1])
            if not left:
                break
        with self._tokenizers.borrow() as tokenizer:
            n = len(tokenizer.encode("".join(parts)))
        if n >= ctx:
            raise context_exceeded(
                f"This model's maximum context length is {ctx} tokens. However, your {param} "
                f"has {chars} characters, and its first {bound} alone are {n} tokens. Please "
                f"reduce the length of the {param}.",
                param=param,
            )

    def _decode(self, ids: list[int]) -> str:
        with self._tokenizers.borrow() as tokenizer:
            return str(tokenizer.decode(ids))

    def _token_text(self, token: int) -> str:
        with self._worker.tokenizer_lock:  # held by the worker for one token at a time
            return str(self._tokenizer.decode([token]))

    def _encode(self, text: str) -> list[int]:
        with self._tokenizers.borrow() as tokenizer:
            return list(tokenizer.encode(text))

    def _encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The conversation through the model's chat template; `tools` (OpenAI's function
        layout) go into the template, which writes them in the model's own format."""
        with self._tokenizers.borrow() as tokenizer:
            if not tokenizer.has_chat_template:
                # Models without a template: the plain "role: content" layout mlx-lm falls back to.
                text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
                return list(tokenizer.encode(text))
            kwargs: dict[str, Any] = {"tools": tools} if tools else {}
            try:
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, **kwargs
                )
            except Exception as e:  # jinja raises for conversations its template rejects
                raise bad_request(
                    f"The model's chat template rejected the messages: {e}", param="messages"
                ) from None
        return [int(t) for t in ids]

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if t < 0 or (self._vocab is not None and t >= self._vocab)]
        if bad:
            raise bad_request(
                f"Token id {bad[0]} is outside the vocabulary (0..{(self._vocab or 1) - 1})",
                param="prompt",
                code="invalid_value",
            )

    def _generation(
        self,
        budget: int | None,
        ids: list[int],
        sampling: SamplingParams,
        stops: tuple[str, ...],
        *,
        param: str,
        logprobs: int | None = None,
        echo: bool = False,
    ) -> GenerationRequest:
        n = len(ids)
        if n == 0:
            raise bad_request("The prompt is empty", param=param, code="invalid_value")
        ctx = self._context
        if ctx is not None and n >= ctx:
            raise context_exceeded(
                f"This model's maximum context length is {ctx} tokens. However, your {param} "
                f"resulted in {n} tokens. Please reduce the length of the {param}.",
                param=param,
            )
        if budget is None:
            budget = self._config.default_max_tokens
            if ctx is not None:
                budget = min(budget, ctx - n)
        elif ctx is not None and n + budget > ctx:
            raise context_exceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n + budget} tokens ({n} in the {param}, {budget} for the completion). "
                f"Please reduce the length of the {param} or the completion.",
                param="max_tokens",
            )
        return GenerationRequest(tuple(ids), budget, sampling, stops, logprobs, echo)

    def _submit(
        self, request: Request, gens: list[GenerationRequest]
    ) -> list[AsyncGenerator[Event, None]]:
        """Queues one request's jobs (one per prompt) as one place; each job's events until
        Finished. 503 at once when the queue is full, and then none of them runs."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        mailbox = self._mailbox
        jobs: list[tuple[Job, asyncio.Queue[Event]]] = []
        for gen in gens:
            events: asyncio.Queue[Event] = asyncio.Queue()

            def deliver(event: Event, events: asyncio.Queue[Event] = events) -> None:
                mailbox.post(events, event)  # runs on the worker thread

            jobs.append((Job(gen, deliver), events))
        try:
            self._worker.submit_request([job for job, _ in jobs])
        except QueueFullError:
            raise queue_full(self._worker.max_queue) from None
        except WorkerStoppedError as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        poll_s = self._config.disconnect_poll_s
        return [_follow(request, job, events, poll_s) for job, events in jobs]

    def _stream(
        self,
        follow: AsyncGenerator[_Piece, None],
        fmt: _Format,
        include_usage: bool,
        logprobs: bool,
    ) -> Response:
        return StreamingResponse(
            _sse(follow, fmt, include_usage, logprobs),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _collect(self, follow: AsyncGenerator[_Piece, None]) -> _Output | None:
        """The whole answer of one job; None when the client went away."""
        out = _Output()
        async for event in follow:
            if isinstance(event, TextChunk):
                out.text += event.text
                out.pieces.append(event.text)
            elif isinstance(event, ToolCall):
                out.pieces.append(event)
            elif isinstance(event, Logprobs):
                out.logprobs.extend(event.entries)
            else:
                out.end = event
                return out
        return None


_Req = TypeVar("_Req", CompletionRequest, ChatCompletionRequest, anthropic.MessagesRequest)
# A job's events with its tool calls cut out of its text (_split_tools).
_Piece = Event | ToolCall


def _sampling(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
    )


async def _split_tools(
    events: AsyncGenerator[Event, None], splitter: ToolCallSplitter | TemplateSplitter | None
) -> AsyncGenerator[_Piece, None]:
    """The job's events, its text split into text and tool calls (none without a splitter):
    the streamed and the whole answer both come from here, so they are the same."""
    try:
        async for event in events:
            if splitter is None or isinstance(event, Logprobs):
                yield event
                continue
            pieces = splitter.feed(event.text) if isinstance(event, TextChunk) else []
            if isinstance(event, Finished):
                pieces = splitter.finish() if event.reason in ("stop", "length") else []
            for p in pieces:
                yield TextChunk(p) if isinstance(p, str) else p
            if isinstance(event, Finished):
                yield event
    finally:
        await events.aclose()


async def _pieces(events: AsyncGenerator[_Piece, None]) -> AsyncGenerator[Piece | Finished, None]:
    """Text (as str), tool calls and the end: what the Messages API streams."""
    try:
        async for event in events:
            if isinstance(event, TextChunk):
                yield event.text
            elif isinstance(event, (ToolCall, Finished)):
                yield event
    finally:
        await events.aclose()


@dataclass
class _Output:
    """One choice's text, its pieces (text and tool calls in order), the log-probabilities of
    its tokens (echoed prompt first) and end."""

    text: str = ""
    pieces: list[Piece] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    end: Finished = field(default_factory=lambda: Finished("error", 0, 0, "no end"))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p for p in self.pieces if isinstance(p, ToolCall)]


async def _probe(probe: PackProbe) -> str | None:
    """The probe's answer, or that the pack did not answer in time (a hung file system: the
    read is left to finish on its thread)."""
    try:
        return await asyncio.wait_for(run_in_threadpool(probe.probe), PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"the pack {probe.path} did not answer a read within {PROBE_TIMEOUT_S} s"


async def _read_body(request: Request) -> bytes:
    too_large = APIError(
        413, f"The request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return bytes(body)


async def _follow(
    request: Request, job: Job, events: asyncio.Queue[Event], poll_s: float
) -> AsyncGenerator[Event, None]:
    """The job's events until Finished; cancels the job when the client disconnects or the
    consumer stops early (a streamed response whose send failed)."""
    finished = False
    try:
        while True:
            if not events.empty():  # the common case while decoding: no timer, no task
                event = events.get_nowait()
            else:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=poll_s)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
            yield event
            if isinstance(event, Finished):
                finished = True
                return
    finally:
        if not finished:
            job.cancel()


def _raise_for(end: Finished) -> None:
    if end.reason == "error":
        raise server_error(f"generation failed: {end.error}")
    if end.reason == "cancelled":
        raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")


def _sse_data(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _sse(
    events: AsyncGenerator[_Piece, None], fmt: _Format, include_usage: bool, logprobs: bool
) -> AsyncIterator[bytes]:
    # Token log-probabilities ride on the next chunk that carries text (or the final one).
    pending: list[TokenLogprob] = []
    calls = 0
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield _sse_data(first)
        async for event in events:
            if isinstance(event, Logprobs):
                pending.extend(event.entries)
                continue
            if isinstance(event, ToolCall):
                for chunk in fmt.tool_chunks(event, calls):
                    yield _sse_data(chunk)
                calls += 1
                continue
            if isinstance(event, TextChunk):
                yield _sse_data(fmt.chunk(event.text, None, pending if logprobs else None))
                pending = []
                continue
            if event.reason in ("error", "cancelled"):
                try:
                    _raise_for(event)
                except APIError as e:
                    yield _sse_data(e.body())
                return
            reason = _finish_reason(event, calls)
            yield _sse_data(fmt.chunk("", reason, pending if logprobs else None))
            if include_usage:
                yield _sse_data(fmt.usage_chunk([event]))
            yield b"data: [DONE]\n\n"
    finally:
        # aclose() runs _follow's finally now (cancelling the job), not at garbage collection.
        await events.aclose()


def _finish_reason(end: Finished, calls: int) -> str:
    """OpenAI's finish_reason: "tool_calls" where the model called tools and then stopped."""
    return "tool_calls" if calls and end.reason == "stop" else end.reason


def _usage(ends: list[Finished]) -> dict[str, int]:
    prompt = sum(e.prompt_tokens for e in ends)
    completion = sum(e.completion_tokens for e in ends)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class _Format:
    """One response's OpenAI JSON shapes (id and created fixed per response). token_text
    renders one token id as the text a logprobs entry names."""

    object_complete = ""
    object_chunk = ""

    def __init__(self, model_id: str, prefix: str, token_text: Callable[[int], str]) -> None:
        self.model_id = model_id
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.token_text = token_text

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_id,
            "system_fingerprint": "strata-stream",
            "choices": choices,
        }

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def chunk(
        self, text: str, finish: str | None, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def choice(self, index: int, out: _Output, logprobs: bool) -> dict[str, Any]:
        raise NotImplementedError

    def tool_chunks(self, call: ToolCall, index: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError

    def complete(self, choices: list[dict[str, Any]], ends: list[Finished]) -> dict[str, Any]:
        body = self._envelope(self.object_complete, choices)
        body["usage"] = _usage(ends)
        return body

    def usage_chunk(self, ends: list[Finished]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = _usage(ends)
        return body


class _ChatFormat(_Format):
    """Chat logprobs as the OpenAI API gives them: content[i] = {token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}."""

    object_complete = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def first_chunk(self) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def _item(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for e in entries:
            item = self._item(e.token, e.logprob)
            item["top_logprobs"] = [self._item(t, lp) for t, lp in e.top]
            content.append(item)
        return {"content": content}

    def chunk(
        self, text: str, finish: str | None, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        lp = None if logprobs is None else self.logprobs(logprobs)
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return self._envelope(self.object_chunk, [choice])

    def tool_chunks(self, call: ToolCall, index: int) -> list[dict[str, Any]]:
        """One call as OpenAI streams it: its id and name with empty arguments, then the
        arguments (here in one piece: a call is parsed whole)."""
        head = {"index": index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        args = {"index": index, "function": {"arguments": call.arguments}}
        return [
            self._envelope(self.object_chunk, [{"index": 0, "delta": {"tool_calls": [d]},
                                                "logprobs": None, "finish_reason": None}])
            for d in (head, args)
        ]  # fmt: skip

    def choice(self, index: int, out: _Output, logprobs: bool) -> dict[str, Any]:
        calls = out.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        if calls:
            message["content"] = out.text or None
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]  # fmt: skip
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(out.logprobs) if logprobs else None,
            "finish_reason": _finish_reason(out.end, len(calls)),
        }


class _CompletionFormat(_Format):
    """Completion logprobs as the OpenAI legacy API and mlx_lm.server give them: tokens,
    token_logprobs (None for an echoed prompt's first token), top_logprobs (token -> logprob;
    None where token_logprobs is), text_offset."""

    object_complete = "text_completion"
    object_chunk = "text_completion"

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e.token)
            tokens.append(text)
            values.append(e.logprob)
            tops.append(None if e.logprob is None else {self.token_text(t): lp for t, lp in e.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def chunk(
        self, text: str, finish: str | None, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        lp = None if logprobs is None else self.logprobs(logprobs)
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return self._envelope(self.object_chunk, [choice])

    def choice(self, index: int, out: _Output, logprobs: bool) -> dict[str, Any]:
        return {
            "index": index,
            "text": out.text,
            "logprobs": self.logprobs(out.logprobs) if logprobs else None,
            "finish_reason": out.end.reason,
        }
