"""Admission over the real server (uvicorn on loopback, httpx and the openai client): a request
that can never run is a 400 naming the limit with nothing queued, one that does not fit now a
503 with nothing queued, an aborted multi-prompt request gives its places back at once and
computes nothing more; 100,000 stop strings fit in a body; and the smaller points of issue 39
(/v1/models' max_model_len, echo scoring at the context length, strict stream_options)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import string
import threading
import time

import httpx
import openai
import pytest
import torch

from egmla.data.tokenizer import train_bpe
from egmla.models import Transformer
from egmla.presets import preset
from serve import LLM, SamplingParams
from support.server import serving


def tiny(**engine_args) -> LLM:
    torch.manual_seed(0)
    return LLM(Transformer(preset("tiny-mha")), num_blocks=1024, block_size=4, **engine_args)


def body(prompt, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "temperature": 0, **fields}


def error_of(reply: httpx.Response) -> dict:
    return reply.json()["error"]


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def prefilled(llm: LLM) -> int:
    return llm.engine.stats.prefill_tokens


class HeldForward:
    """Holds the engine thread inside its next forward while `hold` is set, until `release`
    is set: the test can act while no step runs and the engine thread can do nothing else."""

    def __init__(self, llm: LLM) -> None:
        self.forward = llm.engine._forward
        llm.engine._forward = self
        self.hold, self.inside, self.release = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, rows, every=False):
        if self.hold.is_set():
            self.inside.set()
            assert self.release.wait(timeout=60)
        return self.forward(rows, every)


# ---- a request that can never fit, or not now --------------------------------------------------


def test_more_prompts_than_the_server_holds_is_a_400_and_others_are_served_meanwhile():
    """4 places (max_num_seqs 2 + 2 queued); one long request holds one. Five rounds, each
    sending a 5-prompt request together with 3 single ones: the 5 prompts are refused with a
    400 naming the limit, before any is queued (the engine never sees them), and the 3 others
    all get their answer (none a 503: no place was taken by the refused request)."""
    llm = tiny(max_num_seqs=2)
    with serving(llm, "tiny", max_queued_requests=2) as url:
        long = body([1, 2, 3], max_tokens=200, ignore_eos=True, stream=True)
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions",
                                                           json=long):
            wait_for(lambda: llm.engine.stats.sampled_tokens > 0, "the long request to run")
            before = prefilled(llm)

            async def round_() -> tuple[httpx.Response, list[httpx.Response]]:
                async with httpx.AsyncClient(timeout=60) as client:
                    many = client.post(url + "/v1/completions",
                                       json=body([[9] * 5] * 5, max_tokens=2))
                    singles = [client.post(url + "/v1/completions",
                                           json=body([4, 5, 6 + i], max_tokens=2))
                               for i in range(3)]
                    replies = await asyncio.gather(many, *singles)
                return replies[0], replies[1:]

            for _ in range(5):
                refused, served = asyncio.run(round_())
                assert refused.status_code == 400, refused.text
                error = error_of(refused)
                assert error["param"] == "prompt"
                assert "5 prompts" in error["message"] and "4 requests" in error["message"]
                assert "max_num_seqs 2 + max_queued_requests 2" in error["message"]
                assert [r.status_code for r in served] == [200] * 3, [r.text for r in served]
            # only the single prompts were computed (3 tokens each), and nothing was aborted
            assert prefilled(llm) - before == 5 * 3 * 3
            assert llm.engine.stats.aborted == 0


def test_prompts_that_do_not_fit_now_get_503_with_nothing_queued():
    """4 places (max_num_seqs 3 + 1 queued), 3 held by running streams, the engine thread held
    inside a step: a 2-prompt request is a 503 (it fits an idle server: "retry later" is
    right) and took nothing: a 1-prompt request is accepted right after, and of the pair no
    prompt ever reaches the engine."""
    llm = tiny(max_num_seqs=3)
    held, engine = HeldForward(llm), llm.engine
    long = body([1, 2, 3], max_tokens=200, ignore_eos=True, stream=True)
    with serving(llm, "tiny", max_queued_requests=1) as url, httpx.Client(timeout=60) as http:
        with contextlib.ExitStack() as longs:
            for _ in range(3):
                longs.enter_context(http.stream("POST", url + "/v1/completions", json=long))
            wait_for(lambda: len(engine.running) == 3 and engine.stats.sampled_tokens >= 3,
                     "three requests running")
            held.hold.set()
            assert held.inside.wait(timeout=60)
            before = prefilled(llm)
            two = http.post(url + "/v1/completions", json=body([[7] * 6] * 2, max_tokens=2))
            assert two.status_code == 503 and error_of(two)["type"] == "server_overloaded"
            assert "retry later" in error_of(two)["message"]
            single = body([7] * 6, max_tokens=2, stream=True)
            with http.stream("POST", url + "/v1/completions", json=single) as one:
                assert one.status_code == 200  # accepted: the pair had taken no place
                held.hold.clear()
                held.release.set()
                longs.close()  # the long streams end (aborted); the single one is read out
                events = [line for line in one.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert prefilled(llm) - before == 6  # the single prompt's, none of the pair's
    assert engine.stats.aborted == 3  # the long ones, closed by the client


def test_a_prompt_beyond_the_kv_pool_is_a_400_naming_the_prompt_and_the_pool():
    """The pool holds 16 blocks of 4 tokens, less than the model's 256-token context."""
    torch.manual_seed(0)
    llm = LLM(Transformer(preset("tiny-mha")), num_blocks=16, block_size=4)
    with serving(llm, "tiny") as url:
        reply = httpx.post(url + "/v1/completions", json=body([3] * 65, max_tokens=1), timeout=60)
        assert reply.status_code == 400
        error = error_of(reply)
        assert error["param"] == "prompt" and "the pool has 16" in error["message"], error
        # a prompt that fits, with an output that does not: the output is named
        reply = httpx.post(url + "/v1/completions", json=body([3] * 60, max_tokens=8), timeout=60)
        assert reply.status_code == 400 and error_of(reply)["param"] == "max_tokens"
        assert llm.engine.stats.prefill_tokens == 0  # nothing of either was computed


