"""The HTTP API's routes, as plain functions on one `APIRouter`: each reads what it serves from
the app's state (`Served`, set by serve/server.py's `build_app`), checks its request
(`Admission`), turns it into SamplingParams (serve/protocol.py), submits it to the engine, and
answers through serve/responses.py.

    GET  /v1/models              the served model, with vLLM's fields (root, permission, ...)
    POST /v1/completions         text completion; "stream": true for server-sent events
    POST /v1/chat/completions    chat through the tokenizer's template; streams the same way
    POST /tokenize               vLLM's: a prompt (or messages) -> token ids (and their strings)
    POST /detokenize             vLLM's: token ids -> text
    GET  /tokenizer_info         vLLM's: the tokenizer's special tokens and chat template
    GET  /version                the server's version
    GET  /health                 200 while the engine thread is alive, else 503
    GET  /metrics                Prometheus text (serve/prometheus.py)
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from serve.async_engine import AsyncEngine, Draining, EngineDead, QueueFull, RequestStream
from serve.llm import check_text
from serve.outputs import StopStrings
from serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest,
                            SamplingRequest, TokenizeRequest, UnknownFields, refuse_unsupported)
from serve.responses import Reply
from serve.sampling import InvalidRequest, SamplingParams

router = APIRouter()


class Admission:
    """What every request passes before any work is done for it (the model's name, its fields,
    its stop strings), and its submission: all of a request's prompts or none."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine, self.llm, self.served = engine, engine.llm, served_model_name
        self._unknown = UnknownFields()

    def known(self, model: str | None) -> None:
        if model is not None and model != self.served:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.served!r}", param="model", code="model_not_found")

    def check(self, req: SamplingRequest) -> None:
        self.known(req.model)
        self._unknown.check(req)
        refuse_unsupported(req)
        stops = req.stop_strings()
        try:
            "".join(stops).encode("utf-8")  # all at once, in C (there may be 100,000)
        except UnicodeEncodeError:
            for i, text in enumerate(stops):  # name the one that is not valid Unicode
                try:
                    check_text(text, "stop" if isinstance(req.stop, str) else f"stop[{i}]", "stop")
                except InvalidRequest as error:
                    raise APIError(400, str(error), param=error.param) from None

    def count(self, prompts: list) -> None:
        """More prompts than the server can ever hold at once: a 400 before any work for them."""
        try:
            self.engine.check_prompt_count(len(prompts))
        except InvalidRequest as error:
            raise APIError(400, str(error), param="prompt") from None

    def submit(self, prompts: list[list[int]], params: SamplingParams, req: SamplingRequest,
               prompt_field: str, stops: StopStrings,
               score_prompt: bool = False) -> list[RequestStream]:
        """Queue every prompt, or none (AsyncEngine.submit_all: checked, then queued at once):
        a request that can never run is a 400, one that does not fit now a 503. `params` get
        the model's end-of-sequence token first."""
        try:
            return self.engine.submit_all(prompts, self.llm.with_eos(params), req.stream, stops,
                                          score_prompt)
        except InvalidRequest as error:
            param = prompt_field if error.param == "prompt" else error.param
            raise APIError(400, str(error), param=param, code=error.code) from None
        except Draining as error:
            raise APIError(503, str(error), type="server_shutting_down") from None
        except QueueFull as error:
            raise APIError(503, f"{error}; retry later", type="server_overloaded") from None
        except EngineDead as error:
            raise APIError(503, str(error), type="server_error") from None


@dataclass
class Served:
    """What the routes serve (the app's `state.served`)."""

    engine: AsyncEngine
    name: str  # the model's name, as clients pass it
    registry: CollectorRegistry  # the app's Prometheus metrics
    started: float  # when the app was built (time.time())
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.engine, self.name)


def served(request: Request) -> Served:
    return request.app.state.served


async def off_the_loop(encode, *args) -> Any:
    """Tokenization on a worker thread, off the event loop: a long prompt takes seconds."""
    return await asyncio.to_thread(encode, *args)


