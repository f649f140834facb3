"""The scripts in examples/vllm/ are vLLM users' scripts (issue 43's acceptance): each runs
unchanged as a real subprocess and prints what vLLM's API promises, the client against
`python -m serve` started with vLLM's flags; and each is vLLM's script but for its import lines
and the model name, checked on its source (`deviations`, itself checked on scripts that stray).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support import ROOT
from support.server import served_by_cli

EXAMPLES = ROOT / "examples" / "vllm"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "token-abc123"
# `vllm serve MODEL ...` as vLLM's quickstart and server docs spell it, with the vLLM flags that
# change nothing on one CPU at these values.
SERVER_ARGS = [MODEL, "--dtype", "auto", "--api-key", API_KEY, "--tensor-parallel-size", "1",
               "--max-model-len", "2048", "--gpu-memory-utilization", "0.9", "--trust-remote-code",
               "--disable-log-requests", "--seed", "0", "--log-level", "info"]

# ---- the source check ----------------------------------------------------------------------------

# Where each name a script takes from serve lives in vLLM: the only imports that differ.
VLLM_HOME = {("serve", "LLM"): "vllm", ("serve", "SamplingParams"): "vllm",
             ("serve.inputs", "TokensPrompt"): "vllm.inputs",
             ("serve.inputs", "TextPrompt"): "vllm.inputs"}
OTHER_IMPORTS = {"openai"}  # and the standard library
# Keywords of vLLM's documented API (vLLM >= 0.6: `LLM`, its `EngineArgs`, `SamplingParams`,
# `vllm.inputs`, `LLM.generate` and `LLM.chat`) that a script may pass.
VLLM_KEYWORDS = {
    "LLM": {"model", "tokenizer", "tokenizer_mode", "trust_remote_code", "tensor_parallel_size",
            "pipeline_parallel_size", "dtype", "quantization", "seed", "gpu_memory_utilization",
            "swap_space", "cpu_offload_gb", "enforce_eager", "disable_custom_all_reduce",
            "max_model_len", "kv_cache_dtype", "disable_log_stats", "enable_prefix_caching",
            "enable_chunked_prefill", "block_size", "max_num_seqs", "max_num_batched_tokens",
            "load_format", "device"},
    "SamplingParams": {"n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                       "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                       "skip_special_tokens"},
    "TokensPrompt": {"prompt_token_ids"},
    "TextPrompt": {"prompt"},
    "generate": {"prompts", "sampling_params", "use_tqdm"},
    "chat": {"messages", "sampling_params", "use_tqdm", "chat_template", "add_generation_prompt",
             "continue_final_message", "chat_template_kwargs"},
}
# Every attribute a script may read, by whose API it is.
ATTRIBUTES = {
    "vllm.LLM": {"generate", "chat", "get_tokenizer"},
    "vllm.RequestOutput": {"request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs",
                           "finished", "num_cached_tokens"},
    "vllm.CompletionOutput": {"index", "text", "token_ids", "cumulative_logprob", "logprobs",
                              "finish_reason", "stop_reason"},
    "vllm.sequence.Logprob": {"logprob", "rank", "decoded_token"},
    "the tokenizer (transformers')": {"encode", "decode", "apply_chat_template", "eos_token_id",
                                      "bos_token_id", "convert_ids_to_tokens", "batch_decode"},
    "openai": {"models", "list", "data", "id", "completions", "chat", "create", "choices", "text",
               "message", "content", "delta", "usage", "prompt_tokens", "completion_tokens",
               "total_tokens"},
    "Python": {"environ", "get", "items", "values", "keys", "append", "join"},
}
ALLOWED_ATTRIBUTES = set().union(*ATTRIBUTES.values())


def deviations(source: str) -> list[str]:
    """What makes `source` more than a vLLM script with serve's import lines and our model name:
    an import from serve that vLLM does not have there, or of anything but the standard library
    and openai; a keyword of a vLLM callable that vLLM does not document; an attribute outside
    vLLM's, the tokenizer's, openai's and Python's (`llm.engine`, `llm.encode_chat`); a name or a
    string of egmla's own; a model other than MODEL; a docstring that does not name the vLLM
    import line each serve import replaces."""
    tree, found = ast.parse(source), []
    docstring = ast.get_docstring(tree) or ""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "serve":
            names = [a.name for a in node.names]
            homes = {VLLM_HOME.get((node.module, n)) for n in names}
            if None in homes or len(homes) != 1:
                found.append(f"import: from {node.module} import {', '.join(names)}")
            elif f"from {homes.pop()} import {', '.join(names)}" not in docstring:
                found.append(f"docstring: does not name the vLLM import of {', '.join(names)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for module in modules:
                top = (module or "").split(".")[0]
                if top not in sys.stdlib_module_names and top not in OTHER_IMPORTS:
                    found.append(f"import: {module}")
        elif isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            found += [f"keyword: {callee}({k.arg}=...)" for k in node.keywords
                      if callee in VLLM_KEYWORDS and k.arg not in VLLM_KEYWORDS[callee]]
            model = next((k.value for k in node.keywords if k.arg == "model"),
                         node.args[0] if node.args else None)
            if callee == "LLM" and not (isinstance(model, ast.Constant) and model.value == MODEL):
                found.append(f"model: {ast.unparse(model) if model else 'none'}")
        elif isinstance(node, ast.Attribute) and node.attr not in ALLOWED_ATTRIBUTES:
            found.append(f"attribute: .{node.attr}")
        elif isinstance(node, ast.Name) and re.search("serve|egmla", node.id, re.I):
            found.append(f"name: {node.id}")
    body = tree.body[1:] if docstring else tree.body
    strings = [n.value for stmt in body for n in ast.walk(stmt)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    found += [f"string: {s!r}" for s in strings if re.search("serve|egmla", s, re.I)]
    return found


def test_there_is_a_script_for_each_use_the_issue_names():
    assert {"basic.py", "token_prompts.py", "chat.py", "engine_args.py",
            "openai_client.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_is_vllms_but_for_its_imports_and_model_name(script):
    assert deviations((EXAMPLES / script).read_text()) == []


def test_the_source_check_finds_what_a_vllm_script_would_not_have():
    basic = (EXAMPLES / "basic.py").read_text()
    assert 'LLM(model="SmolLM2-135M-Instruct")' in basic  # the lines the cases below rewrite
    cases = {
        "from serve.llm import LLM, SamplingParams": "import: from serve.llm import",
        "from serve import LLM, SamplingParams, EngineConfig": "import: from serve import",
        "from serve import LLM, SamplingParams\nfrom egmla.imports import load_pretrained":
            "import: egmla.imports",
        'LLM(model="SmolLM2-135M-Instruct", num_blocks=64)': "keyword: LLM(num_blocks=...)",
        'LLM(model="SmolLM2-135M-Instruct", cache_dtype="auto")': "keyword: LLM(cache_dtype=...)",
        'LLM(model="runs/quickstart/export")': "model: 'runs/quickstart/export'",
        'LLM(model="SmolLM2-135M-Instruct"); print(llm.engine.metrics())': "attribute: .engine",
    }
    for replacement, expected in cases.items():
        old = "from serve import LLM, SamplingParams" if "import" in replacement else \
            'LLM(model="SmolLM2-135M-Instruct")'
        found = deviations(basic.replace(old, replacement, 1))
        assert any(f.startswith(expected) for f in found), (replacement, found)
    assert deviations(basic.replace("from vllm import", "from vllm.entrypoints import")) == [
        "docstring: does not name the vLLM import of LLM, SamplingParams"]
    assert deviations(basic + '\nprint("egmla")\n') == ["string: 'egmla'"]


# ---- the scripts, run ----------------------------------------------------------------------------


def run_script(script: str, cwd: Path, cache: Path, env: dict | None = None) -> str:
    """`python examples/vllm/SCRIPT` as a user runs it; its standard output (exit 0 asserted)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=cwd, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), "EGMLA_CACHE": str(cache),
                          **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def fields(stdout: str, key: str) -> list:
    """The values printed as `KEY: <repr>` lines, in order."""
    return [ast.literal_eval(line.removeprefix(f"{key}: ")) for line in stdout.splitlines()
            if line.startswith(f"{key}: ")]


