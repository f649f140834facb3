"""From engine token ids to what a caller sees: text, stop strings, streamed deltas.

The Python API (`LLM.generate`) and the HTTP server both drive the engine through one
`OutputProcessor`, so they cut stop strings at the same token and return the same text.

Streaming releases text only when it is final: a trailing U+FFFD (the first bytes of a character
still being generated) and any tail that could be the start of a stop string are held back until
the next token settles them, so a client never receives text that is later cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from serve.engine import LLMEngine

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


class TextStream:
    """The text of one sample as its tokens arrive: stop strings applied, deltas safe to send."""

    def __init__(self, decode: Decode, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decode, self._stop = decode, [s for s in stop if s]
        self._skip = skip_special_tokens
        self.sent = ""  # text released so far
        self.stopped = False  # a stop string was found; the text ends before it
        self.hit: str | None = None  # that stop string

    def update(self, token_ids: list[int], final: bool) -> str:
        """Decode the sample's tokens so far; return the newly releasable text."""
        text = self._decode(token_ids, self._skip)
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            at, self.hit = min(hits)
            text, self.stopped, final = text[:at], True, True
        if not final:
            text = text[: len(text) - self._unsettled_tail(text)]
        if not text.startswith(self.sent):
            # Decoding is not always prefix-stable (rare tokenizer normalizations): release
            # nothing new rather than repeat or contradict what was sent.
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _unsettled_tail(self, text: str) -> int:
        """Characters at the end of `text` that the next token may still change or cut."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held


@dataclass
class SampleDelta:
    index: int  # the sample's place among the request's n
    text: str  # new text released by this step
    token_ids: list[int]  # new tokens since the last update
    finish_reason: str | None = None  # "stop", "length" or "abort" once it finished
    ttft: float | None = None  # seconds to the first token (final outputs only)
    tpot: float | None = None  # seconds per output token after the first (final outputs only)
    # Final outputs only: the stop token id or stop string that ended it. With logprobs
    # requested, each token's {token id: (logprob, rank)} (serve.engine.Sequence): of the new
    # tokens in a delta, of every token in a final output, with their sum (final only).
    stop_reason: int | str | None = None
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    cumulative_logprob: float | None = None
    e2e: float | None = None  # seconds from arrival to the last token (final outputs only)
    queue_time: float | None = None  # seconds waiting before first scheduled (final only)


@dataclass
class RequestUpdate:
    request_id: int
    prompt_tokens: int
    deltas: list[SampleDelta]
    finished: bool = False
    # On the last update: each sample's whole text and tokens, by index.
    outputs: list[SampleDelta] = field(default_factory=list)
    cached_tokens: int = 0  # on the last update: prompt tokens served from the prefix cache
    # On the last update, with prompt_logprobs asked: per prompt token {id: (logprob, rank)}.
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


@dataclass
class _Tracked:
    stop: list[str]
    stream: bool
    prompt_tokens: int
    skip_special_tokens: bool = True
    texts: dict[int, TextStream] = field(default_factory=dict)  # seq id -> its text
    tokens_seen: dict[int, int] = field(default_factory=dict)  # seq id -> tokens reported


class OutputProcessor:
    """Follows requests through the engine: call `process()` after every `engine.step()`."""

    def __init__(self, engine: LLMEngine, decode: Decode) -> None:
        self.engine, self._decode = engine, decode
        self._tracked: dict[int, _Tracked] = {}

    def add(self, request_id: int, stream: bool = False) -> None:
        """Track a request added to the engine (its stop strings are its SamplingParams');
        `stream` asks for text deltas on every step."""
        first = self.engine.samples(request_id)[0]
        self._tracked[request_id] = _Tracked(list(first.params.stop), stream, len(first.prompt),
                                             first.params.skip_special_tokens)

    def process(self) -> list[RequestUpdate]:
        """New tokens and text of every tracked request; finished ones are released from the
        engine and forgotten here after their last update."""
        updates = []
        for rid, t in list(self._tracked.items()):
            deltas = []
            for index, seq in enumerate(self.engine.samples(rid)):
                seq_id, done = seq.seq_id, seq.finish_reason is not None
                seen = t.tokens_seen.get(seq_id, 0)
                if len(seq.output) == seen and not (done and seq_id not in t.texts):
                    continue
                t.tokens_seen[seq_id] = len(seq.output)
                text = ""
                if t.stream or t.stop or done:
                    stream = t.texts.setdefault(
                        seq_id, TextStream(self._decode, t.stop, t.skip_special_tokens))
                    text = stream.update(seq.output, final=done)
                    if stream.stopped:  # ends it now, or relabels a last token's "length"
                        self.engine.stop_sample(seq_id)
                made = len(seq.output)
                deltas.append(SampleDelta(
                    index, text, seq.output[seen:made], seq.finish_reason,
                    logprobs=None if seq.logprobs is None else seq.logprobs[seen:made]))
            finished = self.engine.is_finished(rid)
            if not deltas and not finished:
                continue
            update = RequestUpdate(rid, t.prompt_tokens, deltas, finished)
            if finished:
                for index, seq in enumerate(self.engine.release(rid)):
                    if index == 0:
                        update.cached_tokens = seq.cached_tokens or 0
                        update.prompt_logprobs = seq.prompt_logprobs
                    text = t.texts[seq.seq_id]
                    stop_reason = text.hit if text.stopped else seq.stop_reason
                    update.outputs.append(SampleDelta(index, text.sent, list(seq.output),
                                                      seq.finish_reason, seq.ttft, seq.tpot,
                                                      stop_reason, seq.logprobs,
                                                      seq.cumulative_logprob, seq.e2e,
                                                      seq.queue_time))
                del self._tracked[rid]
            updates.append(update)
        return updates

    def abort(self, request_id: int) -> None:
        """Abort a tracked request; its final update comes from the next `process()`."""
        if request_id in self._tracked:
            self.engine.abort(request_id)

    def discard(self, request_ids: list[int], reason: str = "error") -> None:
        """End these requests now, outside `process()` (a failed step, a shutdown, a caller
        that gave up): live samples finish with `reason`, their blocks are freed, and the
        requests are released from the engine and forgotten here, with no final update."""
        engine = self.engine
        engine.fail([rid for rid in request_ids if engine.has_request(rid)], reason)
        for rid in request_ids:
            self._tracked.pop(rid, None)
            if engine.has_request(rid) and engine.is_finished(rid):
                engine.release(rid)
