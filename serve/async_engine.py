"""The engine on a background thread, for asyncio callers (the HTTP server).

The engine is not thread-safe, so one thread owns it: it takes new requests and aborts from a
command queue, runs `engine.step()` while there is work, and hands each request's updates to
the asyncio loop that asked for them. A request whose part of a step raises fails alone (its
caller gets `RequestFailed`, its blocks are freed; the step's other requests go on) and the
thread goes on serving. Callers never touch the engine directly:

    engine = AsyncEngine(llm).start()
    async for update in engine.submit(prompt_ids, SamplingParams(stop=["\\n"])):
        ...   # RequestUpdate: new text and tokens per sample; the last one has finished=True
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from serve.engine import EngineMetrics, InvalidRequest, SamplingParams, StepFailed
from serve.llm import LLM
from serve.outputs import RequestUpdate

log = logging.getLogger("serve")


class QueueFull(RuntimeError):
    """The server holds as many requests as it accepts; try again later (HTTP 503)."""


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

    def abort(self) -> None:
        """Stop the request and free its blocks (nothing happens if it already finished)."""
        if not self.finished:
            self._owner._abort(self)

    def _put(self, item: RequestUpdate | BaseException) -> None:  # from the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; the request is aborted below
            self._owner._abort(self)

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
                self._owner._abort(self)


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
        self._accepted = 0  # submitted and not yet finished (guarded by _lock)
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

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if this request could never run (reads only fixed settings)."""
        self.engine.check_request(prompt, params)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold here."""
        return self.engine.max_request_tokens

    def submit(self, prompt: list[int], params: SamplingParams,
               stream: bool = False) -> RequestStream:
        """Queue a request. Raises InvalidRequest (bad request), QueueFull or EngineDead now, so
        the caller can answer before streaming anything."""
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        if self.draining:
            raise Draining("the server is shutting down")
        self.check_request(prompt, params)
        with self._lock:
            if self._accepted >= self.capacity:
                raise QueueFull(f"the server holds {self._accepted} requests, its limit")
            self._accepted += 1
        handle = RequestStream(self, asyncio.get_running_loop())
        self._commands.put(("add", handle, prompt, params, stream))
        self._wake.set()
        return handle

    def _abort(self, handle: RequestStream) -> None:
        self._commands.put(("abort", handle))
        self._wake.set()

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
                with self._lock:
                    self._accepted -= 1
                handle._put(RequestFailed(message, status))

    def _drain_commands(self) -> None:
        while True:
            try:
                command, handle, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                prompt, params, stream = args
                try:
                    handle.request_id = self.engine.add_request(prompt, params)
                except Exception as error:  # noqa: BLE001 - submit() checked; kept for safety
                    with self._lock:
                        self._accepted -= 1
                    handle._put(error if isinstance(error, InvalidRequest)
                                else RequestFailed(f"{type(error).__name__}: {error}"))
                    continue
                self._streams[handle.request_id] = handle
                self.llm.outputs.add(handle.request_id, stream)
            elif command == "abort_all":
                self._fail(list(self._streams), args[0], status=503)
            elif handle.request_id in self._streams:  # abort of a request still running
                self.llm.outputs.abort(handle.request_id)

    def _deliver(self, update: RequestUpdate) -> None:
        handle = self._streams.get(update.request_id)
        if update.finished:
            self._streams.pop(update.request_id, None)
            with self._lock:
                self._accepted -= 1
            for listener in self.on_finish:
                listener(update)
        if handle is not None:
            handle._put(update)

    def _publish(self) -> None:
        self.snapshot = self.engine.snapshot(now=False)  # counters only: this runs every step
