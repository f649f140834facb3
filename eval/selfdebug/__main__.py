"""`python -m eval.selfdebug`: self-debugging code evaluation, with resampling at equal tokens.

Each problem: generate a program, run its visible tests in the sandbox, give the model the
failure (--feedback simple | unittest | trace) and let it repair, up to --max-rounds; the final
program is scored on the hidden tests (every round's program is, for pass@1 per round). Then,
unless --no-resample, the same problems are resampled from scratch at --resample-temperature
until a sample passes the visible tests or the tokens self-debug spent on that problem run out.

    python -m eval.selfdebug --dataset humaneval --model SmolLM2-135M-Instruct --out runs/sd
    python -m serve --model SmolLM2-135M-Instruct --port 8000 &
    python -m eval.selfdebug --dataset mbpp --base-url http://127.0.0.1:8000/v1 \\
        --model SmolLM2-135M-Instruct --out runs/sd-mbpp

OUT gets config.json, traces.jsonl (one line per problem and method, appended as each
finishes), summary.md, summary.json and passrate_vs_tokens.png. Re-running the same command
resumes: finished problems are not redone. Exit status: 0 done, 1 the endpoint failed mid-run
(what finished is saved; re-run to resume), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import warnings
from pathlib import Path

from egmla.files import output_directory
from eval.selfdebug.datasets import DATASETS, DatasetError, load_dataset
from eval.selfdebug.loop import (
    FEEDBACK,
    BackendError,
    EngineBackend,
    OpenAIBackend,
    SelfDebug,
    Settings,
    completed,
)
from eval.selfdebug.report import write_atomic
from serve.__main__ import positive_int

TRACES = "traces.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.selfdebug", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help=f"one of: {', '.join(DATASETS)}")
    p.add_argument("--model", required=True,
                   help="in-process: a training export directory or a known model name "
                        "(SmolLM2-135M-Instruct); with --base-url: the served model name")
    p.add_argument("--out", type=output_directory, required=True, help="run directory (created; resumable)")
    p.add_argument("--base-url", type=endpoint_url,
                   help="an OpenAI-compatible endpoint, e.g. http://host:8000/v1, instead of the "
                        "in-process engine")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the endpoint's key (%(default)s); it is "
                        "never passed into the sandbox")
    p.add_argument("--concurrency", type=positive_int, default=64,
                   help="requests in flight to --base-url (%(default)s)")
    p.add_argument("--group-size", type=positive_int, default=64,
                   help="problems run together to the end before the next group: one batch per "
                        "round; results are saved group by group (%(default)s)")
    p.add_argument("--limit", type=int, help="only the first N problems")
    p.add_argument("--max-rounds", type=int, default=3, help="repair rounds after the first "
                                                             "generation (%(default)s; at most 100)")
    p.add_argument("--feedback", choices=FEEDBACK, default="unittest",
                   help="what a failure tells the model (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="per generation (%(default)s)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="sandbox seconds per program and test set (%(default)s)")
    p.add_argument("--no-resample", action="store_true", help="skip the resampling baseline")
    p.add_argument("--resample-temperature", type=float, default=0.8, help="(%(default)s)")
    p.add_argument("--resample-max-samples", type=int, default=16,
                   help="cap on samples per problem, whatever the budget (%(default)s; at "
                        "most 10,000)")
    p.add_argument("--samples", type=int, default=0,
                   help="also draw N plain samples per problem at --resample-temperature, for "
                        "pass@k with the unbiased estimator (%(default)s: none; at most 10,000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling (%(default)s)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="in-process engine (%(default)s)")
    p.add_argument("--kv-cache-memory-mib", type=int, default=1024,
                   help="in-process engine KV pool (%(default)s MiB)")
    return p


def endpoint_url(text: str) -> str:
    """argparse `type=` of --base-url: an http(s) URL with a host (and a valid port, if any)."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://host[:port]/... or https://")
    return text