# ---- aborting a multi-prompt request -----------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_disconnected_multi_prompt_request_frees_its_places_at_once_and_computes_nothing_more(
        stream):
    """A 3-prompt request, one prompt running (max_num_seqs 1), two waiting, of 4 places; the
    engine thread is held inside a step when the client goes away. A 4-prompt request is then
    accepted while the engine thread is still held (the places came back at once, not after
    its next step), and once released the engine computes nothing more of the first request:
    its waiting prompts are never prefilled."""
    llm = tiny(max_num_seqs=1)
    held, engine = HeldForward(llm), llm.engine
    first = body([[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]], max_tokens=200, ignore_eos=True,
                 stream=stream)
    second = body([[20, 21]] * 4, max_tokens=2, stream=True)

    def hold_once_running() -> None:
        wait_for(lambda: engine.stats.sampled_tokens > 0, "the first prompt to run")
        held.hold.set()
        assert held.inside.wait(timeout=60)

    with serving(llm, "tiny", max_queued_requests=3) as url, httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", url + "/v1/completions", json=first):
                hold_once_running()
        else:  # the client gives up waiting after 3 s and closes its connection
            client = threading.Thread(target=_post_expecting_timeout,
                                      args=(url + "/v1/completions", first, 3.0))
            client.start()
            hold_once_running()
            client.join(timeout=60)
        deadline = time.monotonic() + 20
        while True:  # until the server has seen the disconnect (503s queue nothing)
            with http.stream("POST", url + "/v1/completions", json=second) as reply:
                if reply.status_code == 200:
                    assert not held.release.is_set()  # accepted while the engine was held
                    held.hold.clear()
                    held.release.set()
                    events = [line for line in reply.iter_lines() if line]
                    break
                reply.read()
                assert reply.status_code == 503, reply.text
            assert time.monotonic() < deadline, "the first request's places never came back"
            time.sleep(0.05)
    assert events[-1] == "data: [DONE]" and not any("error" in e for e in events)
    assert engine.stats.aborted == 3 and not engine.requests
    assert engine.stats.prefill_tokens == 3 + 4 * 2  # the waiting ones of the first never ran


def _post_expecting_timeout(url: str, request: dict, read_timeout: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=request, timeout=httpx.Timeout(60, read=read_timeout))


# ---- the smaller points ------------------------------------------------------------------------


@pytest.mark.parametrize("engine_args, limit, param", [
    ({"max_model_len": 100}, 100, "prompt"),  # --max-model-len below the model's 256
    ({"num_blocks": 16}, 64, "max_tokens"),  # a pool of 16 blocks of 4 tokens
], ids=["max_model_len", "pool"])
def test_models_reports_the_limit_the_server_enforces(engine_args, limit, param):
    torch.manual_seed(0)
    llm = LLM(Transformer(preset("tiny-mha")), block_size=4, **{"num_blocks": 1024, **engine_args})
    with serving(llm, "tiny") as url:
        listed = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]
        assert listed["max_model_len"] == limit
        fits = httpx.post(url + "/v1/completions", json=body([5] * (limit - 4), max_tokens=4),
                          timeout=60)
        assert fits.status_code == 200
        over = httpx.post(url + "/v1/completions", json=body([5] * (limit - 3), max_tokens=4),
                          timeout=60)
        assert over.status_code == 400 and error_of(over)["param"] == param


