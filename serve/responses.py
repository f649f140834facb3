"""OpenAI-shaped responses from a request's updates: whole or streamed (server-sent events), for
completions and chat completions, with the logprob layouts each takes (`completion_logprobs`:
the legacy tokens / token_logprobs / top_logprobs / text_offset; `chat_logprobs`: per token its
text, logprob, bytes and top_logprobs).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from serve.async_engine import AsyncEngine, EngineDead, RequestFailed, RequestStream
from serve.outputs import RequestUpdate
from serve.protocol import APIError, SamplingRequest

Steps = list  # per token {token id: (logprob, rank)}, or None (a prompt's first token)


def completion_logprobs(token_text: Callable[[int], str], tokens: list[int], steps: Steps,
                        top: int, at: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (the `top` most
    likely, as text -> logprob), text_offset (counted from `at`: a streamed chunk's offsets
    continue the earlier chunks')."""
    names = [token_text(t) for t in tokens]
    offsets = []
    for name in names:
        offsets.append(at)
        at += len(name)
    return {"tokens": names,
            "token_logprobs": [None if s is None else s[t][0] for t, s in zip(tokens, steps)],
            "top_logprobs": [None if s is None else {
                token_text(i): lp for i, (lp, rank) in s.items() if rank <= top}
                for s in steps],
            "text_offset": offsets}


def chat_logprobs(token_text: Callable[[int], str], tokens: list[int], steps: Steps,
                  top: int) -> dict:
    """The chat shape: per token its text, logprob and UTF-8 bytes, and its `top` most likely."""
    def item(i: int, lp: float) -> dict:
        name = token_text(i)
        return {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8"))}
    return {"content": [{**item(t, s[t][0]), "top_logprobs": [
        item(i, lp) for i, (lp, rank) in sorted(s.items(), key=lambda e: e[1][1])
        if rank <= top]} for t, s in zip(tokens, steps)]}


class Reply:
    """Builds OpenAI-shaped responses (whole or streamed) from the requests' updates."""

    def __init__(self, prefix: str, obj: str, model: str, req: SamplingRequest, chat: bool,
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

    def _completion_logprobs(self, tokens: list[int], steps: Steps, at: int = 0) -> dict:
        return completion_logprobs(self._token, tokens, steps, self.req.logprobs, at)

    def _chat_logprobs(self, tokens: list[int], steps: Steps) -> dict:
        return chat_logprobs(self._token, tokens, steps, self.req.top_logprobs or 0)

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
        gone = asyncio.ensure_future(disconnected(request))
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


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

