"""A real uvicorn server over an `LLM`, on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from serve import LLM
from serve.server import build_app
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_by_cli(args: list[str], cwd: Path, env: dict | None = None, tries: int = 600):
    """`python -m serve ARGS --port P` in a real subprocess, waited for until /health answers;
    yields (base URL, the process); terminated at the end."""
    from support import ROOT

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", *args, "--port", str(port)], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(tries):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=60).status_code == 200:
                    break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
