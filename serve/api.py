"""The OpenAI-compatible HTTP API (FastAPI) over an `AsyncEngine`.

    GET  /v1/models              the served model
    POST /v1/completions         text completion; "stream": true for server-sent events
    POST /v1/chat/completions    chat through the tokenizer's template; streams the same way
    GET  /health                 200 while the engine thread is alive, else 503
    GET  /metrics                Prometheus text: TTFT, TPOT, requests, KV blocks, prefix hits

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with the
status: 400 for a bad field (named in `param`; types are strict, so `"max_tokens": true` is an
error, not 1), 404 for an unknown model or path, 405 for a wrong method, 413 for a body over the
size limit, 500 when a step running the request raised (the engine frees its blocks and goes on
serving the others), 503 when the request queue is full or the server is shutting down. Known
OpenAI/vLLM fields that this server does not implement are refused unless they hold their
neutral value; unknown fields are ignored (logged once). Streams end with `data: [DONE]`, after
an error event if the request failed mid-stream; a client that disconnects has its request
aborted and its KV blocks freed. Tokenization runs on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from serve.async_engine import (AsyncEngine, Draining, EngineDead, QueueFull, RequestFailed,
                                RequestStream)
from serve.engine import InvalidRequest, SamplingParams
from serve.llm import check_text
from serve.outputs import RequestUpdate

log = logging.getLogger("serve")

# ---- request bodies ----------------------------------------------------------------------------


class _Common(BaseModel):
    # Strict types (`max_tokens: true` or `stream: "yes"` are refused, not coerced) and no NaN or
    # infinity. Unknown fields are ignored (logged once each), as OpenAI-compatible servers do;
    # known ones we cannot honour are refused by _refuse_unsupported rather than dropped.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions (as in vLLM): top-k sampling, stop token ids, and generating past EOS.
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_of_parts(cls, content: Any) -> Any:
        """OpenAI's list of content parts -> their text; parts of other types are refused."""
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content[{i}]: only parts of type 'text' are supported, got "
                                 f"{kind!r}" if kind else f"content[{i}]: expected a content part "
                                 f"object with a 'type'")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}].text: expected a string, got "
                                 f"{type(part.get('text')).__name__}")
            texts.append(part["text"])
        return "".join(texts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: the rest of the context (or of the KV pool)
    max_completion_tokens: int | None = None


# Fields of OpenAI's or vLLM's API this server does not implement: accepted only at the value
# that means "off", refused otherwise (never silently ignored).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "min_p": (0,), "min_tokens": (0,), "logit_bias": ({},), "logprobs": (False,),
    "top_logprobs": (0,), "prompt_logprobs": (), "echo": (False,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "use_beam_search": (False,), "length_penalty": (1,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (), "allowed_token_ids": (), "bad_words": ([],),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}


# ---- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()  # ASCII-escaped: any message encodes

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                        .rstrip(": "), code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type to the location (prompt.str, prompt.list[int], ...).
    field = ".".join(p for p in loc if not (p[:1].isalpha() and ("[" in p or p in {"str", "int"})))
    message = str(first.get("msg")).removeprefix("Value error, ")
    if not field:
        return APIError(400, f"the request body is invalid: {message}")
    return APIError(400, f"{field}: {message}", param=field.split(".")[0])


def _is_neutral(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


class _UnknownFields:
    """Logs each request field this server does not know, once per name."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def check(self, req: _Common) -> None:
        for name in (req.model_extra or {}).keys() - UNSUPPORTED.keys() - self.seen:
            self.seen.add(name)
            log.warning("ignoring the unknown request field %r (reported once)", name)


def _refuse_unsupported(req: _Common) -> None:
    extra = req.model_extra or {}
    for name, neutral in UNSUPPORTED.items():
        if name in extra and extra[name] is not None and not any(
                _is_neutral(extra[name], n) for n in neutral):
            raise APIError(400, f"{name}={extra[name]!r} is not supported by this server",
                           param=name)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise APIError(400, f"best_of={best_of} is not supported (only best_of == n)", param="best_of")


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before the app sees it
    (by its Content-Length, or by counting a chunked body)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # later messages: the disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        body = APIError(413, f"the request body exceeds the server's limit of {self.max_bytes} "
                        "bytes (--max-request-bytes)", code="request_too_large").body()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# ---- the app -----------------------------------------------------------------------------------


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-shaped body with its status; nothing as a traceback."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Response:  # 404 and 405 from routing
        codes = {404: "not_found", 405: "method_not_allowed"}
        return APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error in a request handler")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                        type="server_error").response()


def _metrics_registry(engine: AsyncEngine) -> CollectorRegistry:
    """This app's own Prometheus registry: latency histograms fed by each finished request, and
    the engine's counters and gauges read from its latest snapshot at scrape time."""
    registry = CollectorRegistry()
    latency = dict(registry=registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
    ttft = Histogram("egmla_time_to_first_token_seconds", "Time to first token", **latency)
    tpot = Histogram("egmla_time_per_output_token_seconds",
                     "Time per output token after the first", **latency)
    registry.register(_EngineCollector(engine))

    def observe(update: RequestUpdate) -> None:  # on the engine thread
        for out in update.outputs:
            if out.finish_reason not in ("abort", "error"):
                if out.ttft is not None:
                    ttft.observe(out.ttft)
                if out.tpot is not None:
                    tpot.observe(out.tpot)

    engine.on_finish.append(observe)
    return registry


class _Admission:
    """What every request passes before any work is done for it (the model's name, its fields,
    its sampling parameters), and its submission: all of a request's prompts or none."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine, self.llm, self.served = engine, engine.llm, served_model_name
        self._unknown = _UnknownFields()

    def check(self, req: _Common) -> None:
        if req.model != self.served:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                           f"{self.served!r}", param="model", code="model_not_found")
        self._unknown.check(req)
        _refuse_unsupported(req)
        for i, text in enumerate(_stops(req)):
            try:
                check_text(text, "stop" if isinstance(req.stop, str) else f"stop[{i}]", "stop")
            except InvalidRequest as error:
                raise APIError(400, str(error), param=error.param) from None

    def sampling(self, req: _Common, max_tokens: int) -> SamplingParams:
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, seed=req.seed, n=req.n, stop=_stops(req),
                stop_token_ids=list(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)
        except InvalidRequest as error:
            raise APIError(400, str(error), param=error.param) from None
        return self.llm.with_eos(params)

    def submit(self, prompts: list[list[int]], params: SamplingParams, req: _Common,
               prompt_field: str) -> list[RequestStream]:
        """Queue every prompt, or none: all are checked first, and a full queue midway takes
        back the ones already queued."""
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                self.engine.check_request(prompt, params)
            for prompt in prompts:
                streams.append(self.engine.submit(prompt, params, stream=req.stream))
        except InvalidRequest as error:
            param = prompt_field if error.param == "prompt" else error.param
            raise APIError(400, str(error), param=param, code=error.code) from None
        except (QueueFull, Draining) as error:
            for stream in streams:
                stream.abort()
            if isinstance(error, Draining):
                raise APIError(503, str(error), type="server_shutting_down") from None
            raise APIError(503, f"{error}; retry later", type="server_overloaded") from None
        except EngineDead as error:
            raise APIError(503, str(error), type="server_error") from None
        return streams


def build_app(engine: AsyncEngine, served_model_name: str,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The HTTP API over a started `AsyncEngine`; metrics go to a registry of this app's own.
    Request bodies over `max_request_bytes` are answered 413."""
    app = FastAPI(title="egmla serve", description=__doc__)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    _install_error_handlers(app)
    registry = _metrics_registry(engine)
    gate, llm = _Admission(engine, served_model_name), engine.llm
    context = llm.model.config.max_seq_len
    app.state.started = time.time()

    async def tokenize(encode, *args) -> Any:  # off the event loop: a long prompt takes seconds
        return await asyncio.to_thread(encode, *args)

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return APIError(503, f"the engine stopped: {engine.error!r}", type="server_error").response()
        if engine.draining:
            return APIError(503, "the server is shutting down", type="server_shutting_down").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(app.state.started),
            "owned_by": "egmla", "max_model_len": context}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        gate.check(req)
        prompts = _completion_prompts(req.prompt)
        try:
            encoded = await tokenize(lambda: [llm.encode(p) for p in prompts])
        except InvalidRequest as error:
            raise APIError(400, str(error), param="prompt") from None
        if req.max_tokens is None:
            req.max_tokens = 16
        streams = gate.submit(encoded, gate.sampling(req, req.max_tokens), req, "prompt")
        reply = _Reply("cmpl", "text_completion", served_model_name, req, chat=False)
        return await reply.respond(streams, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        gate.check(req)
        messages = [m.model_dump() for m in req.messages]
        try:
            prompt = await tokenize(llm.encode_chat, messages)
        except InvalidRequest as error:
            raise APIError(400, str(error), param="messages") from None
        except Exception as error:  # noqa: BLE001 - a template may reject a conversation any way
            raise APIError(400, f"the chat template rejected the messages: {error}",
                           param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is None:  # the rest of the context, within what the KV pool can hold
            max_tokens = max(1, engine.max_request_tokens - len(prompt))
        try:
            params = gate.sampling(req, max_tokens)
        except APIError as error:
            error.param = param if error.param == "max_tokens" else error.param
            raise
        streams = gate.submit([prompt], params, req, "messages")
        reply = _Reply("chatcmpl", "chat.completion", served_model_name, req, chat=True)
        return await reply.respond(streams, request)

    return app


def _stops(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    return list(prompt)


class _Reply:
    """Builds OpenAI-shaped responses (whole or streamed) from the requests' updates."""

    def __init__(self, prefix: str, obj: str, model: str, req: _Common, chat: bool) -> None:
        self.id, self.object, self.model = f"{prefix}-{uuid.uuid4().hex}", obj, model
        self.created, self.req, self.chat, self.n = int(time.time()), req, chat, req.n

    def _choice(self, index: int, text: str, finish: str | None, delta: bool) -> dict:
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return choice

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = self.object + ".chunk" if self.chat else self.object
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def respond(self, streams: list[RequestStream], request: Request):
        if self.req.stream:
            return StreamingResponse(self._stream(streams), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(streams, request)

    async def _whole(self, streams: list[RequestStream], request: Request) -> dict:
        async def last(stream: RequestStream) -> RequestUpdate:
            async for update in stream:
                if update.finished:
                    return update
            raise EngineDead("the request ended without a result")

        collect = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client left: closing the streams aborts the requests
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)  # retrieve the cancellation
                raise APIError(499, "client disconnected", type="client_closed")
            finals = collect.result()
        except EngineDead as error:
            raise APIError(503, str(error), type="server_error") from None
        except RequestFailed as error:
            kind = "server_error" if error.status == 500 else "server_shutting_down"
            raise APIError(error.status, str(error), type=kind) from None
        finally:
            gone.cancel()
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i, update in enumerate(finals):
            prompt_tokens += update.prompt_tokens
            cached += update.cached_tokens
            for out in update.outputs:
                completion_tokens += len(out.token_ids)
                choices.append(self._choice(i * self.n + out.index, out.text, out.finish_reason,
                                            delta=False))
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(prompt_tokens, completion_tokens, cached)}

    async def _stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        merged: asyncio.Queue[tuple[int, RequestUpdate | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for update in stream:
                    await merged.put((i, update))
            except Exception as error:  # noqa: BLE001 - reported in the stream below
                await merged.put((i, error))
            await merged.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            if self.chat:  # OpenAI opens every chat choice with the assistant role
                yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}
                                   for i in range(self.n * len(streams))])
            open_streams, prompt_tokens, completion_tokens, cached = len(streams), 0, 0, 0
            while open_streams:
                i, item = await merged.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    err = {"message": str(item), "type": "server_error", "param": None, "code": None}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    continue
                choices = [self._choice(i * self.n + d.index, d.text, d.finish_reason, delta=True)
                           for d in item.deltas if d.text or d.finish_reason]
                if choices:
                    yield self._chunk(choices)
                if item.finished:
                    prompt_tokens += item.prompt_tokens
                    cached += item.cached_tokens
                    completion_tokens += sum(len(o.token_ids) for o in item.outputs)
            if (self.req.stream_options or {}).get("include_usage"):
                yield self._chunk([], self._usage(prompt_tokens, completion_tokens, cached))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:  # a disconnect cancels us here: stop the pumps, abort the requests
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _EngineCollector:
    """Gauges and counters read from the engine's latest snapshot at scrape time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self):
        s = self._engine.snapshot
        gauges = {
            "egmla_num_requests_running": ("Sequences in the running batch", s.running),
            "egmla_num_requests_waiting": ("Sequences waiting to be scheduled", s.waiting),
            "egmla_kv_blocks_used": ("KV-cache blocks held by sequences", s.kv_blocks_used),
            "egmla_kv_blocks_total": ("KV-cache blocks in the pool", s.kv_blocks_total),
            "egmla_prefix_cache_hit_rate": ("Prompt blocks found in the prefix cache / looked up",
                                            s.prefix_cache_hit_rate),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(name, help_text, value=value)
        counters = {
            "egmla_preemptions": ("Sequences preempted (recomputed later)", s.preemptions),
            "egmla_prompt_tokens": ("Prompt tokens computed", s.prompt_tokens),
            "egmla_generation_tokens": ("Tokens generated", s.generation_tokens),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(name, help_text, value=value)