def test_echo_scores_a_prompt_of_exactly_the_context_and_refuses_one_more():
    """echo with max_tokens 0 scores the prompt alone (the one token made is dropped), so a
    prompt of the whole context fits; its logprobs are the full forward's. One token more is
    refused, and so is the same prompt asking for a token (it needs room)."""
    llm = tiny(max_model_len=48)
    rng = random.Random(0)
    ids = [rng.randrange(256) for _ in range(49)]
    with serving(llm, "tiny") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="tiny", prompt=ids[:48], max_tokens=0, echo=True,
                                          logprobs=1, temperature=0)
        with torch.no_grad():
            logprobs = llm.model(torch.tensor([ids[:48]]))[0].float().log_softmax(-1)
        expected = [logprobs[i, ids[i + 1]].item() for i in range(47)]
        scored = reply.choices[0].logprobs.token_logprobs
        assert scored[0] is None and scored[1:] == pytest.approx(expected, abs=1e-4)
        assert reply.usage.prompt_tokens == 48 and reply.usage.completion_tokens == 0
        for prompt, max_tokens in ((ids, 0), (ids[:48], 1)):
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                          echo=True, logprobs=1, temperature=0)
            assert refused.value.code == "context_length_exceeded"


def test_stream_options_and_every_boolean_field_are_strict():
    """`stream_options: {"include_usage": "yes"}` was taken as true: it, and a string or a
    number for any boolean field, is a 400 naming the field; the real values still work."""
    llm = tiny()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream_options": "yes"}, "stream_options"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
        ({"stream": "yes"}, "stream"),
        ({"echo": "true"}, "echo"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "false"}, "skip_special_tokens"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ]
    with serving(llm, "tiny") as url:
        for change, named in cases:
            for path, request in (("/v1/completions", body([1, 2], max_tokens=2, stream=True)),
                                  ("/v1/chat/completions", {**chat, "stream": True})):
                if "echo" in change and "chat" in path:
                    continue  # a completions field (chat ignores it as unknown)
                reply = httpx.post(url + path, json={**request, **change}, timeout=60)
                assert reply.status_code == 400, (path, change, reply.text)
                error = error_of(reply)
                assert named in error["message"], (change, error)
                assert error["param"] == named.split(".")[0], (change, error)
        reply = httpx.post(url + "/v1/chat/completions", json={**chat, "logprobs": "true"},
                           timeout=60)
        assert reply.status_code == 400 and error_of(reply)["param"] == "logprobs"
        for options, usage in (({"include_usage": True}, True), ({"include_usage": False}, False),
                               ({}, False), ({"include_usage": None, "other": 1}, False)):
            request = body([1, 2], max_tokens=2, stream=True, stream_options=options)
            with httpx.stream("POST", url + "/v1/completions", json=request, timeout=60) as reply:
                assert reply.status_code == 200
                chunks = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
            assert chunks[-1] == "[DONE]"
            assert ("usage" in chunks[-2]) == usage, options


# ---- 100,000 stop strings ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def worded(tmp_path_factory) -> LLM:
    """A tiny random model with a byte-level BPE tokenizer of its own: text to stop."""
    tokenizer = train_bpe(["hello world, stop here"] * 8, 260, tmp_path_factory.mktemp("bpe"))
    torch.manual_seed(0)
    return LLM(Transformer(preset("tiny-mha", vocab_size=260)), tokenizer, num_blocks=256,
               block_size=4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_100000_stop_strings_of_40_characters_fit_the_default_body_limit_and_stop(worded, stream):
    """Their JSON is 4.4 MB; the default limit (8 MiB) takes it and still refuses a larger body.
    One of them is a piece of the text the model makes: the text is cut there, as the Python
    API without the 99,999 others cuts it."""
    sampling = dict(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True)
    whole = worded.generate("hello", SamplingParams(**sampling), use_tqdm=False)[0].outputs[0].text
    stop = next(whole[i:i + 4] for i in range(1, len(whole) - 4)
                if "\ufffd" not in whole[i:i + 4] and whole.find(whole[i:i + 4]) == i)
    expected = worded.generate("hello", SamplingParams(**sampling, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert expected.text == whole[:whole.find(stop)] and expected.finish_reason == "stop"
    rng = random.Random(0)
    stops = ["".join(rng.choices(string.ascii_lowercase, k=40)) for _ in range(99_999)] + [stop]
    request = {"model": "tiny", "prompt": "hello", **sampling, "stop": stops, "stream": stream}
    with serving(worded, "tiny") as url, httpx.Client(timeout=120) as http:
        if stream:
            with http.stream("POST", url + "/v1/completions", json=request) as reply:
                assert reply.status_code == 200
                chunks = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                          if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            reply = http.post(url + "/v1/completions", json=request)
            assert reply.status_code == 200, reply.text[:300]
            choice = reply.json()["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        assert (text, finish) == (expected.text, "stop")
        too_big = http.post(url + "/v1/completions", json={**request, "stop": stops * 2})
        assert too_big.status_code == 413 and error_of(too_big)["code"] == "request_too_large"
