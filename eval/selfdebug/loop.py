"""Generate -> run the visible tests in the sandbox -> feedback -> repair, with honest accounting.

Self-debugging (Chen et al. 2023, arXiv:2304.05128): round 0 asks for a program; while it fails
its visible tests and rounds remain, the conversation grows by the failure (feedback) and the
model answers with a repaired program. Every round's program is also scored on the hidden tests,
so pass@1 after each round comes from one run. Resampling (Olausson et al. 2023,
arXiv:2306.09896) gets, per problem, the same number of tokens the self-debug run spent there:
fresh samples until one passes the visible tests or the budget is used up.

Problems run in groups; within a group they advance in lockstep, one round at a time, so each
round is one batch for the backend. Each finished problem is appended to the JSONL trace at once;
a killed run resumes from it.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sandbox import Limits, SandboxError, Verdict, run
from eval.selfdebug.datasets import Problem

FEEDBACK = ("simple", "unittest", "trace")
SYSTEM = ("You are an expert Python programmer. Answer with one complete Python program in a "
          "single ```python code block.")
CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


class BackendError(RuntimeError):
    """The model endpoint failed for a whole batch (unreachable, refused)."""


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seconds: float  # the batch's wall time, shared out in proportion to completion tokens
    error: str | None = None  # the backend refused this one request (a counted failure)


@dataclass
class Request:
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None


# ---- prompts, code extraction, feedback ----

def task_message(p: Problem) -> str:
    if "entry_point" in p.metadata:  # HumanEval: complete a function from its signature
        return ("Complete the following Python function. Reply with the whole function, "
                f"including its imports, in one ```python code block.\n\n```python\n"
                f"{p.prompt.strip()}\n```")
    tests = "\n".join(p.visible_tests)
    return (f"{p.prompt.strip()}\nYour code should pass this test:\n\n```python\n{tests}\n```\n"
            "Reply with the whole program in one ```python code block.")


def extract_code(text: str) -> str | None:
    """The first fenced code block of a reply; a bare reply counts when it parses as Python
    with a function in it. None when there is no code."""
    match = CODE_BLOCK.search(text)
    code = match.group(1) if match else text
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code.strip() + "\n" if match else None
    if not match and not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body):
        return None
    return code.strip() + "\n"


def program_for(p: Problem, code: str) -> str:
    """The program to run: for HumanEval the prompt's imports come first (or, when the reply is
    only a function body, the whole prompt)."""
    entry = p.metadata.get("entry_point")
    if not entry:
        return code
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        # top-level imports only: a docstring line that begins "from the..." is prose
        # (HumanEval/99, 115 and 129 have one), and an indented import is no module's
        imports = [line for line in p.prompt.splitlines()
                   if re.match(r"(import|from)\s+\w", line)]
        return "\n".join(imports + [code]) if imports else code
    return p.prompt + code


def feedback_message(mode: str, verdict: Verdict | None) -> str:
    fix = "Fix the program and reply with the whole corrected program in one ```python code block."
    if verdict is None:
        return "Your reply had no Python code block. " + fix
    if mode == "simple":
        return "The program does not pass the tests. " + fix
    failing = verdict.first_failure or {}
    lines = [f"The program {verdict.status} on a test: {verdict.reason}."]
    if failing.get("source"):
        lines.append(f"Test:\n```python\n{failing['source']}\n```")
    if failing.get("call"):
        lines.append(f"Call: {failing['call']}")
    if failing.get("expected") is not None:
        lines.append(f"Expected: {failing['expected']}\nActual: {failing['actual']}")
    elif failing.get("type"):
        where = f" (line {failing['line']})" if failing.get("line") else ""
        lines.append(f"{failing['type']}: {failing.get('message', '')}{where}")
    elif failing.get("message"):
        lines.append(failing["message"])
    if mode == "trace" and failing.get("trace"):
        lines.append(f"Execution trace of the failing call:\n{failing['trace']}")
    return "\n".join(lines + [fix])


# ---- backends ----

class EngineBackend:
    """The in-process engine; prefix caching lets each round reuse the conversation's blocks."""

    def __init__(self, llm) -> None:
        self.llm, self.name = llm, llm.name

    def complete(self, requests: list[Request]) -> list[Completion]:
        from serve import SamplingParams
        from serve.engine import InvalidRequest

        rows: list = [None] * len(requests)
        batch, prompts, params = [], [], []
        context = self.llm.model.config.max_seq_len
        for i, r in enumerate(requests):
            try:
                ids = self.llm.encode_chat(r.messages)
                p = SamplingParams(max_tokens=max(1, min(r.max_tokens, context - len(ids))),
                                   temperature=r.temperature, top_p=r.top_p, seed=r.seed)
                self.llm.engine.check_request(ids, p)
            except InvalidRequest as e:  # e.g. a conversation grown past the context
                rows[i] = ("", 0, 0, 0, f"refused: {e}")
                continue
            batch.append(i)
            prompts.append(ids)
            params.append(p)
        started = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        for i, o in zip(batch, outs):
            rows[i] = (o.outputs[0].text, len(o.prompt_token_ids), len(o.outputs[0].token_ids),
                       o.num_cached_tokens, None)
        return _shared_time(rows, time.perf_counter() - started)


