"""From engine token ids to what a caller sees: text, stop strings, streamed deltas.

The Python API (`LLM.generate`) and the HTTP server both drive the engine through one
`OutputProcessor`, so they cut stop strings at the same token and return the same text.

Streaming releases text only when it is final: a trailing U+FFFD (the first bytes of a character
still being generated) and any tail that could be the start of a stop string are held back until
the next token settles them, so a client never receives text that is later cut.

Stop strings are matched by `StopStrings`, fed only the characters that are new at each step:
a step costs about the same with one stop string or 100,000.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from serve.engine import LLMEngine

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


class StopStrings:
    """A request's stop strings, prepared once and shared by its prompts and samples (each
    reads its text with a `StopCursor`), answering at every character read, without looking
    at each stop string:

    - where does the longest suffix of the text that begins some stop string start (what a
      stream holds back)? A string begins one when a binary search of the sorted strings
      lands on one that starts with it (`begins`). As the text grows, that start only moves
      forward (if text[s:t+1] begins a stop string, so does text[s:t]), so each character
      costs one search plus one per step the start moves: at most two per character, amortized.
      This is the state of an Aho-Corasick automaton, found by searching instead of by failure
      links, which would have to be built for the whole trie (4 million nodes for 100,000
      strings of 40 characters) or, built lazily, can be made to cost a link per character of
      a stop string at every character read.
    - which is the longest stop string that ends here (`ending`)? It is no longer than that
      suffix. A binary search of the suffix, reversed, in the sorted reversed strings: its
      predecessor x there is either a prefix of it (the answer) or shares m characters with
      it; then the answer is the first string that starts with those m characters if it has
      length m, else that string's longest proper prefix among the strings (`_inner`, found
      for every string at build). Three binary searches at most.

    Each search compares strings in C, a comparison as long as the common prefix: a
    character's cost grows with the number of stop strings only logarithmically and with the
    text only through the part that could still begin a stop string. The one costly case is a
    long partial match that then breaks: k characters that begin some stop string followed by
    one that ends them all move the start k times in one step, each search comparing up to k
    characters (k^2 log n in C; measured 5 ms for k = 2,000 and one such string, 150 ms for
    k = 8,000 and 200 of them sharing it), after k characters of text that set it up.
    Building is a set and two sorts (about 0.2 s of CPU for 100,000 strings of 40 characters),
    and one pass over the strings when some are prefixes of others. It runs off the engine
    thread but shares the GIL with it, so no step of it holds the GIL for long: the sorts go by
    slices of `SLICE` strings, merged by a Python-level generator (one sort of 100,000 strings
    is one C call of 30 ms or more, during which the engine thread could not run a line).

        stops = StopStrings(["cde", "de"])
        cursor = stops.cursor()
        cursor.feed("abc")    # (None, 1): no stop string yet; "c" may begin "cde"
        cursor.feed("abcd")   # (None, 2): "cd" may too
        cursor.feed("abcde")  # ((2, "cde"), 0): "cde" starts at 2 ("de" ends there too, from 3)
    """

    SLICE = 8192

    def __init__(self, stop: Iterable[str]) -> None:
        stop, unique = list(stop), set()
        for i in range(0, len(stop), self.SLICE):
            unique.update(stop[i:i + self.SLICE])
        unique.discard("")  # an empty stop string stops nothing (as before)
        self.strings = _sorted_by_slices(list(unique), self.SLICE)
        self._ends = _sorted_by_slices([s[::-1] for s in self.strings], self.SLICE)
        self._inner = _longest_inner_prefixes(self._ends, self.SLICE)
        self.shortest = min(map(len, self.strings), default=0)

    def __len__(self) -> int:
        return len(self.strings)

    def cursor(self) -> StopCursor:
        return StopCursor(self)

    def begins(self, piece: str) -> bool:
        """Some stop string starts with `piece`."""
        i = bisect_left(self.strings, piece)
        return i < len(self.strings) and self.strings[i].startswith(piece)

    def ending(self, piece: str) -> int:
        """The length of the longest stop string that ends `piece` (0: none)."""
        ends, w = self._ends, piece[::-1]
        i = bisect_right(ends, w)
        if i == 0:
            return 0
        x = ends[i - 1]
        if w.startswith(x):
            return len(x)
        m = _common_prefix(x, w)
        if m == 0:
            return 0
        lo = bisect_left(ends, w[:m], 0, i)
        if len(ends[lo]) == m:
            return m
        inner = self._inner[lo]
        return 0 if inner < 0 else len(ends[inner])


def _sorted_by_slices(strings: list[str], size: int) -> list[str]:
    """sorted(strings), no C call of it longer than sorting `size` of them (the merge is a
    Python-level generator: about twice the CPU of one sort, in steps that let other threads
    run)."""
    runs = [sorted(strings[i:i + size]) for i in range(0, len(strings), size)]
    return runs[0] if len(runs) == 1 else list(heapq.merge(*runs))


def _longest_inner_prefixes(strings: list[str], size: int) -> list[int]:
    """For each of these sorted strings, the index of the longest other one that is a prefix
    of it, or -1. A string's prefixes among them sort just before it, so one pass with a stack
    of the current string's prefixes finds them all (skipped when no string is a prefix of
    another: the shortest such prefix would be a prefix of its successor)."""
    inner = [-1] * len(strings)
    if not any(any(map(str.startswith, strings[i + 1:i + 1 + size], strings[i:i + size]))
               for i in range(0, len(strings), size)):
        return inner
    stack: list[int] = []
    for j, s in enumerate(strings):
        while stack and not s.startswith(strings[stack[-1]]):
            stack.pop()
        if stack:
            inner[j] = stack[-1]
        stack.append(j)
    return inner


def _common_prefix(a: str, b: str) -> int:
    """The length of a's and b's common prefix (a binary search of C-level comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class StopCursor:
    """One sample's reading of its text against `StopStrings`. `feed(text)` takes the whole
    text so far and reads only what is new since the last call; when decoding changed earlier
    characters (a U+FFFD completed, a tokenizer normalization), it goes back to the last
    unchanged one, so its answers are always those for the text as it is now."""

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self._text = ""  # the text read so far
        # _starts[i]: where the longest suffix of text[:i] that begins a stop string starts
        self._starts = [0]

    def feed(self, text: str) -> tuple[tuple[int, str] | None, int]:
        """((where, which): the earliest-starting stop string in `text`, the shortest at that
        start; or None) and how many trailing characters of `text` could still begin one."""
        old, stops = self._text, self.stops
        same = len(old) if text.startswith(old) else _common_prefix(old, text)
        del self._starts[same + 1:]
        start, best = self._starts[same], None
        for end in range(same + 1, len(text) + 1):  # read text[end - 1]
            piece = text[start:end]
            while piece and not stops.begins(piece):
                start += 1
                piece = text[start:end]
            self._starts.append(start)
            if len(piece) >= stops.shortest:  # no stop string ending here is longer
                length = stops.ending(piece)
                # a later end at the same start is a longer stop string: keep the first
                if length and (best is None or end - length < best[0]):
                    best = (end - length, end)
        self._text = text
        if best is not None:
            return (best[0], text[best[0]:best[1]]), 0
        return None, len(text) - start


class TextStream:
    """The text of one sample as its tokens arrive: stop strings applied, deltas safe to send."""

    def __init__(self, decode: Decode, stop: Sequence[str] | StopStrings = (),
                 skip_special_tokens: bool = True) -> None:
        stops = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._decode, self._cursor = decode, stops.cursor() if stops else None
        self._skip = skip_special_tokens
        self.sent = ""  # text released so far
        self.stopped = False  # a stop string was found; the text ends before it
        self.hit: str | None = None  # that stop string

    def update(self, token_ids: list[int], final: bool) -> str:
        """Decode the sample's tokens so far; return the newly releasable text."""
        if self.stopped:
            return ""
        text = self._decode(token_ids, self._skip)
        held = 0
        if self._cursor is not None:
            hit, held = self._cursor.feed(text)
            if hit is not None:
                at, self.hit = hit
                text, self.stopped, final = text[:at], True, True
        if not final:
            # a trailing U+FFFD is the first bytes of a character the next token completes
            held = max(held, len(text) - len(text.rstrip("\ufffd")))
            text = text[: len(text) - held]
        if not text.startswith(self.sent):
            # Decoding is not always prefix-stable (rare tokenizer normalizations): release
            # nothing new rather than repeat or contradict what was sent.
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


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
    stop: StopStrings
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
        self._last_stops: tuple[tuple[str, ...], StopStrings] | None = None

    def add(self, request_id: int, stream: bool = False, stops: StopStrings | None = None) -> None:
        """Track a request added to the engine; `stream` asks for text deltas on every step.
        Its stop strings are its SamplingParams', given as `stops` when the caller built them
        already (the server does, off the engine thread)."""
        first = self.engine.samples(request_id)[0]
        if stops is None:
            stops = self._stops_of(first.params.stop)
        self._tracked[request_id] = _Tracked(stops, stream, len(first.prompt),
                                             first.params.skip_special_tokens)

    def _stops_of(self, stop: tuple[str, ...]) -> StopStrings:
        """The automaton of these stop strings, built once for the prompts of one
        `LLM.generate` call (they share one SamplingParams, so one tuple)."""
        if self._last_stops is None or self._last_stops[0] is not stop:
            self._last_stops = (stop, StopStrings(stop))
        return self._last_stops[1]

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
                    stream = t.texts.get(seq_id)
                    if stream is None:
                        stream = t.texts[seq_id] = TextStream(self._decode, t.stop,
                                                              t.skip_special_tokens)
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
