"""The OpenAI-compatible server, exercised with the official `openai` client over loopback.

One real uvicorn server on a free port serves SmolLM2-135M-Instruct; a second `LLM` over the same
weights is the Python-API reference. A tiny random model serves the queue and CLI tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from egmla.checkpoint import save_export
from egmla.models import Transformer
from egmla.presets import preset
from serve import LLM, SamplingParams
from serve.api import build_app
from serve.async_engine import AsyncEngine

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def serving(llm: LLM, name: str = MODEL, **engine_kwargs):
    """A real uvicorn server for `llm` on a free loopback port; yields its base URL."""
    engine = AsyncEngine(llm, **engine_kwargs).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, name), log_level="warning"))
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


@pytest.fixture(scope="module")
def smollm2(smollm2_llm):
    return smollm2_llm  # the Python-API reference


@pytest.fixture(scope="module")
def server(smollm2):
    served = LLM(smollm2.model, smollm2.tokenizer, num_blocks=1024, max_num_seqs=32)
    with serving(served) as url:
        yield url, served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_the_python_api(smollm2, client, stream):
    expected = smollm2.generate(PROMPTS, SamplingParams(max_tokens=24))
    for prompt, ref in zip(PROMPTS, expected):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        if stream:
            chunks = list(client.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            reply = client.completions.create(**kwargs)
            text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
        assert text == ref.outputs[0].text
        assert finish == ref.outputs[0].finish_reason
        assert usage.prompt_tokens == len(ref.prompt_token_ids)
        assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert "Paris" in expected[0].outputs[0].text


@pytest.mark.slow
def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(smollm2, client):
    prompts = ["Here is a long shared system prompt about Python code. " * 4 + tail
               for tail in ("First question?", "Second question?")]
    ids = [smollm2.tokenizer.encode(p) for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    block = smollm2.engine.config.block_size
    usage = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage for p in prompts]
    assert usage[1].prompt_tokens_details.cached_tokens == shared // block * block
    assert 0 < usage[1].prompt_tokens_details.cached_tokens < usage[1].prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_the_python_api_with_stop_strings(smollm2, client, stream):
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    for stop in (None, ["return"]):
        ref = smollm2.chat(messages, SamplingParams(max_tokens=40), stop=stop)[0].outputs[0]
        kwargs = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop)
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            reply = client.chat.completions.create(**kwargs)
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text == ref.text and finish == ref.finish_reason
    assert "def " in text and "return" not in text and finish == "stop"


@pytest.mark.slow
def test_n_samples_and_prompt_batches_are_indexed_like_openai(smollm2, client):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, n=2,
                                      temperature=0.8, seed=5)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    same = smollm2.generate(PROMPTS[:2], SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=5))
    assert [c.text for c in reply.choices] == [o.text for r in same for o in r.outputs]
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for r in same for o in r.outputs)


@pytest.mark.slow
def test_32_concurrent_streams_each_get_their_own_tokens(smollm2, server):
    prompts = [f"Item {i}: the number {i} written in words is" for i in range(32)]
    expected = [r.outputs[0].text for r in smollm2.generate(prompts, SamplingParams(max_tokens=12))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected
    assert server[1].engine.stats.peak_running > 1  # they really ran batched together


BAD = [  # (body changes, status, param)
    ({"model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"n": 10_000}, 400, "n"),
    ({"prompt": "word " * 9000}, 400, "prompt"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
    ({"logprobs": 5}, 400, "logprobs"),
]


@pytest.mark.slow
@pytest.mark.parametrize("change,status,param", BAD, ids=[next(iter(c)) + str(s) for c, s, _ in BAD])
def test_bad_completion_requests_get_4xx_naming_the_field(client, change, status, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**body)
    assert caught.value.status_code == status
    assert caught.value.body["param"] == param and param in caught.value.body["message"]


@pytest.mark.slow
def test_bad_chat_requests_name_the_field(client):
    for change, param in [({"messages": []}, "messages"),
                          ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
                          ({"max_completion_tokens": 0}, "max_completion_tokens")]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **change}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**body)
        assert caught.value.body["param"] == param


@pytest.mark.slow
def test_invalid_json_and_wrong_types_are_400_with_openai_error_bodies(server):
    url = server[0]
    reply = httpx.post(url + "/v1/completions", content=b"{not json",
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    reply = httpx.post(url + "/v1/chat/completions", json=["a", "list"])
    assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # and the server is still up


@pytest.mark.slow
def test_models_health_and_metrics(server, client):
    url, llm = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert metric(url, "egmla_kv_blocks_total") == llm.engine.config.num_blocks
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in ("egmla_time_to_first_token_seconds_count", "egmla_time_per_output_token_seconds_count",
                 "egmla_num_requests_running", "egmla_num_requests_waiting", "egmla_kv_blocks_used",
                 "egmla_prefix_cache_hit_rate", "egmla_generation_tokens_total"):
        assert re.search(rf"^{name} ", text, re.MULTILINE), name
    assert metric(url, "egmla_time_to_first_token_seconds_count") >= 1
    assert metric(url, "egmla_generation_tokens_total") >= 3


def wait_until_idle(url: str, llm: LLM, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if llm.engine.blocks.num_used() == 0 and metric(url, "egmla_num_requests_running") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"still {llm.engine.blocks.num_used()} blocks in use after {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    url, llm = server
    wait_until_idle(url, llm)
    aborted, sampled = llm.engine.stats.aborted, llm.engine.stats.sampled_tokens
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "temperature": 0,
            "stream": stream, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(5.0, read=1.0)) as http:
        if stream:
            with http.stream("POST", url + "/v1/completions", json=body) as reply:
                lines = reply.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert llm.engine.blocks.num_used() > 0  # the request holds blocks now
        else:  # the client gives up waiting after 1 s and closes the connection
            with pytest.raises(httpx.ReadTimeout):
                http.post(url + "/v1/completions", json=body)
    wait_until_idle(url, llm)
    assert llm.engine.stats.aborted == aborted + 1
    assert llm.engine.stats.sampled_tokens - sampled < 2000  # stopped well before max_tokens
    assert not llm.engine.requests and not llm.engine.finished  # released, nothing left behind


@pytest.mark.slow
def test_full_queue_answers_503_and_the_server_carries_on(smollm2):
    llm = LLM(smollm2.model, smollm2.tokenizer, num_blocks=256, max_num_seqs=1)
    with serving(llm, max_queued_requests=0) as url:  # room for one request in all
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "stream": True,
                "ignore_eos": True}  # long enough to be running still; aborted at the end
        with httpx.Client() as http, http.stream("POST", url + "/v1/completions", json=body) as first:
            assert next(line for line in first.iter_lines() if line.startswith("data: "))
            second = http.post(url + "/v1/completions", json={**body, "stream": False})
            assert second.status_code == 503
            assert second.json()["error"]["type"] == "server_overloaded"
        wait_until_idle(url, llm)
        again = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


# ---- python -m serve ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cli_serves_a_training_export(tmp_path):
    torch.manual_seed(0)
    export = save_export(Transformer(preset("tiny-egmla")), tmp_path / "tiny-run")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--model", str(export), "--port", str(port),
         "--kv-cache-memory", "4MiB", "--log-level", "warning"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-run"
        reply = httpx.post(url + "/v1/completions",
                           json={"model": "tiny-run", "prompt": [5, 6, 7], "max_tokens": 5})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        text = httpx.post(url + "/v1/completions", json={"model": "tiny-run", "prompt": "hi"})
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_help_and_bad_arguments_fail_cleanly(tmp_path):
    help_text = run_cli("--help")
    assert help_text.returncode == 0 and "--kv-cache-memory" in help_text.stdout
    missing = run_cli("--model", str(tmp_path / "no-such-run"))
    assert missing.returncode == 2 and "no-such-run" in missing.stderr
    assert "Traceback" not in missing.stderr
    size = run_cli("--model", "x", "--kv-cache-memory", "lots")
    assert size.returncode == 2 and "'lots'" in size.stderr


def test_json_error_body_shape_is_openai(server):
    reply = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "a", "n": 0})
    error = json.loads(reply.text)["error"]
    assert reply.status_code == 400 and error["param"] == "n" and error["type"] == "invalid_request_error"