class OpenAIBackend:
    """Any OpenAI-compatible endpoint; the key comes from an environment variable of ours, and
    the sandbox never sees our environment."""

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 concurrency: int = 64, timeout_s: float = 600.0) -> None:
        import openai

        self.name, self.concurrency = model, concurrency
        self.client = openai.OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env, "none"),
                                    max_retries=1, timeout=timeout_s)
        self.errors = (openai.APIConnectionError, openai.APIStatusError, openai.APITimeoutError)

    def complete(self, requests: list[Request]) -> list[Completion]:
        import openai

        def one(r: Request):
            extra = {"seed": r.seed} if r.seed is not None else {}
            if r.top_p is not None:
                extra["top_p"] = r.top_p
            try:
                reply = self.client.chat.completions.create(
                    model=self.name, messages=r.messages, max_tokens=r.max_tokens,
                    temperature=r.temperature, **extra)
            except openai.BadRequestError as e:  # this request only (e.g. too long)
                return "", 0, 0, 0, f"refused: {e.message}"
            usage = reply.usage
            details = getattr(usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) or 0
            return (reply.choices[0].message.content or "", usage.prompt_tokens,
                    usage.completion_tokens, cached, None)
        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(self.concurrency) as pool:
                rows = list(pool.map(one, requests))
        except self.errors as e:
            raise BackendError(f"{self.client.base_url}: {type(e).__name__}: {e}") from None
        return _shared_time(rows, time.perf_counter() - started)


def _shared_time(rows: list[tuple], seconds: float) -> list[Completion]:
    total = sum(r[2] for r in rows)
    return [Completion(text, p, c, cached, seconds * (c / total if total else 1 / len(rows)), err)
            for text, p, c, cached, err in rows]


# ---- the loop ----

# The counts a run's settings take, with bounds: (name, lowest, highest). The highest are far
# beyond any useful run and keep a typo (10**12 samples a problem) from filling the memory.
COUNTS = (("max_rounds", 0, 100), ("max_tokens", 1, 1_000_000),
          ("resample_max_samples", 1, 10_000), ("samples", 0, 10_000))