def assigned(script: str, name: str):
    """The literal a script assigns to `name` (its prompts, its conversations)."""
    tree = ast.parse((EXAMPLES / script).read_text())
    return next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))


@pytest.mark.slow
def test_basic_generates_for_each_prompt(tmp_path, smollm2_cache):
    out = run_script("basic.py", tmp_path, smollm2_cache)
    assert fields(out, "Prompt") == assigned("basic.py", "prompts")
    generated = fields(out, "Generated")
    assert len(generated) == 3 and all(text.strip() for text in generated)


@pytest.mark.slow
def test_token_prompts_round_trip_through_the_engines_tokenizer(tmp_path, smollm2_cache):
    out = run_script("token_prompts.py", tmp_path, smollm2_cache)
    prompts, generated = fields(out, "Prompt decoded"), fields(out, "Generated token ids")
    assert prompts[:2] == assigned("token_prompts.py", "texts") and len(prompts) == 3
    assert prompts[2].startswith("<|im_start|>") and "Name one colour of the rainbow." in prompts[2]
    assert prompts[2].endswith("<|im_start|>assistant\n")
    assert all(1 <= len(ids) <= 16 for ids in generated) and len(generated) == 3
    assert [len(ids) for ids in fields(out, "Prompt token ids")][:2] == [5, 6]
    # the tokenizer decodes the generated ids to the text the engine returned
    assert fields(out, "Generated decoded") == fields(out, "Generated text")


