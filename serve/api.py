"""The OpenAI-compatible HTTP API (FastAPI) over an `AsyncEngine`.

    GET  /v1/models              the served model
    POST /v1/completions         text completion; "stream": true for server-sent events
    POST /v1/chat/completions    chat through the tokenizer's template; streams the same way
    POST /tokenize               vLLM's: a prompt (or messages) -> token ids
    POST /detokenize             vLLM's: token ids -> text
    GET  /tokenizer_info         vLLM's: the tokenizer's special tokens and chat template
    GET  /version                the server's version
    GET  /health                 200 while the engine thread is alive, else 503
    GET  /metrics                Prometheus text: TTFT, TPOT, requests, KV blocks, prefix hits

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with the
status: 400 for a bad field (named in `param`; types are strict, so `"max_tokens": true` is an
error, not 1) or a request that could never run here (more prompts than the server holds at
once, a prompt beyond the context or the KV pool), 404 for an unknown model or path, 405 for a
wrong method, 413 for a body over the size limit, 500 when computing the request raised (its
forward or sampling: it alone fails, its blocks freed), 503 when the request queue has no room
for it now or the server is shutting down; a refused request leaves nothing queued. Known
OpenAI/vLLM fields that this server does not implement are refused unless they hold their
neutral value; unknown fields are ignored (logged once). Streams end with `data: [DONE]`, after
an error event if the request failed mid-stream; a client that disconnects has its request
aborted and its KV blocks freed. Tokenization runs on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from serve.async_engine import (AsyncEngine, Draining, EngineDead, QueueFull, RequestFailed,
                                RequestStream)
from serve.engine import MAX_LOGPROBS, InvalidRequest, SamplingParams
from serve.llm import check_text
from serve.outputs import RequestUpdate, StopStrings

log = logging.getLogger("serve")

# ---- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    """OpenAI's stream_options (vLLM's continuous_usage_stats is refused unless false); strict
    like every field, so `"include_usage": "yes"` is an error, not true."""
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


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
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extensions (as in vLLM): top-k and min-p sampling, the repetition penalty, a minimum
    # length, stop token ids, generating past EOS, and special tokens kept in the text.
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None  # the N most likely tokens' logprobs at each position
    echo: bool = False  # the prompt comes back before the completion (with its logprobs)


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
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the N most likely tokens at each position


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


# Fields of OpenAI's or vLLM's API this server does not implement: accepted only at the value
# that means "off", refused otherwise (never silently ignored).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "prompt_logprobs": (), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "use_beam_search": (False,), "length_penalty": (1,),
    "include_stop_str_in_output": (False,),
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
        names = (req.model_extra or {}).keys() - UNSUPPORTED.keys()
        if req.stream_options is not None:
            names |= {f"stream_options.{k}" for k in req.stream_options.model_extra or {}}
        for name in names - self.seen:
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
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise APIError(400, "stream_options.continuous_usage_stats=true is not supported by this "
                       "server (usage comes in the last chunk, with include_usage)",
                       param="stream_options")


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before the app sees it
    (by its Content-Length, or by counting a chunked body).

    The refused body is read and dropped first, up to `drain_bytes` more: a client sends its
    whole body before it reads the reply, and a socket closed with bytes still unread makes the
    kernel answer with a reset that can destroy the 413 before the client reads it. A body
    declared larger than that (or one sent after `Expect: 100-continue`, which waits for the
    server's word) is refused at once, without reading it."""

    def __init__(self, app: Any, max_bytes: int, drain_bytes: int | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.drain_bytes = max(4 * max_bytes, 64 * 2**20) if drain_bytes is None else drain_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            if (int(declared) <= self.max_bytes + self.drain_bytes
                    and headers.get(b"expect", b"").lower() != b"100-continue"):
                await self._drain(receive)
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if message.get("more_body"):
                    await self._drain(receive)
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

    async def _drain(self, receive: Any) -> None:
        """Read and drop the rest of a refused body, at most `drain_bytes` of it."""
        drained = 0
        while drained <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return
            drained += len(message.get("body", b""))

    async def _refuse(self, send: Any) -> None:
        body = APIError(413, f"the request body exceeds the server's limit of {self.max_bytes} "
                        "bytes (--max-request-bytes)", code="request_too_large").body()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# ---- the app -----------------------------------------------------------------------------------


# 100,000 stop strings of 40 characters are 4.4 MB of JSON
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


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


def _metrics_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    """This app's own Prometheus registry: latency histograms fed by each finished request, and
    the engine's counters and gauges read from its latest snapshot at scrape time; each under
    our name (egmla_*) and under vLLM's (vllm:*, labelled with model_name), so vLLM's dashboards
    and alerts read this server."""
    registry = CollectorRegistry()
    latency = dict(registry=registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
    ttft = Histogram("egmla_time_to_first_token_seconds", "Time to first token", **latency)
    tpot = Histogram("egmla_time_per_output_token_seconds",
                     "Time per output token after the first", **latency)
    vllm = {name: Histogram(f"vllm:{name}", text, labelnames=["model_name"], **latency).labels(model_name)
            for name, text in (
                ("time_to_first_token_seconds", "Time to first token"),
                ("inter_token_latency_seconds", "Time between tokens (each request's mean gap, "
                                                "once per gap)"),
                ("e2e_request_latency_seconds", "Request latency, arrival to last token"),
                ("request_queue_time_seconds", "Time waiting before first scheduled"))}
    success = Counter("vllm:request_success", "Finished requests by finish reason",
                      labelnames=["model_name", "finished_reason"], registry=registry)
    registry.register(_EngineCollector(engine, model_name))

    def observe(update: RequestUpdate) -> None:  # on the engine thread
        for out in update.outputs:
            if out.finish_reason in ("abort", "error"):
                continue
            success.labels(model_name, out.finish_reason).inc()
            if out.ttft is not None:
                ttft.observe(out.ttft)
                vllm["time_to_first_token_seconds"].observe(out.ttft)
            if out.tpot is not None:
                tpot.observe(out.tpot)
                for _ in range(len(out.token_ids) - 1):
                    vllm["inter_token_latency_seconds"].observe(out.tpot)
            for name, value in (("e2e_request_latency_seconds", out.e2e),
                                ("request_queue_time_seconds", out.queue_time)):
                if value is not None:
                    vllm[name].observe(value)

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
        stops = _stops(req)
        try:
            "".join(stops).encode("utf-8")  # all at once, in C (there may be 100,000)
        except UnicodeEncodeError:
            for i, text in enumerate(stops):  # name the one that is not valid Unicode
                try:
                    check_text(text, "stop" if isinstance(req.stop, str) else f"stop[{i}]", "stop")
                except InvalidRequest as error:
                    raise APIError(400, str(error), param=error.param) from None

    def sampling(self, req: _Common, max_tokens: int, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        if req.stream and prompt_logprobs is not None:  # they come with the request's end
            raise APIError(400, "echo with logprobs (the prompt's logprobs) and stream=true are "
                           "not supported together; ask without streaming", param="echo")
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, min_p=req.min_p, seed=req.seed, n=req.n, stop=_stops(req),
                stop_token_ids=list(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs)
        except InvalidRequest as error:
            raise APIError(400, str(error), param=error.param) from None
        return self.llm.with_eos(params)

    def count(self, prompts: list) -> None:
        """More prompts than the server can ever hold at once: a 400 before any work for them."""
        try:
            self.engine.check_prompt_count(len(prompts))
        except InvalidRequest as error:
            raise APIError(400, str(error), param="prompt") from None

    def submit(self, prompts: list[list[int]], params: SamplingParams, req: _Common,
               prompt_field: str, stops: StopStrings,
               score_prompt: bool = False) -> list[RequestStream]:
        """Queue every prompt, or none (AsyncEngine.submit_all: checked, then queued at once):
        a request that can never run is a 400, one that does not fit now a 503."""
        try:
            return self.engine.submit_all(prompts, params, req.stream, stops, score_prompt)
        except InvalidRequest as error:
            param = prompt_field if error.param == "prompt" else error.param
            raise APIError(400, str(error), param=param, code=error.code) from None
        except Draining as error:
            raise APIError(503, str(error), type="server_shutting_down") from None
        except QueueFull as error:
            raise APIError(503, f"{error}; retry later", type="server_overloaded") from None
        except EngineDead as error:
            raise APIError(503, str(error), type="server_error") from None


class APIKey:
    """ASGI middleware: a request to /v1 without `Authorization: Bearer <key>` is answered 401
    (as vLLM's --api-key; /health, /metrics and the tokenizer routes stay open)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await APIError(401, "a valid API key is required (Authorization: "
                                      "Bearer <key>)", type="authentication_error",
                                      code="invalid_api_key").response()(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, served_model_name: str,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None) -> FastAPI:
    """The HTTP API over a started `AsyncEngine`; metrics go to a registry of this app's own.
    Request bodies over `max_request_bytes` are answered 413; with `api_key`, requests to /v1
    without it 401."""
    app = FastAPI(title="egmla serve", description=__doc__)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(APIKey, key=api_key)
    _install_error_handlers(app)
    registry = _metrics_registry(engine, served_model_name)
    gate, llm = _Admission(engine, served_model_name), engine.llm
    app.state.started = time.time()

    async def tokenize(encode, *args) -> Any:  # off the event loop: a long prompt takes seconds
        return await asyncio.to_thread(encode, *args)

    async def stop_strings(req: _Common) -> StopStrings:
        """The request's stop strings, prepared off the event loop and the engine thread (100,000
        of them take about 0.2 s of CPU)."""
        stop = _stops(req)
        return await tokenize(StopStrings, stop) if stop else StopStrings(())

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

    def known(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{served_model_name!r}", param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize_text(req: TokenizeRequest) -> dict:
        known(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        try:
            if req.prompt is not None:
                check_text(req.prompt, "prompt")
                if llm.tokenizer is None:
                    raise InvalidRequest("this model has no tokenizer", "prompt")
                ids = await tokenize(lambda: list(llm.tokenizer.encode(
                    req.prompt, add_special_tokens=req.add_special_tokens)))
            else:
                ids = await tokenize(llm.encode_chat, [m.model_dump() for m in req.messages])
        except InvalidRequest as error:
            raise APIError(400, str(error), param=error.param) from None
        return {"count": len(ids), "max_model_len": engine.max_request_tokens, "tokens": ids,
                "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        known(req.model)
        vocab = llm.model.config.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad}]={req.tokens[bad]}: token ids must be in [0, "
                           f"{vocab}) (the model's vocabulary)", param="tokens")
        return {"prompt": llm.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tok = llm.tokenizer
        if tok is None:
            raise APIError(404, "this model has no tokenizer", code="not_found")
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
                "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": engine.max_request_tokens, "vocab_size": len(tok)}

    @app.get("/version")
    async def version() -> dict:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            return {"version": installed("egmla")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(app.state.started),
            "owned_by": "egmla", "max_model_len": engine.max_request_tokens}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        gate.check(req)
        prompts = _completion_prompts(req.prompt)
        gate.count(prompts)
        try:
            encoded = await tokenize(lambda: [llm.encode(p) for p in prompts])
        except InvalidRequest as error:
            raise APIError(400, str(error), param="prompt") from None
        if req.max_tokens is None:
            req.max_tokens = 16
        if req.max_tokens == 0 and req.stream:
            raise APIError(400, "max_tokens=0 streams nothing: ask without streaming",
                           param="max_tokens")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens=0: must be >= 1 (0 only with echo: the prompt's "
                           "logprobs alone)", param="max_tokens")
        # max_tokens 0 (echo): generate one token and drop it, the prompt's logprobs are the
        # answer; so the prompt alone must fit the context (score_prompt)
        params = gate.sampling(req, req.max_tokens or 1, req.logprobs,
                               req.logprobs if req.echo and req.logprobs is not None else None)
        streams = gate.submit(encoded, params, req, "prompt", await stop_strings(req),
                              score_prompt=req.max_tokens == 0)
        reply = _Reply("cmpl", "text_completion", served_model_name, req, chat=False,
                       engine=engine, prompts=list(zip(prompts, encoded)))
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
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={req.top_logprobs}: must be in [0, {MAX_LOGPROBS}]",
                           param="top_logprobs")
        try:
            params = gate.sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        except APIError as error:
            error.param = param if error.param == "max_tokens" else error.param
            raise
        streams = gate.submit([prompt], params, req, "messages", await stop_strings(req))
        reply = _Reply("chatcmpl", "chat.completion", served_model_name, req, chat=True,
                       engine=engine)
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

    def __init__(self, prefix: str, obj: str, model: str, req: _Common, chat: bool,
                 engine: AsyncEngine, prompts: list[tuple[str | list[int], list[int]]] | None = None
                 ) -> None:
        self.id, self.object, self.model = f"{prefix}-{uuid.uuid4().hex}", obj, model
        self.created, self.req, self.chat, self.n = int(time.time()), req, chat, req.n
        self.engine, self.llm, self.prompts = engine, engine.llm, prompts or []
        self._offsets: dict[int, int] = {}  # streamed completions: each choice's text_offset

    def _choice(self, index: int, text: str, finish: str | None, delta: bool,
                logprobs: dict | None = None) -> dict:
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def _prompt_text(self, i: int) -> str:
        prompt, prompt_ids = self.prompts[i]
        return prompt if isinstance(prompt, str) else self.llm.decode(prompt_ids)

    def _token(self, token_id: int) -> str:
        return self.llm.decode([token_id], skip_special_tokens=False)

    def _final(self, i: int, update: RequestUpdate, out) -> tuple[str, list[int], dict | None]:
        """A finished sample's text, tokens and logprobs as the response carries them: echo
        puts the prompt (and its logprobs) first; max_tokens 0 drops the one token made."""
        req = self.req
        text, tokens, steps = out.text, list(out.token_ids), list(out.logprobs or [])
        if not self.chat and req.max_tokens == 0:
            text, tokens, steps = "", [], []
        if self.chat:
            return text, tokens, (self._chat_logprobs(tokens, steps)
                                  if req.logprobs else None)
        if req.echo:
            prompt_ids = self.prompts[i][1]
            text = self._prompt_text(i) + text
            if req.logprobs is not None:
                steps = list(update.prompt_logprobs or [None] * len(prompt_ids)) + steps
            tokens = prompt_ids + tokens
        if req.logprobs is None:
            return text, tokens, None
        return text, tokens, self._completion_logprobs(tokens, steps)

    def _completion_logprobs(self, tokens: list[int], steps: list, at: int = 0) -> dict:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs (the N most
        likely, as text -> logprob), text_offset (counted from `at`: a streamed chunk's
        offsets continue the earlier chunks')."""
        names = [self._token(t) for t in tokens]
        offsets = []
        for name in names:
            offsets.append(at)
            at += len(name)
        top = self.req.logprobs
        return {"tokens": names,
                "token_logprobs": [None if s is None else s[t][0] for t, s in zip(tokens, steps)],
                "top_logprobs": [None if s is None else {
                    self._token(i): lp for i, (lp, rank) in s.items() if rank <= top}
                    for s in steps],
                "text_offset": offsets}

    def _chat_logprobs(self, tokens: list[int], steps: list) -> dict:
        """The chat shape: per token its text, logprob and UTF-8 bytes, and its top_logprobs."""
        def item(i: int, lp: float) -> dict:
            name = self._token(i)
            return {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8"))}
        top = self.req.top_logprobs or 0
        return {"content": [{**item(t, s[t][0]), "top_logprobs": [
            item(i, lp) for i, (lp, rank) in sorted(s.items(), key=lambda e: e[1][1])
            if rank <= top]} for t, s in zip(tokens, steps)]}

    def _delta_logprobs(self, choice: int, delta) -> dict | None:
        """A streamed chunk's logprobs: of the tokens made since the last chunk (their text
        may come in a later chunk, held back until it is final)."""
        if delta.logprobs is None:
            return None
        if self.chat:
            return self._chat_logprobs(delta.token_ids, delta.logprobs)
        at = self._offsets.get(choice, 0)
        out = self._completion_logprobs(delta.token_ids, delta.logprobs, at)
        self._offsets[choice] = at + sum(len(t) for t in out["tokens"])
        return out

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
            if not collect.done():  # the client left: abort every prompt, in one command
                self.engine.abort(streams)
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)  # retrieve the cancellation
                raise APIError(499, "client disconnected", type="client_closed")
            finals = collect.result()
        except (EngineDead, RequestFailed) as error:
            self.engine.abort(streams)  # the other prompts' results would go nowhere
            if isinstance(error, EngineDead):
                raise APIError(503, str(error), type="server_error") from None
            kind = "server_error" if error.status == 500 else "server_shutting_down"
            raise APIError(error.status, str(error), type=kind) from None
        finally:
            gone.cancel()
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i, update in enumerate(finals):
            prompt_tokens += update.prompt_tokens
            cached += update.cached_tokens
            for out in update.outputs:
                made = 0 if (not self.chat and self.req.max_tokens == 0) else len(out.token_ids)
                completion_tokens += made
                text, _, logprobs = self._final(i, update, out)
                choices.append(self._choice(i * self.n + out.index, text, out.finish_reason,
                                            delta=False, logprobs=logprobs))
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
            elif self.req.echo:  # the prompts first
                yield self._chunk([self._choice(i * self.n + k, self._prompt_text(i), None, True)
                                   for i in range(len(streams)) for k in range(self.n)])
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
                choices = [self._choice(i * self.n + d.index, d.text, d.finish_reason, delta=True,
                                        logprobs=self._delta_logprobs(i * self.n + d.index, d))
                           for d in item.deltas if d.text or d.finish_reason or d.logprobs]
                if choices:
                    yield self._chunk(choices)
                if item.finished:
                    prompt_tokens += item.prompt_tokens
                    cached += item.cached_tokens
                    completion_tokens += sum(len(o.token_ids) for o in item.outputs)
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self._chunk([], self._usage(prompt_tokens, completion_tokens, cached))
            yield "data: [DONE]\n\n"
        finally:  # a disconnect cancels us here: abort every prompt (one command), stop the pumps
            self.engine.abort(streams)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _EngineCollector:
    """Gauges and counters read from the engine's latest snapshot at scrape time, under our
    names and vLLM's."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine, self._model = engine, model_name

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
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        for name, help_text, value in (
                ("vllm:num_requests_running", "Sequences in the running batch", s.running),
                ("vllm:num_requests_waiting", "Sequences waiting to be scheduled", s.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is held", usage)):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
        for name, help_text, value in (
                ("vllm:prompt_tokens", "Prompt tokens computed", s.prompt_tokens),
                ("vllm:generation_tokens", "Tokens generated", s.generation_tokens)):
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
