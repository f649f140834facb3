"""The HTTP API's request schemas, one per request kind (vLLM's `entrypoints/openai/protocol.py`),
and the rules that turn a request into `SamplingParams`.

The sampling fields that OpenAI's and vLLM's requests share with `SamplingParams` (temperature,
top_p, n, stop, seed, the penalties, top_k, min_p, min_tokens, stop_token_ids, ignore_eos,
skip_special_tokens) are taken from `SamplingParams` itself, with their types and defaults:
spelled once, in serve/sampling.py. Each kind adds what it spells its own way (max_tokens,
logprobs, echo, top_logprobs, ...). The fields a kind refuses are derived too (`refused`): the
known fields this engine does not implement (`serve.sampling.NOT_IMPLEMENTED`, with the values
that mean "off") and the `SamplingParams` fields the kind does not take, less the kind's own.

Types are strict (`"max_tokens": true` or `"stream": "yes"` are refused, not coerced) and NaN or
infinity are refused. Unknown fields are ignored (`UnknownFields` logs each once), as
OpenAI-compatible servers do; known ones this server cannot honour are refused, not dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from typing import Any, ClassVar, Literal

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from serve.inputs import content_text
from serve.sampling import (
    MAX_LOGPROBS, NOT_IMPLEMENTED, InvalidRequest, SamplingParams, asks_nothing,
)

log = logging.getLogger("serve")


class APIError(Exception):
    """An OpenAI-shaped error, `{"error": {"message", "type", "param", "code"}}`, with its
    HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()  # ASCII-escaped: any message encodes

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")


class StreamOptions(BaseModel):
    """OpenAI's stream_options (vLLM's continuous_usage_stats is refused unless false); strict
    like every field, so `"include_usage": "yes"` is an error, not true."""
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# SamplingParams fields that a request kind spells its own way (max_tokens, logprobs), that the
# server derives (prompt_logprobs: from echo with logprobs) or sets (eos_token_id: the
# tokenizer's); every other SamplingParams field is a request field of the same name.
OWN_SPELLING = ("max_tokens", "logprobs", "prompt_logprobs", "eos_token_id")
_PARAMS = {f.name: f for f in dataclasses.fields(SamplingParams)}
SAMPLING_FIELDS = tuple(name for name in _PARAMS if name not in OWN_SPELLING)
_STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
_HINTS = typing.get_type_hints(SamplingParams)
_SamplingFields = create_model(  # SamplingParams' own types and defaults
    "_SamplingFields", __config__=_STRICT,
    **{name: (_HINTS[name], _PARAMS[name].default) for name in SAMPLING_FIELDS})


class SamplingRequest(_SamplingFields):
    """What a completion and a chat request share: the model, streaming, and the sampling
    fields (`SAMPLING_FIELDS`, from SamplingParams)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}  # set per kind below (`refused`)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the shared fields and what the kind worked out; a bad value is
        an APIError naming the request's field."""
        if self.stream and prompt_logprobs is not None:  # they come with the request's end
            raise APIError(400, "echo with logprobs (the prompt's logprobs) and stream=true are "
                           "not supported together; ask without streaming", param="echo")
        try:
            return SamplingParams(**{name: getattr(self, name) for name in SAMPLING_FIELDS},
                                  max_tokens=max_tokens, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs)
        except InvalidRequest as error:
            raise APIError(400, str(error), param=error.param) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None  # the N most likely tokens' logprobs at each position
    echo: bool = False  # the prompt comes back before the completion (with its logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token list, or a list of them (never empty)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return list(prompt)

    @property
    def score_prompt(self) -> bool:
        """max_tokens 0 (with echo): one token is generated and dropped, the prompt's logprobs
        are the answer, so the prompt alone must fit the context."""
        return self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.max_tokens is None:
            self.max_tokens = 16
        if self.max_tokens == 0 and self.stream:
            raise APIError(400, "max_tokens=0 streams nothing: ask without streaming",
                           param="max_tokens")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0: must be >= 1 (0 only with echo: the prompt's "
                           "logprobs alone)", param="max_tokens")
        return self.sampling_params(self.max_tokens or 1, self.logprobs,
                                    self.logprobs if self.echo and self.logprobs is not None
                                    else None)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_of_parts(cls, content: Any) -> Any:
        """OpenAI's list of content parts -> their text, joined by newlines as vLLM does; parts
        of other types are refused."""
        return content_text(content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: the rest of the context (or of the KV pool)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the N most likely tokens at each position

    def to_sampling_params(self, room: int) -> SamplingParams:
        """`room`: the tokens the context (or the KV pool) leaves after the prompt, the
        default max_tokens."""
        given = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if given else self.max_tokens
        if max_tokens is None:
            max_tokens = max(1, room)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={self.top_logprobs}: must be in [0, "
                           f"{MAX_LOGPROBS}]", param="top_logprobs")
        try:
            return self.sampling_params(max_tokens,
                                        (self.top_logprobs or 0) if self.logprobs else None)
        except APIError as error:
            if given and error.param == "max_tokens":
                error.param = "max_completion_tokens"
            raise


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages through the chat template; `return_token_strs`
    adds each token's string (null is false, as vLLM's `bool | None`)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def refused(kind: type[SamplingRequest]) -> dict[str, tuple[Any, ...]]:
    """The known fields a request kind cannot honour, each with the values that mean "off":
    NOT_IMPLEMENTED's, and the SamplingParams fields the kind does not take (prompt_logprobs:
    echo asks for it), less the kind's own fields."""
    own = set(kind.model_fields)
    return {name: neutral for name, neutral in
            {**{name: () for name in _PARAMS}, **NOT_IMPLEMENTED}.items() if name not in own}


for _kind in (CompletionRequest, ChatRequest):
    _kind.REFUSED = refused(_kind)


def refuse_unsupported(req: SamplingRequest) -> None:
    """An APIError naming the first field of `req` its kind refuses and that holds a value
    other than "off" (also best_of other than n, and continuous_usage_stats, which this server
    does not stream)."""
    extra = req.model_extra or {}
    for name, neutral in req.REFUSED.items():
        if name in extra and not asks_nothing(extra[name], neutral):
            raise APIError(400, f"{name}={extra[name]!r} is not supported by this server",
                           param=name)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise APIError(400, f"best_of={best_of} is not supported (only best_of == n)",
                       param="best_of")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise APIError(400, "stream_options.continuous_usage_stats=true is not supported by this "
                       "server (usage comes in the last chunk, with include_usage)",
                       param="stream_options")


class UnknownFields:
    """Logs each request field this server does not know, once per name."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def check(self, req: SamplingRequest) -> None:
        names = (req.model_extra or {}).keys() - req.REFUSED.keys()
        if req.stream_options is not None:
            names |= {f"stream_options.{k}" for k in req.stream_options.model_extra or {}}
        for name in names - self.seen:
            self.seen.add(name)
            log.warning("ignoring the unknown request field %r (reported once)", name)