# The option each Settings field comes from, for messages about a bad value.
FLAGS = {"timeout_s": "--timeout"}


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings(max_rounds=args.max_rounds, feedback=args.feedback,
                            max_tokens=args.max_tokens, timeout_s=args.timeout,
                            resample=not args.no_resample,
                            resample_temperature=args.resample_temperature,
                            resample_max_samples=args.resample_max_samples,
                            samples=args.samples, seed=args.seed)
    except ValueError as e:  # "name=value: ..." said with the option's name
        name, _, rest = str(e).partition("=")
        return fail(f"{FLAGS.get(name, '--' + name.replace('_', '-'))} {rest}")
    try:
        problems = load_dataset(args.dataset)
    except (ValueError, DatasetError) as e:
        return fail(str(e))
    if args.limit is not None:
        if args.limit < 1:
            return fail(f"--limit {args.limit}: must be >= 1")
        problems = problems[:args.limit]
    config = {"dataset": args.dataset, "problems": len(problems), "model": args.model,
              "backend": args.base_url or "in-process engine", "settings": vars(settings)}
    out = args.out
    previous = out / "config.json"
    try:
        if previous.exists():
            old = json.loads(previous.read_text())
            if not isinstance(old, dict):
                raise ValueError(f"{previous}: not a run's config (a JSON {type(old).__name__})")
            # settings added since that run take their defaults, which reproduce the old loop
            old["settings"] = {**vars(Settings()), **old.get("settings", {})}
            if {k: old.get(k) for k in config} != config:
                return fail(f"{out} holds a run with other settings ({previous}); resume with "
                            "the same options or choose another --out")
        records = resume(out / TRACES)
    except (OSError, ValueError) as e:
        return fail(f"{out}: {e}")
    done = completed(records)
    if records:
        print(f"resuming: {len(records)} finished attempts in {out / TRACES}", file=sys.stderr)
    wanted = [(p.task_id, "selfdebug", 0) for p in problems]
    wanted += [(p.task_id, "resample", 0) for p in problems] if settings.resample else []
    wanted += [(p.task_id, "sample", i) for p in problems for i in range(settings.samples)]
    try:  # a finished run only re-renders its report: no model is loaded
        backend = make_backend(args) if set(wanted) - done else None
    except BackendError as e:
        return fail(str(e))
    try:  # the run's config, once its backend is there: a failed start leaves nothing behind
        if not previous.exists():
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(previous, json.dumps(config, indent=1).encode())
    except OSError as e:
        return fail(f"{out}: {e}")
    loop = SelfDebug(backend, settings, out / TRACES, group_size=args.group_size,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    try:
        records += loop.run_selfdebug(problems, done)
        if settings.resample:
            by_task = {r["task_id"]: r for r in records if r["method"] == "selfdebug"}
            records += loop.run_resample(problems, by_task, done)
        if settings.samples:
            records += loop.run_samples(problems, done)
    except BackendError as e:
        print(f"error: the endpoint failed: {e}\n{len(resume(out / TRACES))} attempts are saved "
              f"in {out / TRACES}; run the same command again to resume", file=sys.stderr)
        return 1
    from egmla.provenance import provenance
    from eval.selfdebug.report import write_report

    meta = {**config, "traces": str(out / TRACES), "provenance": provenance(sys.argv)}
    print(write_report(records, out, meta)["md"].read_text())  # summarized once, printed as saved
    return 0


def resume(path: Path) -> list[dict]:
    """The finished attempts of an earlier run; a line cut off by a kill is dropped for good."""
    if not path.exists():
        return []
    from eval.selfdebug.report import load_traces, require_fields

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = load_traces(path)
    require_fields(path, records, ("task_id", "method", "sample"))  # what `completed` reads
    if caught:
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in records).encode())
    return records


def make_backend(args):
    if args.base_url:
        backend = OpenAIBackend(args.base_url, args.model, args.api_key_env,
                                concurrency=max(1, args.concurrency))
        try:
            models = backend.client.models.list().data
        except backend.errors as e:
            raise BackendError(f"cannot reach {args.base_url}: {type(e).__name__}: {e}") from None
        # A request the endpoint refuses is recorded as a failed attempt (a conversation grown
        # past the context): one that every request would exceed is refused here instead.
        card = next((m for m in models if m.id == args.model), None)
        limit = getattr(card, "max_model_len", None) if card is not None else None
        if isinstance(limit, int) and args.max_tokens >= limit:
            raise BackendError(f"--max-tokens {args.max_tokens}: {args.model} at {args.base_url} "
                               f"takes at most {limit} tokens, prompt included")
        return backend
    from serve import LLM

    try:
        llm = LLM(args.model, block_size=args.block_size,
                  kv_cache_memory=args.kv_cache_memory_mib << 20)
    except (OSError, ValueError, KeyError) as e:
        raise BackendError(f"cannot load model {args.model!r}: {e}") from None
    return EngineBackend(llm)


if __name__ == "__main__":
    sys.exit(main())