@pytest.mark.slow
def test_chat_renders_each_conversation_with_its_template_arguments(tmp_path, smollm2_cache):
    out = run_script("chat.py", tmp_path, smollm2_cache)
    sections = out.split("== ")[1:]
    assert len(sections) == 3, out
    conversations = assigned("chat.py", "conversations")
    model_template, own_template, continued = ([ast.literal_eval(line.removeprefix("Prompt: "))
                                                for line in s.splitlines() if line.startswith("Prompt: ")]
                                               for s in sections)
    assert len(model_template) == len(conversations)
    for prompt, conversation in zip(model_template, conversations):
        rendered = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation]
        assert "".join(rendered) in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert len(own_template) == 2
    for prompt, conversation in zip(own_template, conversations[1:]):
        assert prompt.startswith("<|im_start|>system\nYou are a poet.<|im_end|>\n")  # the kwarg
        assert conversation[-1]["content"] in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert len(continued) == 1  # the last message left open, no new turn
    assert continued[0].endswith("<|im_start|>assistant\nThe three primary colours are")
    generated = fields(out, "Generated")
    assert len(generated) == 6 and all(text.strip() for text in generated)


SAMPLE = re.compile(r"Sample (\d+): (.*) cumulative_logprob=(\S+) finish_reason=(\w+)$")
TOKEN = re.compile(r"  token (\d+) (.*) logprob=(\S+) rank=(\d+) top: (.*)$")
TOP = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"):(-?\d+\.\d+)""")


@pytest.mark.slow
def test_engine_arguments_are_accepted_and_logprobs_read_as_vllms(tmp_path, smollm2_cache):
    """Two samples of at most 8 tokens; for each token its Logprob, ranked among the top 3 (and
    itself when outside them), and their sum is the sample's cumulative_logprob."""
    out = run_script("engine_args.py", tmp_path, smollm2_cache)
    samples: list[dict] = []
    for line in out.splitlines():
        if m := SAMPLE.match(line):
            samples.append({"index": int(m[1]), "cumulative": float(m[3]), "finish": m[4],
                            "tokens": []})
        elif m := TOKEN.match(line):
            top = [(ast.literal_eval(t), float(lp)) for t, lp in TOP.findall(m[5])]
            samples[-1]["tokens"].append((ast.literal_eval(m[2]), float(m[3]), int(m[4]), top))
    assert [s["index"] for s in samples] == [0, 1], out
    for sample in samples:
        assert 1 <= len(sample["tokens"]) <= 8
        assert (sample["finish"] == "length") == (len(sample["tokens"]) == 8)
        for text, logprob, rank, top in sample["tokens"]:
            values = [lp for _, lp in top]
            assert values == sorted(values, reverse=True)
            assert len(top) == (3 if rank <= 3 else 4)
            listed, listed_logprob = top[min(rank, 4) - 1]  # by rank; itself last beyond the 3
            assert listed == text and abs(listed_logprob - logprob) < 1.1e-3
        total = sum(logprob for _, logprob, _, _ in sample["tokens"])
        assert sample["cumulative"] == pytest.approx(total, abs=1e-3)


@pytest.mark.slow
def test_the_openai_client_against_the_server_started_with_vllms_flags(tmp_path, smollm2_cache):
    with served_by_cli(SERVER_ARGS, cwd=tmp_path, env={"EGMLA_CACHE": str(smollm2_cache)}) \
            as (url, proc):
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 401  # --api-key holds
        out = run_script("openai_client.py", tmp_path, smollm2_cache,
                         env={"OPENAI_API_BASE": url + "/v1"})
    assert proc.returncode == 0  # SIGTERM: a clean shutdown
    log = proc.stdout.read()
    for accepted in ("tensor_parallel_size=1", "trust_remote_code=True", "disable_log_requests=True",
                     "gpu_memory_utilization=0.9"):
        assert f"{accepted} accepted" in log, log[-3000:]
    assert fields(out, "Models") == [[MODEL]]
    assert fields(out, "Completion")[0].strip()
    usage = re.search(r"Usage: (\d+) prompt tokens, (\d+) completion tokens", out)
    assert usage and int(usage[1]) > 0 and 1 <= int(usage[2]) <= 16
    # greedy: the streamed chat is the whole one, in more than one piece
    assert fields(out, "Streamed") == fields(out, "Chat") and fields(out, "Chat")[0].strip()
    assert fields(out, "Streamed chunks")[0] > 1
