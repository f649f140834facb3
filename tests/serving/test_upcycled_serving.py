"""A converted SmolLM2 (EG-MLA, the smallest cache) served for real: `python -m serve` and the
OpenAI client over loopback give the engine's greedy tokens, the engine allocates the cache the
conversion promises, and the transformers export (trust_remote_code) generates the same tokens
(issue 38's acceptance)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from egmla.checkpoint import load_export, load_tokenizer, read_export_config, save_export
from serve import LLM, SamplingParams
from support import ROOT
from support.server import served_by_cli

pytestmark = pytest.mark.slow
PROMPT = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("upcycled") / "egmla-kv24"
    done = subprocess.run(
        [sys.executable, "-m", "egmla.upcycle", "--model", "SmolLM2-135M-Instruct", "--to",
         "egmla", "--d-c", "24", "--calibration-tokens", "4096", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    # The identity start has W_UE = 0, where the gate's table lookup multiplies out: give W_UE
    # values (as recovery does), so that the serving and transformers paths must get it right.
    model, (_, meta) = load_export(out), read_export_config(out)
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        before = model(ids)
        for block in model.layers:
            w = block.attn.w_gate.weight
            w.copy_(0.05 * torch.randn(w.shape, generator=g))
        assert (model(ids) - before).abs().max() > 0.1  # the gate now changes the function
    save_export(model, out, tokenizer=load_tokenizer(out), extra=meta["extra"])
    return out


@pytest.fixture(scope="module")
def engine_tokens(converted):
    llm = LLM(str(converted), kv_cache_memory=64 * 2**20)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
    return llm, list(out.outputs[0].token_ids), list(out.prompt_token_ids)


def test_the_engine_allocates_the_cache_the_conversion_promises(converted, engine_tokens):
    llm = engine_tokens[0]
    _, meta = read_export_config(converted)
    record = meta["extra"]["upcycle"]
    assert record["kv_elements_per_token"] == 30 * (24 + 3 * 8)  # (d_c + G r) x 30 layers
    engine = llm.engine
    per_token = engine.cache.nbytes() / (engine.config.num_blocks * engine.config.block_size)
    spec = engine.model.cache_spec()
    assert per_token == spec.bytes_per_token(engine.cache.dtype)
    # c, k_rope (3 x 8) per layer, the token id once: no decompressed K/V anywhere
    assert spec.elements_per_token() == 30 * 48


def test_python_m_serve_and_the_openai_client_give_the_engines_tokens(converted, engine_tokens,
                                                                      tmp_path):
    from openai import OpenAI

    tokens = engine_tokens[1]
    with served_by_cli(["--model", str(converted), "--kv-cache-memory", "64MiB", "--log-level",
                        "warning"], cwd=tmp_path) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.completions.create(model=converted.name, prompt=PROMPT, max_tokens=12,
                                          temperature=0, logprobs=1)
        assert reply.usage.completion_tokens == 12
        assert reply.choices[0].text == engine_tokens[0].tokenizer.decode(tokens)
        messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        chat = client.chat.completions.create(model=converted.name, messages=messages,
                                              max_tokens=8, temperature=0)
        expected = engine_tokens[0].chat(messages, SamplingParams(max_tokens=8, temperature=0))
        assert chat.choices[0].message.content == expected[0].outputs[0].text


def test_the_transformers_export_generates_the_engines_greedy_tokens(converted, engine_tokens,
                                                                   tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, tokens, prompt = engine_tokens
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "egmla.export", "--checkpoint", str(converted),
                           "--format", "hf", "--out", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["auto_map"]
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert AutoTokenizer.from_pretrained(out).encode(PROMPT) == prompt
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert generated[0, ids.shape[1]:].tolist() == tokens
