"""A real uvicorn server over an `LLM`, on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from serve import LLM
from serve.api import build_app
from serve.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def serving(llm: LLM, name: str = MODEL, app_kwargs: dict | None = None, **engine_kwargs):
    """A real uvicorn server for `llm` on a free loopback port; yields its base URL."""
    engine = AsyncEngine(llm, **engine_kwargs).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_app(engine, name, **(app_kwargs or {}))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()
        sock.close()