async def stop_strings(req: SamplingRequest) -> StopStrings:
    """The request's stop strings, prepared off the event loop and the engine thread (100,000
    of them take about 0.2 s of CPU)."""
    stop = req.stop_strings()
    return await off_the_loop(StopStrings, stop) if stop else StopStrings(())


@router.get("/health")
async def health(request: Request) -> Response:
    engine = served(request).engine
    if not engine.alive:
        return APIError(503, f"the engine stopped: {engine.error!r}", type="server_error").response()
    if engine.draining:
        return APIError(503, "the server is shutting down", type="server_shutting_down").response()
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(generate_latest(served(request).registry),
                             media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    s = served(request)
    s.admission.known(req.model)
    llm = s.engine.llm
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    try:
        if req.prompt is not None:
            check_text(req.prompt, "prompt")
            if llm.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer", "prompt")
            ids = await off_the_loop(lambda: list(llm.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens)))
        else:
            ids = await off_the_loop(llm.encode_chat, [m.model_dump() for m in req.messages])
    except InvalidRequest as error:
        raise APIError(400, str(error), param=error.param) from None
    # vLLM's: the tokenizer's own pieces (convert_ids_to_tokens: "Ġlord", not " lord")
    strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.engine.max_request_tokens, "tokens": ids,
            "token_strs": strs}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    s = served(request)
    s.admission.known(req.model)
    llm = s.engine.llm
    vocab = llm.model.config.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}]={req.tokens[bad]}: token ids must be in [0, "
                       f"{vocab}) (the model's vocabulary)", param="tokens")
    return {"prompt": llm.decode(req.tokens, skip_special_tokens=False)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    engine = served(request).engine
    tok = engine.llm.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer", code="not_found")
    return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
            "bos_token": tok.bos_token, "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": engine.max_request_tokens, "vocab_size": len(tok)}


@router.get("/version")
async def version() -> dict:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return {"version": installed("egmla")}
    except PackageNotFoundError:
        return {"version": "unknown"}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    """One model card with vLLM's fields (its `ModelCard` and `ModelPermission`, in
    vllm/entrypoints/openai/engine/protocol.py): `root` is the model as loaded (the path or name
    given to --model), `parent` null (vLLM sets it only for a LoRA adapter), and one
    permission object with vLLM's default values."""
    s = served(request)
    created = int(s.started)
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False}
    return {"object": "list", "data": [{
        "id": s.name, "object": "model", "created": created, "owned_by": "egmla",
        "root": s.engine.llm.name, "parent": None, "max_model_len": s.engine.max_request_tokens,
        "permission": [permission]}]}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    s = served(request)
    gate, llm = s.admission, s.engine.llm
    gate.check(req)
    prompts = req.prompts()
    gate.count(prompts)
    try:
        encoded = await off_the_loop(lambda: [llm.encode(p) for p in prompts])
    except InvalidRequest as error:
        raise APIError(400, str(error), param="prompt") from None
    params = req.to_sampling_params()
    streams = gate.submit(encoded, params, req, "prompt", await stop_strings(req),
                          score_prompt=req.score_prompt)
    reply = Reply("cmpl", "text_completion", s.name, req, chat=False, engine=s.engine,
                  prompts=list(zip(prompts, encoded)))
    return await reply.respond(streams, request)


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request):
    s = served(request)
    gate, llm = s.admission, s.engine.llm
    gate.check(req)
    messages = [m.model_dump() for m in req.messages]
    try:
        prompt = await off_the_loop(llm.encode_chat, messages)
    except InvalidRequest as error:
        raise APIError(400, str(error), param="messages") from None
    except Exception as error:  # noqa: BLE001 - a template may reject a conversation any way
        raise APIError(400, f"the chat template rejected the messages: {error}",
                       param="messages") from None
    # None: the rest of the context, within what the KV pool can hold
    params = req.to_sampling_params(room=s.engine.max_request_tokens - len(prompt))
    streams = gate.submit([prompt], params, req, "messages", await stop_strings(req))
    reply = Reply("chatcmpl", "chat.completion", s.name, req, chat=True, engine=s.engine)
    return await reply.respond(streams, request)
