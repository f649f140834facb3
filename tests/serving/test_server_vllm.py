"""What vLLM's OpenAI server offers, offered here (a tiny model with a real BPE tokenizer, a
real uvicorn server, the `openai` client and lm-eval's API models over loopback): logprobs,
echo, the penalties, /tokenize and friends, /v1/models' model card, --api-key, and vLLM's metric
names (a list of them kept here, each checked on a running server)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from serve import LLM, SamplingParams
from support import ROOT
from support.models import tiny_text_export
from support.server import serving

NAME = "tiny"
PROMPT = "And the lord spake unto Moses"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("server") / "export", max_seq_len=256)


@pytest.fixture(scope="module")
def llm(export):
    llm = LLM(model=str(export), dtype="float32")
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return llm


@pytest.fixture(scope="module")
def url(llm):
    """The server drives an engine of its own over the same weights (one engine is driven by
    one thread: the tests' references run on `llm`'s)."""
    with serving(LLM(llm.model, llm.tokenizer), NAME) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def model_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(llm.model(torch.tensor([ids]))[0].double(), dim=-1)


def test_completion_logprobs_are_the_models(llm, client):
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                      logprobs=3)
    lp = reply.choices[0].logprobs
    prompt_ids = llm.encode(PROMPT)
    tokens = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0].token_ids
    reference = model_logprobs(llm, prompt_ids + tokens)
    assert lp.tokens == [llm.decode([t], skip_special_tokens=False) for t in tokens]
    for i, (t, got, top) in enumerate(zip(tokens, lp.token_logprobs, lp.top_logprobs)):
        row = reference[len(prompt_ids) - 1 + i]
        assert abs(got - row[t].item()) < 1e-4 and len(top) == 3
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_logprobs_equal_the_whole_responses(llm, client):
    """stream=true with logprobs: the chunks' logprobs, joined, are the unstreamed response's
    (completions: tokens, logprobs, top alternatives and continuing text offsets; chat: the
    content items)."""
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                      logprobs=2).choices[0].logprobs
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8,
                                            temperature=0, logprobs=2, stream=True))
    for chunk in chunks:
        lp = chunk.choices[0].logprobs if chunk.choices else None
        for key in joined if lp else ():
            joined[key] += getattr(lp, key)
    assert joined == {key: getattr(whole, key) for key in joined}
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs) > 1  # really streamed
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=2)
    items = []
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            items += chunk.choices[0].logprobs.content
    assert [i.model_dump() for i in items] == [
        i.model_dump() for i in whole.choices[0].logprobs.content]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt_with_its_logprobs(llm, client, max_tokens):
    """What lm-eval's local-completions sends to score a continuation: echo, logprobs=1 and
    max_tokens 1 (or 0): the prompt's tokens come back, the first without a logprob, each
    other one scored as the model scores it given what precedes it."""
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=max_tokens,
                                      temperature=0, logprobs=1, echo=True)
    choice, ids = reply.choices[0], llm.encode(PROMPT)
    assert choice.text.startswith(PROMPT) and (max_tokens or choice.text == PROMPT)
    got = choice.logprobs.token_logprobs
    assert len(got) == len(ids) + max_tokens and got[0] is None
    reference = model_logprobs(llm, ids)
    for p in range(1, len(ids)):
        assert abs(got[p] - reference[p - 1, ids[p]].item()) < 1e-4
        top = choice.logprobs.top_logprobs[p]
        assert max(top.values()) == pytest.approx(reference[p - 1].max().item(), abs=1e-4)
    assert reply.usage.completion_tokens == max_tokens


def test_chat_logprobs_carry_the_top_alternatives(llm, client):
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    prompt_ids = llm.encode_chat(messages)
    tokens = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5),
                      use_tqdm=False)[0].outputs[0].token_ids
    reference = model_logprobs(llm, prompt_ids + tokens)
    assert len(content) == len(tokens)
    for i, (t, item) in enumerate(zip(tokens, content)):
        row = reference[len(prompt_ids) - 1 + i]
        assert item.token == llm.decode([t], skip_special_tokens=False)
        assert abs(item.logprob - row[t].item()) < 1e-4
        assert bytes(item.bytes).decode("utf-8") == item.token
        alternatives = [a.logprob for a in item.top_logprobs]
        assert len(alternatives) == 2 and alternatives == sorted(alternatives, reverse=True)
        assert alternatives[0] == pytest.approx(row.max().item(), abs=1e-4)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 1.5), ("frequency_penalty", 1.5), ("repetition_penalty", 3.0),
    ("min_p", 1.0), ("min_tokens", 5), ("skip_special_tokens", False)])
def test_each_sampling_field_reaches_the_engine(llm, url, field, value):
    """Each field changes the tokens exactly as the Python API's SamplingParams field does."""
    sampled = field == "min_p"  # min_p acts on a sampled draw
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 10, "seed": 3,
            "temperature": 1.0 if sampled else 0, "ignore_eos": field != "min_tokens", field: value}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    params = SamplingParams(max_tokens=10, seed=3, temperature=1.0 if sampled else 0,
                            ignore_eos=field != "min_tokens", **{field: value})
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    assert reply.json()["choices"][0]["text"] == expected


