"""Graceful shutdown for `python -m serve`: drain the engine, with a bound, then stop.

uvicorn on its own waits for every open connection without a bound, and re-raises the signal
afterwards, so a server with long streams in flight neither exits promptly nor runs its cleanup.
`DrainingServer` replaces that: on the first SIGTERM or SIGINT new requests get 503 (and
/health 503), running ones have `shutdown_timeout` seconds to finish, then the rest are ended
(503, or an error event in their stream) and the server stops; a second signal skips the wait.
The signal is not re-raised, so `main` closes the engine, logs its statistics and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

import uvicorn

from serve.async_engine import AsyncEngine

log = logging.getLogger("serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.drain_deadline: float | None = None  # set by the first signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals: main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.drain_deadline is not None:
            self.drain_deadline = 0.0  # a second signal: stop waiting
            return
        self.drain_deadline = time.monotonic() + self.shutdown_timeout
        self.engine.drain()
        log.info("%s: admitting no new requests; %d in flight get up to %.4g s to finish",
                 signal.Signals(sig).name, self.engine.in_flight, self.shutdown_timeout)

    async def on_tick(self, counter: int) -> bool:
        """Called by uvicorn's main loop every 0.1 s; True stops the server."""
        if self.drain_deadline is None:
            return await super().on_tick(counter)
        left = self.engine.in_flight
        if left and time.monotonic() < self.drain_deadline:
            return False
        if left:  # uvicorn's shutdown then waits (timeout_graceful_shutdown) for their responses
            log.warning("shutdown timeout: ending %d request(s) still in flight", left)
            self.engine.abort_all("the server is shutting down")
        return True
