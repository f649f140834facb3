"""The self-debug loop: code extraction, feedback, rounds, accounting, resampling at equal
tokens, resume, bad input, and the same results in-process and through the HTTP server.

The loop and the sandbox are real throughout; where a test needs replies it can predict, a
scripted model stands in for the language model (the one thing that cannot be made to fail on
purpose)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eval.selfdebug.datasets import load_humaneval, load_mbpp
from eval.selfdebug.loop import (
    Completion,
    EngineBackend,
    OpenAIBackend,
    SelfDebug,
    Settings,
    extract_code,
    feedback_message,
    program_for,
)
from sandbox import run

ADD = load_humaneval()[53]  # def add(x: int, y: int): 2 visible examples


class Scripted:
    """A model that answers from a list per problem, one reply per call, and counts calls."""

    name = "scripted"

    def __init__(self, replies: dict[str, list[str]]) -> None:
        self.replies, self.calls, self.seen = replies, 0, []

    def complete(self, requests):
        out = []
        for r in requests:
            task = next(t for t in self.replies if t in r.messages[1]["content"])
            turn = sum(m["role"] == "assistant" for m in r.messages)
            text = self.replies[task][min(turn, len(self.replies[task]) - 1)]
            self.calls += 1
            self.seen.append(r)
            out.append(Completion(text, 100 + 10 * turn, len(text.split()), 50 * turn, 0.01))
        return out


def fenced(code: str) -> str:
    return f"Here you go:\n```python\n{code}```\nDone."


def test_code_extraction():
    assert extract_code(fenced("def f():\n    return 1\n")) == "def f():\n    return 1\n"
    assert extract_code("```\ndef f(): pass\n```") == "def f(): pass\n"
    assert extract_code("```python\ndef f():\n    return 1\n") == "def f():\n    return 1\n"
    assert extract_code("def f():\n    return 2\n") == "def f():\n    return 2\n"
    assert extract_code("I cannot help with that.") is None
    assert extract_code("x = 1") is None  # bare text with no function is not taken as code


def test_humaneval_programs_keep_the_prompts_imports():
    p = load_humaneval()[0]  # from typing import List
    whole = program_for(p, "def has_close_elements(numbers: List[float], t: float) -> bool:\n"
                           "    return False\n")
    assert whole.startswith("from typing import List\n")
    body = program_for(p, "    return False\n")
    assert body.startswith(p.prompt) and body.endswith("    return False\n")
    mbpp = load_mbpp()[0]
    assert program_for(mbpp, "def f(): pass\n") == "def f(): pass\n"


def test_humaneval_programs_take_no_docstring_line_for_an_import():
    """HumanEval/99, 115 and 129 have docstring lines that begin with "from"/"import": taken as
    imports, they made each reference solution an IndentationError."""
    problems = {p.task_id: p for p in load_humaneval()}
    for task in ("HumanEval/99", "HumanEval/115", "HumanEval/129"):
        p = problems[task]
        program = program_for(p, p.reference)  # the prompt and the canonical solution
        compile(program, task, "exec")  # raised IndentationError before
        assert run(program, p.visible_tests).status == "passed", task


def test_feedback_modes_say_what_failed():
    program = program_for(ADD, "def add(x, y):\n    s = x + y\n    return s + 1\n")
    verdict = run(program, ADD.visible_tests, trace=True)
    simple = feedback_message("simple", verdict)
    unit = feedback_message("unittest", verdict)
    trace = feedback_message("trace", verdict)
    assert "Expected" not in simple and "```python" in simple
    assert "Expected: 5\nActual: 6" in unit and "add(2, 3)" in unit and "line" not in unit.lower()
    assert "Execution trace" in trace and "s=5" in trace
    error = run("def add(x, y):\n    return x / 0\n", ADD.visible_tests)
    assert "ZeroDivisionError: division by zero (line 2)" in feedback_message("unittest", error)
    assert "no Python code block" in feedback_message("unittest", None)


def test_rounds_stop_at_a_visible_pass_and_every_round_is_accounted(tmp_path):
    model = Scripted({"def add(": [
        "Sorry, no code.",
        fenced("def add(x: int, y: int):\n    return x + y + 1\n"),
        fenced("def add(x: int, y: int):\n    return x + y\n"),
        fenced("def add(x: int, y: int):\n    return 0\n")]})
    loop = SelfDebug(model, Settings(max_rounds=3, resample=False), tmp_path / "t.jsonl",
                     progress=lambda m: None)
    [record] = loop.run_selfdebug([ADD], done=set())
    statuses = [(r["visible_status"], r["hidden_status"]) for r in record["rounds"]]
    assert statuses == [("no_code", "no_code"), ("failed", "failed"), ("passed", "passed")]
    assert model.calls == 3 and record["visible_passed"] and record["hidden_passed"]
    assert [r["code_found"] for r in record["rounds"]] == [False, True, True]
    assert [r["sandbox_runs"] for r in record["rounds"]] == [0, 2, 2]
    assert record["tokens"] == sum(r["prompt_tokens"] + r["completion_tokens"]
                                   for r in record["rounds"])
    feedback = model.seen[2].messages[-1]["content"]  # what round 2 was told
    assert "Expected: 5\nActual: 6" in feedback
    assert [m["role"] for m in model.seen[2].messages] == [
        "system", "user", "assistant", "user", "assistant", "user"]
    assert json.loads((tmp_path / "t.jsonl").read_text()) == record


def test_resampling_spends_at_most_the_self_debug_tokens(tmp_path):
    wrong = fenced("def add(x: int, y: int):\n    return x - y\n")
    model = Scripted({"def add(": [wrong]})
    loop = SelfDebug(model, Settings(max_rounds=2, max_tokens=64), tmp_path / "t.jsonl",
                     progress=lambda m: None)
    [sd] = loop.run_selfdebug([ADD], done=set())
    [rs] = loop.run_resample([ADD], {ADD.task_id: sd}, done=set())
    assert rs["budget"] == sd["tokens"] and rs["tokens"] <= sd["tokens"]
    assert len(rs["rounds"]) >= 2 and not rs["visible_passed"]
    fresh = [r for r in model.seen if r.temperature > 0]
    assert all(len(r.messages) == 2 for r in fresh)  # every sample starts from scratch
    assert len({r.seed for r in fresh}) == len(fresh)


def test_a_killed_run_resumes_without_redoing_finished_problems(tmp_path):
    from eval.selfdebug.__main__ import resume

    problems = load_humaneval()[53:56]
    replies = {p.prompt.split("def ")[1].split("(")[0] + "(": [fenced("def nothing(): pass\n")]
               for p in problems}
    traces = tmp_path / "traces.jsonl"
    first = SelfDebug(Scripted(replies), Settings(max_rounds=0, resample=False), traces,
                      progress=lambda m: None)
    first.run_selfdebug(problems[:2], done=set())
    with traces.open("a") as f:
        f.write('{"task_id": "HumanEval/55", "meth')  # the kill, mid-line
    records = resume(traces)
    assert [r["task_id"] for r in records] == ["HumanEval/53", "HumanEval/54"]
    model = Scripted(replies)
    again = SelfDebug(model, Settings(max_rounds=0, resample=False), traces,
                      progress=lambda m: None)
    new = again.run_selfdebug(problems, done={(r["task_id"], r["method"], r["sample"])
                                              for r in records})
    assert [r["task_id"] for r in new] == ["HumanEval/55"] and model.calls == 1
    lines = traces.read_text().splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == [
        "HumanEval/53", "HumanEval/54", "HumanEval/55"]


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "eval.selfdebug", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    out = cli("--dataset", "apps", "--model", "x", "--out", str(tmp_path / "a"))
    assert out.returncode == 2 and "humaneval" in out.stderr and "Traceback" not in out.stderr
    out = cli("--dataset", "mbpp", "--model", "x", "--out", str(tmp_path / "b"),
              "--base-url", "http://127.0.0.1:9/v1", "--limit", "1")
    assert out.returncode == 2 and "cannot reach http://127.0.0.1:9/v1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()  # a failed start leaves nothing that blocks the next


BAD_VALUES = [
    (["--timeout", "inf"], "--timeout inf: Limits.timeout_s must be a positive number"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--resample-temperature", "-1"], "--resample-temperature -1.0: must be a finite number >= 0"),
    (["--resample-temperature", "nan"], "--resample-temperature nan"),
    (["--samples", str(10**12)], "--samples 1000000000000: must be a whole number in [0, 10,000]"),
    (["--max-tokens", "0"], "--max-tokens 0: must be a whole number in [1, 1,000,000]"),
    (["--max-rounds", "-1"], "--max-rounds -1"),
    (["--block-size", "0"], "--block-size: 0: must be >= 1"),
    (["--concurrency", "0"], "--concurrency: 0: must be >= 1"),
    (["--base-url", "http://[::1"], "--base-url: 'http://[::1': not a URL"),
    (["--base-url", "ftp://host/v1"], "expected http://host"),
    (["--out", ""], "an empty path"),
]


@pytest.mark.parametrize("args, message", BAD_VALUES, ids=[a[0] for a, _ in BAD_VALUES])
def test_a_bad_value_is_named_before_anything_loads_or_is_written(tmp_path, capsys, monkeypatch,
                                                                  args, message):
    from eval.selfdebug.__main__ import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(["--dataset", "humaneval", "--model", "/nowhere", "--out", str(tmp_path / "o"),
                     *args])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_what_is_in_the_run_directory_is_checked_before_the_model_loads(tmp_path, capsys):
    from eval.selfdebug.__main__ import main

    out = tmp_path / "o"
    out.mkdir()
    args = ["--dataset", "humaneval", "--model", "/nowhere", "--out", str(out), "--limit", "2"]
    (out / "config.json").write_text('{"dataset": "humaneval", "problems": 1}')
    assert main(args) == 2 and "holds a run with other settings" in capsys.readouterr().err
    (out / "config.json").write_text("[1]")
    assert main(args) == 2 and "not a run's config (a JSON list)" in capsys.readouterr().err
    (out / "config.json").unlink()
    (out / "traces.jsonl").write_text('{"method": "selfdebug", "sample": 0}\n{"task_id": "x"}\n')
    err = (main(args), capsys.readouterr().err)
    assert err[0] == 2 and "record 1 has no task_id" in err[1], err
    assert sorted(p.name for p in out.iterdir()) == ["traces.jsonl"]  # nothing written or changed


@pytest.mark.slow
def test_the_server_gives_the_in_process_results(smollm2_llm, tmp_path):
    from support.server import MODEL, serving

    from serve import LLM

    problems = load_humaneval()[:2]
    settings = Settings(max_rounds=1, max_tokens=32, resample_max_samples=2)

    def evaluate(backend, name):
        loop = SelfDebug(backend, settings, tmp_path / f"{name}.jsonl", progress=lambda m: None)
        records = loop.run_selfdebug(problems, set())
        records += loop.run_resample(problems, {r["task_id"]: r for r in records}, set())
        for r in records:
            r.pop("wall_s")
            for rnd in r["rounds"]:
                for key in ("sandbox_s", "generate_s", "cached_tokens"):
                    rnd.pop(key)
        return records

    local = evaluate(EngineBackend(LLM(smollm2_llm.model, smollm2_llm.tokenizer,
                                       num_blocks=512)), "local")
    served = LLM(smollm2_llm.model, smollm2_llm.tokenizer, num_blocks=512)
    with serving(served) as url:
        remote = evaluate(OpenAIBackend(url + "/v1", MODEL), "remote")
    assert remote == local
    assert {r["method"] for r in local} == {"selfdebug", "resample"}


def test_plain_samples_give_pass_at_k(tmp_path):
    from eval.selfdebug.report import summarize

    model = Scripted({"def add(": [fenced("def add(x: int, y: int):\n    return x + y\n")]})
    loop = SelfDebug(model, Settings(samples=3), tmp_path / "t.jsonl", progress=lambda m: None)
    records = loop.run_samples([ADD], done={(ADD.task_id, "sample", 1)})
    assert [r["sample"] for r in records] == [0, 2] and model.calls == 2
    assert len({r.seed for r in model.seen}) == 2 and all(r.temperature > 0 for r in model.seen)
    summary = summarize(records)
    assert summary["sampling"]["pass_at_k"][0]["value"] == 1.0


@pytest.mark.slow
def test_a_request_past_the_context_is_a_counted_failure_not_a_crash(smollm2_llm):
    from eval.selfdebug.loop import Request

    backend = EngineBackend(smollm2_llm)
    huge = [{"role": "user", "content": "word " * 9000}]
    small = [{"role": "user", "content": "Say hi."}]
    refused, fine = backend.complete([Request(huge, 8), Request(small, 4)])
    assert "exceeds the model's context" in refused.error and refused.text == ""
    assert fine.error is None and fine.completion_tokens >= 1 and fine.prompt_tokens > 0


@pytest.mark.slow
def test_the_command_runs_writes_its_report_and_resumes(smollm2_llm, smollm2_cache, tmp_path):
    import os

    out = tmp_path / "run"
    args = ["--dataset", "humaneval", "--model", "SmolLM2-135M-Instruct", "--out", str(out),
            "--limit", "2", "--max-rounds", "1", "--max-tokens", "24", "--resample-max-samples",
            "2"]
    env = {**os.environ, "EGMLA_CACHE": str(smollm2_cache)}
    first = subprocess.run([sys.executable, "-m", "eval.selfdebug", *args], capture_output=True,
                           text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Self-debug: pass@1 after each repair round" in first.stdout
    records = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["method"]) for r in records) == [
        ("HumanEval/0", "resample"), ("HumanEval/0", "selfdebug"),
        ("HumanEval/1", "resample"), ("HumanEval/1", "selfdebug")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["model"] == "SmolLM2-135M-Instruct"
    assert summary["meta"]["provenance"]["git"]["sha"]
    assert (out / "passrate_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run([sys.executable, "-m", "eval.selfdebug", *args], capture_output=True,
                           text=True, timeout=600, env=env)
    assert again.returncode == 0 and "resuming: 4 finished attempts" in again.stderr
    assert (out / "traces.jsonl").read_text().count("\n") == 4  # nothing redone


def test_groups_finish_one_after_another(tmp_path):
    problems = load_humaneval()[53:58]
    replies = {p.prompt.split("def ")[1].split("(")[0] + "(": [fenced("def nothing(): pass\n")]
               for p in problems}
    model = Scripted(replies)
    batches = []
    model.complete = (lambda inner: lambda requests: batches.append(len(requests))
                      or inner(requests))(model.complete)
    loop = SelfDebug(model, Settings(max_rounds=1, resample=False), tmp_path / "t.jsonl",
                     progress=lambda m: None, group_size=2)
    records = loop.run_selfdebug(problems, done={("HumanEval/54", "selfdebug", 0)})
    assert [r["task_id"] for r in records] == ["HumanEval/53", "HumanEval/55", "HumanEval/56",
                                               "HumanEval/57"]
    assert batches == [2, 2, 2, 2]  # two rounds per group of two, never more than a group


def test_max_tokens_past_the_endpoints_context_is_refused_before_any_attempt(tmp_path, capsys):
    """Every request would be refused by the server and recorded as a failed attempt: the
    endpoint's model card (max_model_len) says so first."""
    import torch

    from egmla.models import Transformer
    from egmla.presets import preset
    from eval.selfdebug.__main__ import main
    from serve import LLM
    from support.server import serving

    torch.manual_seed(0)
    tiny = LLM(Transformer(preset("tiny-egmla")), num_blocks=64, block_size=4)
    context = tiny.model.config.max_seq_len
    with serving(tiny, "tiny") as url:
        code = main(["--dataset", "humaneval", "--model", "tiny", "--base-url", url + "/v1",
                     "--out", str(tmp_path / "o"), "--max-tokens", str(context), "--limit", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"--max-tokens {context}: tiny at {url}/v1 takes at most" in err, err
    assert not (tmp_path / "o").exists()