def test_tokenize_detokenize_tokenizer_info_and_version(llm, url):
    ids = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()
    assert ids["tokens"] == llm.encode(PROMPT) and ids["count"] == len(ids["tokens"])
    text = httpx.post(url + "/detokenize", json={"model": NAME, "tokens": ids["tokens"]}).json()
    assert text == {"prompt": PROMPT}
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == llm.tokenizer.eos_token and "chat_template" in info
    assert httpx.get(url + "/version").json()["version"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = httpx.post(url + "/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


# vLLM's metric names that this server claims, with their Prometheus types, as vLLM v1's
# PrometheusStatLogger declares them (vllm/v1/metrics/loggers.py), each labelled with
# model_name. Exposed, a counter gains _total and a histogram _bucket, _count and _sum.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}
EXPOSED_AS = {"gauge": "", "counter": "_total", "histogram": "_count"}


def scrape(url: str) -> dict:
    """/metrics read by prometheus_client's own parser: family name -> family."""
    text = httpx.get(url + "/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str = "_total") -> float:
    """A counter's (or, with suffix "", a gauge's) one value."""
    [sample] = [s for s in families[name].samples if s.name == name + suffix]
    return sample.value


def test_every_vllm_metric_name_is_exported_with_its_type(url, client):
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    families = scrape(url)
    missing = sorted(set(VLLM_METRICS) - set(families))
    assert not missing, f"not exported: {missing}"
    for name, kind in VLLM_METRICS.items():
        assert families[name].type == kind, (name, families[name].type)
        exposed = [s for s in families[name].samples if s.name == name + EXPOSED_AS[kind]]
        assert exposed and all(s.labels["model_name"] == NAME for s in exposed), name
    done = [s.value for s in families["vllm:request_success"].samples
            if s.name.endswith("_total") and s.labels["finished_reason"] == "length"]
    assert done and done[0] >= 1
    gaps = value(families, "vllm:inter_token_latency_seconds", "_count")
    assert gaps >= 2 and value(families, "vllm:time_per_output_token_seconds", "_count") == gaps


def test_prefix_cache_queries_and_hits_count_prompt_tokens(llm, url, client):
    """Two prompts share a long prefix: the second finds its full blocks cached. Queries count
    every prompt token looked up, hits the ones found (vLLM counts both in tokens)."""
    shared = "Whoso keepeth the law is a wise son, but a companion of riotous men " * 2
    prompts = [shared + "shameth his father.", shared + "getteth honour."]
    ids = [llm.encode(p) for p in prompts]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    block = llm.engine.config.block_size
    before = scrape(url)
    for prompt in prompts:  # one after the other: the first one's blocks are cached by then
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    after = scrape(url)
    counted = {name: value(after, name) - value(before, name)
               for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
    assert counted["vllm:prefix_cache_queries"] == len(ids[0]) + len(ids[1])
    assert counted["vllm:prefix_cache_hits"] == common // block * block >= 2 * block
    assert value(after, "egmla_prefix_cache_hits") == value(after, "vllm:prefix_cache_hits")


@pytest.fixture(scope="module")
def small_pool(export):
    """A server over the export loaded from its path (as `python -m serve PATH` loads it), with a
    KV pool of 8 blocks of 16 tokens: two 100-token requests cannot run side by side in it."""
    llm = LLM(str(export), dtype="float32", num_blocks=8, block_size=16)
    with serving(llm, NAME) as base:
        yield base, llm


def test_preemptions_are_counted(small_pool):
    base, llm = small_pool
    body = {"model": NAME, "prompt": ["And the lord spake", "In the beginning God"],
            "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    reply = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert [c["finish_reason"] for c in reply.json()["choices"]] == ["length", "length"]
    preempted = llm.engine.stats.preemptions  # the engine is idle: its reply has come
    assert preempted > 0
    families = scrape(base)
    assert value(families, "vllm:num_preemptions") == preempted
    assert value(families, "egmla_preemptions") == preempted


def test_models_carry_vllms_model_card_fields(export, small_pool):
    base, llm = small_pool
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert (card["id"], card["object"], card["owned_by"]) == (NAME, "model", "egmla")
    assert card["root"] == str(export) and card["parent"] is None
    assert card["max_model_len"] == 8 * 16  # the KV pool's, under the model's 256 positions
    assert isinstance(card["created"], int) and card["created"] <= time.time()
    [permission] = card["permission"]
    assert permission.pop("id").startswith("modelperm-")
    assert permission.pop("created") == card["created"]
    assert permission == {  # vLLM's ModelPermission defaults
        "object": "model_permission", "allow_create_engine": False, "allow_sampling": True,
        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    listed = openai.OpenAI(base_url=base + "/v1", api_key="unused").models.list().data
    assert [(m.id, m.root, m.max_model_len) for m in listed] == [(NAME, str(export), 128)]


def test_tokenize_returns_the_token_strings_when_asked(llm, url):
    plain = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()
    assert plain["token_strs"] is None
    asked = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    assert asked.status_code == 200, asked.text
    strs = asked.json()["token_strs"]
    assert asked.json()["tokens"] == plain["tokens"]
    assert strs == llm.tokenizer.convert_ids_to_tokens(plain["tokens"])
    # the tokenizer's pieces (a space as the BPE's marker), not each token decoded to text
    assert strs != [llm.decode([t], skip_special_tokens=False) for t in plain["tokens"]]
    assert llm.tokenizer.convert_tokens_to_string(strs).endswith(PROMPT)
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": PROMPT}],
                                               "return_token_strs": True}).json()
    assert chat["token_strs"] == llm.tokenizer.convert_ids_to_tokens(chat["tokens"])
    unset = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": None})
    assert unset.status_code == 200 and unset.json()["token_strs"] is None  # vLLM's bool | None
    for bad in ("yes", 1, [True]):
        reply = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": bad})
        assert reply.status_code == 400, (bad, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == "return_token_strs" and "return_token_strs" in error["message"]


def test_an_api_key_is_required_on_v1_only(llm):
    with serving(LLM(llm.model, llm.tokenizer), NAME, app_kwargs={"api_key": "sesame"}) as base:
        body = {"model": NAME, "prompt": "x", "max_tokens": 1}
        refused = httpx.post(base + "/v1/completions", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(base + "/v1/completions", json=body,
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = httpx.post(base + "/v1/completions", json=body,
                        headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and httpx.get(base + "/health").status_code == 200


def test_cli_flags_as_vllm_spells_them(export, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    run = subprocess.run([sys.executable, "-m", "serve", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    for flag in ("--max-model-len", "--seed", "--api-key", "--chat-template", "--device"):
        assert flag in run.stdout
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, "-m", "serve", "--model", str(export), "--device",
                              "cuda"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert run.returncode == 2 and "device='cuda': CUDA is not available" in run.stderr
        assert "Traceback" not in run.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    run = subprocess.run([sys.executable, "-m", "serve", "--model", str(export), "--chat-template",
                          str(broken), "--port", "1"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 2 and "--chat-template: it does not render" in run.stderr
    assert "Traceback" not in run.stderr
    mistyped = str(tmp_path / "missing.jinja")  # was taken as a template: every chat rendered as it
    run = subprocess.run([sys.executable, "-m", "serve", "--model", str(export), "--chat-template",
                          mistyped, "--port", "1"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 2 and f"--chat-template {mistyped}: no such file" in run.stderr


def lm_eval_run(model, tasks: list[str], **kwargs) -> dict:
    import lm_eval
    import lm_eval.models.openai_completions  # noqa: F401 - registers lm-eval's API models
    from lm_eval.tasks import TaskManager

    from eval.local_tasks import install

    install()
    manager = TaskManager(include_path=str(ROOT / "eval" / "tasks"), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=tasks, limit=6, log_samples=True,
                                   task_manager=manager, **kwargs)


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_lm_evals_api_models_score_what_the_in_process_adapter_does(llm, url):
    """lm-eval's own `local-completions` (loglikelihoods through echo and prompt logprobs, the
    server's tokenizer through /tokenize) scores a multiple-choice task and a generation task
    as `--model egmla` does in-process, loglikelihoods within 1e-3; `local-chat-completions`
    (which cannot score loglikelihoods) the generation task through the chat template."""
    from eval.adapter import EgmlaLM

    tasks = ["corpus_cloze", "rg_chain_sum"]
    ours = lm_eval_run(EgmlaLM(LLM(llm.model, llm.tokenizer)), tasks)
    args = f"model={NAME},tokenizer_backend=remote,num_concurrent=1,max_retries=1,max_length=256"
    theirs = lm_eval_run("local-completions", tasks,
                         model_args=f"base_url={url}/v1/completions,{args}")
    for a, b in zip(responses(ours, "corpus_cloze"), responses(theirs, "corpus_cloze")):
        assert len(a) == len(b) == 4  # the choices
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip((r[0] for r in a), (r[0] for r in b)):
            assert abs(float(ll_a) - float(ll_b)) < 1e-3 and bool(greedy_a) == bool(greedy_b)
    assert responses(ours, "rg_chain_sum") == responses(theirs, "rg_chain_sum")
    for task in tasks:
        assert ours["results"][task] == pytest.approx(theirs["results"][task], abs=1e-6)
    chat_ours = lm_eval_run(EgmlaLM(LLM(llm.model, llm.tokenizer)), ["rg_chain_sum"],
                            apply_chat_template=True)
    chat = lm_eval_run("local-chat-completions", ["rg_chain_sum"], apply_chat_template=True,
                       model_args=f"base_url={url}/v1/chat/completions,{args}")
    assert responses(chat_ours, "rg_chain_sum") == responses(chat, "rg_chain_sum")
    # the documented command line (docs/serving.md) finds lm-eval's API models beside ours
    run = subprocess.run(
        [sys.executable, "-m", "eval.lm_eval", "--model", "local-completions", "--tasks",
         "corpus_cloze", "--limit", "2", "--include_path", str(ROOT / "eval" / "tasks"),
         "--model_args", f"base_url={url}/v1/completions,{args}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "corpus_cloze" in run.stdout