@dataclass
class Settings:
    max_rounds: int = 3
    feedback: str = "unittest"
    max_tokens: int = 256
    timeout_s: float = 10.0
    resample: bool = True
    resample_temperature: float = 0.8
    resample_top_p: float = 0.95
    resample_max_samples: int = 16
    samples: int = 0  # plain samples per problem, for pass@k (0: none)
    seed: int = 0

    def __post_init__(self) -> None:
        """Every field checked here, before a model loads or a record is written: a value a
        request would refuse (a temperature of -1) would record every attempt as failed."""
        if self.feedback not in FEEDBACK:
            raise ValueError(f"feedback={self.feedback!r}: choose one of {', '.join(FEEDBACK)}")
        for name, low, high in COUNTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name}={value!r}: must be a whole number in [{low}, {high:,}]")
        for name, ok, rule in (("resample_temperature", lambda v: 0 <= v < math.inf,
                                "a finite number >= 0"),
                               ("resample_top_p", lambda v: 0 < v <= 1, "in (0, 1]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{name}={value!r}: must be {rule}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: must be a whole number")
        try:
            Limits(timeout_s=self.timeout_s)
        except SandboxError as e:
            raise ValueError(f"timeout_s={self.timeout_s!r}: {e}") from None


@dataclass
class Attempt:
    """One problem under one method: the conversation so far and every round's accounting."""

    problem: Problem
    method: str
    sample: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)
    budget: int | None = None  # resample: tokens it may spend
    prompt_tokens: int = 0  # resample: what one fresh prompt costs
    last_visible: Verdict | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def tokens(self) -> int:
        return sum(r["prompt_tokens"] + r["completion_tokens"] for r in self.rounds)

    def record(self) -> dict:
        keep = self.final_index()
        last = self.rounds[keep]
        return {
            "task_id": self.problem.task_id, "method": self.method, "sample": self.sample,
            "rounds": self.rounds, "final_round": keep,
            "visible_passed": last["visible_status"] == "passed",
            "hidden_passed": last["hidden_status"] == "passed",
            "prompt_tokens": sum(r["prompt_tokens"] for r in self.rounds),
            "completion_tokens": sum(r["completion_tokens"] for r in self.rounds),
            "tokens": self.tokens, "budget": self.budget,
            "wall_s": round(time.perf_counter() - self.started, 3),
        }

    def final_index(self) -> int:
        if self.method == "resample":  # the first sample that passed the visible tests, else last
            return next((i for i, r in enumerate(self.rounds) if r["visible_status"] == "passed"),
                        len(self.rounds) - 1)
        return len(self.rounds) - 1


