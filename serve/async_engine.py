"""The engine on a background thread, for asyncio callers (the HTTP server).

The engine is not thread-safe, so one thread owns it: it takes new requests and aborts from a
command queue, runs `engine.step()` while there is work, and hands each request's updates to
the asyncio loop that asked for them. A request whose part of a step raises fails alone (its
caller gets `RequestFailed`, its blocks are freed; the step's other requests go on) and the
thread goes on serving. Callers never touch the engine directly:

    engine = AsyncEngine(llm).start()
    async for update in engine.submit(prompt_ids, SamplingParams(stop=["\\n"])):
        ...   # RequestUpdate: new text and tokens per sample; the last one has finished=True

Admission is all or nothing and decided on the caller's side, before anything is queued: the
prompts of one HTTP request (`submit_all`) are checked, then take their places in the queue at
once or not at all, and reach the engine thread as one command (added together, between two
steps). Aborting them (`abort`) is one command too, and gives their places back at once,
without waiting for the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from serve.engine import StepFailed
from serve.metrics import EngineMetrics
from serve.sampling import InvalidRequest, SamplingParams
from serve.llm import LLM
from serve.outputs import RequestUpdate, StopStrings

log = logging.getLogger("serve")


class QueueFull(RuntimeError):
    """The server holds too many requests to take these now; try again later (HTTP 503). (More
    prompts than it can ever hold at once are an InvalidRequest instead.)"""


class EngineDead(RuntimeError):
    """The engine thread stopped; no request can complete."""


class Draining(RuntimeError):
    """The server is shutting down: it finishes what it has and admits nothing new (HTTP 503)."""


class RequestFailed(RuntimeError):
    """This request ended without a result: a step it was in raised (`status` 500), or the
    server aborted it while shutting down (503). The engine carries on with the others."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class RequestStream:
    """One request's updates, read with `async for`; closing it early aborts the request."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._owner, self._loop = owner, loop
        self._queue: asyncio.Queue[RequestUpdate | BaseException] = asyncio.Queue()
        self.request_id: int | None = None  # set by the engine thread when it adds the request
        self.finished = False
        self._holds_place = True  # counted in the owner's queue (guarded by the owner's lock)

    def abort(self) -> None:
        """Stop the request and free its blocks (nothing happens if it already finished)."""
        self._owner.abort([self])

    def _put(self, item: RequestUpdate | BaseException) -> None:  # from the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; the request is aborted below
            self._owner.abort([self])

    def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestUpdate]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:  # the consumer stopped early (client disconnected)
                self._owner.abort([self])


class AsyncEngine:
    def __init__(self, llm: LLM, max_queued_requests: int = 256) -> None:
        """`max_queued_requests`: requests accepted beyond `max_num_seqs` before answering
        QueueFull. Callables in `on_finish` run on the engine thread with every request's last
        update (the server's latency histograms)."""
        self.llm, self.engine = llm, llm.engine
        self.capacity = self.engine.config.max_num_seqs + max_queued_requests
        # the engine's metrics after its latest step, for readers on other threads (/metrics)
        self.snapshot: EngineMetrics = self.engine.snapshot(now=False)
        self.on_finish: list[Callable[[RequestUpdate], None]] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # engine request id -> its stream
        self._accepted = 0  # places taken: submitted, not yet finished or aborted (under _lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="egmla-engine", daemon=True)
        self.error: BaseException | None = None
        self.draining = False  # set by drain(): admit nothing new

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet answered."""
        with self._lock:
            return self._accepted

    def drain(self) -> None:
        """Admit nothing new (submit raises Draining); requests in flight go on."""
        self.draining = True

    def abort_all(self, message: str) -> None:
        """End every request in flight now: their callers get RequestFailed(message, 503)."""
        self._commands.put(("abort_all", None, message))
        self._wake.set()

    # ---- caller side (any thread with a running asyncio loop) --------------------------------

    def check_request(self, prompt: list[int], params: SamplingParams,
                      score_prompt: bool = False) -> None:
        """Raise InvalidRequest if this request could never run (reads only fixed settings)."""
        self.engine.check_request(prompt, params, score_prompt)

    def check_prompt_count(self, count: int) -> None:
        """Raise InvalidRequest if `count` prompts (one request each) can never be held here
        at once: they are admitted together or not at all."""
        if count > self.capacity:
            raise InvalidRequest(
                f"{count} prompts in one request: more than the {self.capacity} requests this "
                f"server can hold at once (max_num_seqs {self.engine.config.max_num_seqs} + "
                f"max_queued_requests {self.capacity - self.engine.config.max_num_seqs}); send "
                f"at most {self.capacity}", "prompt")

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold here."""
        return self.engine.max_request_tokens

    def submit(self, prompt: list[int], params: SamplingParams, stream: bool = False,
               stops: StopStrings | None = None) -> RequestStream:
        """Queue a request; `submit_all` with one prompt."""
        return self.submit_all([prompt], params, stream, stops)[0]

    def submit_all(self, prompts: list[list[int]], params: SamplingParams, stream: bool = False,
                   stops: StopStrings | None = None,
                   score_prompt: bool = False) -> list[RequestStream]:
        """Queue one request per prompt, all or none. Raises now, with nothing queued, so the
        caller can answer before streaming anything: InvalidRequest if they could never run
        here (a prompt that never fits, or more prompts than the server ever holds at once),
        QueueFull if they do not fit now, Draining, EngineDead. `stops`: the automaton of
        params.stop, built here (off the engine thread) unless the caller built it already;
        `score_prompt`: see LLMEngine.check_request."""
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        if self.draining:
            raise Draining("the server is shutting down")
        self.check_prompt_count(len(prompts))
        for prompt in prompts:
            self.check_request(prompt, params, score_prompt)
        with self._lock:
            if self._accepted + len(prompts) > self.capacity:
                raise QueueFull(f"the server holds {self._accepted} of the {self.capacity} "
                                f"requests it takes; these {len(prompts)} do not fit now")
            self._accepted += len(prompts)
        loop = asyncio.get_running_loop()
        handles = [RequestStream(self, loop) for _ in prompts]
        if stops is None:
            stops = StopStrings(params.stop)
        self._commands.put(("add", handles, prompts, params, stream, stops, score_prompt))
        self._wake.set()
        return handles

    def abort(self, streams: list[RequestStream]) -> None:
        """Stop these requests and free their blocks, in one command (no step runs some of
        them without the others); their places in the queue are free at once. Finished ones
        are left as they are."""
        live = [s for s in streams if not s.finished]
        if not live:
            return
        self._commands.put(("abort", live))  # before the places are freed: a request that takes
        self._wake.set()  # one is queued behind this abort, so the engine never holds too many
        self._give_back(live)

    def _give_back(self, streams: list[RequestStream]) -> None:
        """Free the queue places these requests hold (once each: any thread may call this)."""
        with self._lock:
            for stream in streams:
                if stream._holds_place:
                    stream._holds_place = False
                    self._accepted -= 1

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except StepFailed as error:  # the engine has ended those requests already
                    log.error("%s", error, exc_info=error.__cause__)
                    for rid, reason in error.reasons.items():
                        self._fail([rid], f"the engine failed while running this request: "
                                          f"{reason}")
                except Exception as error:  # noqa: BLE001 - outside a step: state unknown
                    log.exception("engine loop error; ending every request in flight")
                    self._fail(list(self._streams), f"the engine failed: "
                                                    f"{type(error).__name__}: {error}")
                    self._wake.wait(timeout=0.1)  # no busy loop should the error persist
        except BaseException as error:  # every waiting caller must hear of it
            log.exception("engine thread stopped")
            self.error = error
            for handle in self._streams.values():
                handle._put(EngineDead(f"the engine stopped: {error!r}"))

    def _iterate(self) -> None:
        self._drain_commands()
        if self.engine.has_unfinished():
            self.engine.step()
        for update in self.llm.outputs.process():
            self._deliver(update)
        self._publish()
        if not self.engine.has_unfinished() and self._commands.empty():
            self._wake.wait(timeout=0.5)
            self._wake.clear()

    def _fail(self, request_ids: list[int], message: str, status: int = 500) -> None:
        """End these requests without a result: free their blocks, tell their callers."""
        self.llm.outputs.discard(request_ids, "error" if status == 500 else "abort")
        for rid in request_ids:
            handle = self._streams.pop(rid, None)
            if handle is not None:
                self._give_back([handle])
                handle._put(RequestFailed(message, status))

    def _drain_commands(self) -> None:
        while True:
            try:
                command, handle, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._add(handle, *args)
            elif command == "abort_all":
                self._fail(list(self._streams), args[0], status=503)
            else:  # abort: of requests still running (or finished meanwhile)
                for stream in handle:
                    if stream.request_id in self._streams:
                        self.llm.outputs.abort(stream.request_id)

    def _add(self, handles: list[RequestStream], prompts: list[list[int]],
             params: SamplingParams, stream: bool, stops: StopStrings, score_prompt: bool) -> None:
        """Add a request's prompts to the engine, all or (should one fail) none."""
        added: list[int] = []
        try:
            for handle, prompt in zip(handles, prompts):
                handle.request_id = self.engine.add_request(prompt, params, score_prompt)
                added.append(handle.request_id)
        except Exception as error:  # noqa: BLE001 - submit_all checked them; kept for safety
            self.llm.outputs.discard(added, "abort")  # none of them has run
            self._give_back(handles)
            for handle in handles:
                handle._put(error if isinstance(error, InvalidRequest)
                            else RequestFailed(f"{type(error).__name__}: {error}"))
            return
        for handle in handles:
            self._streams[handle.request_id] = handle
            self.llm.outputs.add(handle.request_id, stream, stops)

    def _deliver(self, update: RequestUpdate) -> None:
        handle = self._streams.get(update.request_id)
        if update.finished:
            self._streams.pop(update.request_id, None)
            if handle is not None:
                self._give_back([handle])
            for listener in self.on_finish:
                listener(update)
        if handle is not None:
            handle._put(update)

    def _publish(self) -> None:
        self.snapshot = self.engine.snapshot(now=False)  # counters only: this runs every step