class SelfDebug:
    def __init__(self, backend, settings: Settings, traces: Path,
                 progress: Callable[[str], None] = print, workers: int = 2,
                 group_size: int = 64) -> None:
        self.backend, self.settings, self.traces = backend, settings, traces
        self.progress, self.workers, self.group_size = progress, workers, max(1, group_size)
        self.limits = Limits(timeout_s=settings.timeout_s)

    def groups(self, problems: list[Problem], method: str, done: set):
        """The problems `method` still has to do, `group_size` at a time: each group runs to the
        end before the next starts, so finished records land steadily (a kill loses one group at
        most) and a group's conversations can stay in the prefix cache between rounds."""
        todo = [p for p in problems if (p.task_id, method, 0) not in done]
        for start in range(0, len(todo), self.group_size):
            if len(todo) > self.group_size:
                self.progress(f"{method}: problems {start + 1}-"
                              f"{min(start + self.group_size, len(todo))} of {len(todo)}")
            yield todo[start:start + self.group_size]

    # one round for every attempt still going: one batch for the backend, then the sandbox
    def step(self, attempts: list[Attempt], requests: list[Request]) -> None:
        completions = self.backend.complete(requests)
        programs = []
        for a, c in zip(attempts, completions):
            code = extract_code(c.text)
            programs.append(program_for(a.problem, code) if code is not None else None)
            a.messages.append({"role": "assistant", "content": c.text})
        with ThreadPoolExecutor(self.workers) as pool:
            verdicts = list(pool.map(self.judge, attempts, programs))
        for a, c, program, (visible, hidden, sandbox_s) in zip(attempts, completions, programs,
                                                                verdicts):
            a.rounds.append({
                "round": len(a.rounds), "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens,
                "model_calls": 1, "code_found": program is not None,
                "visible_status": visible.status if visible else "no_code",
                "hidden_status": hidden.status if hidden else "no_code",
                "visible_reason": visible.reason if visible else (
                    c.error or "no code block in the reply"),
                "model_error": c.error, "program": program,
                "sandbox_runs": 2 if program is not None else 0, "sandbox_s": round(sandbox_s, 4),
                "generate_s": round(c.seconds, 4)})
            a.last_visible = visible

    def judge(self, a: Attempt, program: str | None):
        if program is None:
            return None, None, 0.0
        p = a.problem
        try:
            visible = run(program, p.visible_tests, setup=p.setup, limits=self.limits,
                          trace=self.settings.feedback == "trace")
            hidden = run(program, p.hidden_tests, setup=p.setup, limits=self.limits)
        except SandboxError as e:  # the harness failed, not the program: say so, carry on
            self.progress(f"warning: {p.task_id}: sandbox failure: {e}")
            failed = Verdict("error", f"sandbox failure: {e}")
            return failed, failed, 0.0
        return visible, hidden, visible.wall_s + hidden.wall_s

    def run_selfdebug(self, problems: list[Problem], done: set) -> list[dict]:
        return [r for group in self.groups(problems, "selfdebug", done)
                for r in self._selfdebug(group)]

    def _selfdebug(self, problems: list[Problem]) -> list[dict]:
        s = self.settings
        going = [Attempt(p, "selfdebug", messages=[{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": task_message(p)}])
                 for p in problems]
        finished = []
        for r in range(s.max_rounds + 1):
            if not going:
                break
            self.progress(f"selfdebug round {r}: {len(going)} problems")
            self.step(going, [Request(list(a.messages), s.max_tokens) for a in going])
            still = []
            for a in going:
                if a.rounds[-1]["visible_status"] == "passed" or r == s.max_rounds:
                    finished.append(self.finish(a))
                else:
                    a.messages.append({"role": "user", "content": feedback_message(
                        s.feedback, a.last_visible)})
                    still.append(a)
            going = still
        return finished

    def run_resample(self, problems: list[Problem], selfdebug: dict[str, dict], done: set
                     ) -> list[dict]:
        """Fresh samples per problem within the tokens self-debug spent on it (prompt and
        completion tokens alike); the fresh prompt is self-debug's round-0 prompt."""
        problems = [p for p in problems if p.task_id in selfdebug]
        return [r for group in self.groups(problems, "resample", done)
                for r in self._resample(group, selfdebug)]

    def _resample(self, problems: list[Problem], selfdebug: dict[str, dict]) -> list[dict]:
        s = self.settings
        going = [Attempt(p, "resample", budget=selfdebug[p.task_id]["tokens"],
                         prompt_tokens=selfdebug[p.task_id]["rounds"][0]["prompt_tokens"])
                 for p in problems]
        finished = []
        for j in range(s.resample_max_samples):
            if not going:
                break
            self.progress(f"resample sample {j}: {len(going)} problems")
            requests = []
            for a in going:
                a.messages = [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": task_message(a.problem)}]
                room = a.budget - a.tokens - a.prompt_tokens
                requests.append(Request(list(a.messages), min(s.max_tokens, max(1, room)),
                                        s.resample_temperature, s.resample_top_p,
                                        seed=_seed(s.seed, a.problem.task_id, j)))
            self.step(going, requests)
            still = []
            for a in going:
                spent = a.budget - a.tokens - a.prompt_tokens < 1  # no room for another sample
                if a.rounds[-1]["visible_status"] == "passed" or spent or \
                        j == s.resample_max_samples - 1:
                    finished.append(self.finish(a))
                else:
                    still.append(a)
            going = still
        return finished

    def run_samples(self, problems: list[Problem], done: set) -> list[dict]:
        """`samples` independent samples per problem, each scored on the hidden tests once:
        the unbiased pass@k estimator's n and c."""
        s = self.settings
        todo = [Attempt(p, "sample", sample=i) for p in problems for i in range(s.samples)
                if (p.task_id, "sample", i) not in done]
        finished = []
        for start in range(0, len(todo), 256):
            batch = todo[start:start + 256]
            self.progress(f"sampling: {start + len(batch)}/{len(todo)}")
            for a in batch:
                a.messages = [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": task_message(a.problem)}]
            self.step(batch, [Request(list(a.messages), s.max_tokens, s.resample_temperature,
                                      s.resample_top_p, _seed(s.seed + 1, a.problem.task_id,
                                                              a.sample)) for a in batch])
            finished += [self.finish(a) for a in batch]
        return finished

    def finish(self, a: Attempt) -> dict:
        record = a.record()
        with self.traces.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return record


def _seed(seed: int, task_id: str, sample: int) -> int:
    return (seed * 1_000_003 + sum(ord(ch) * 31**i for i, ch in enumerate(task_id)) * 101
            + sample) % 2**31


def completed(records: Iterable[dict]) -> set:
    return {(r["task_id"], r["method"], r["sample"]) for r in records}
