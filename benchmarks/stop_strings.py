"""Does a request with 100,000 stop strings slow the others down? (issue 39)

Starts the real server (`python -m serve`, a subprocess) on a tiny random model (tiny-mha with a
260-token byte-level BPE of its own, so that stop strings see real text) and measures one short
request's latency (`--short-tokens` 8, not streamed, wall time at the client):

- idle: nothing else running;
- loaded: while a streamed request of `--long-tokens` 128 with `--stop-strings` 100,000 random
  stop strings of `--stop-length` 40 lowercase letters runs (its JSON is 4.4 MB); the short
  request is sent once the long one has streamed its first chunk, and the run checks that the
  long one was still running when the short one finished;
- control: the same, beside the same long request without stop strings (what sharing steps
  and the event loop with a streamed request costs by itself).

The three alternate (ABC, then CBA, over `--repeats`), medians are compared: the acceptance is
loaded / idle <= 2. Also recorded, outside the acceptance: short requests sent one after
another from the moment the long one is sent until its first chunk, while the server admits it
(parsing 4.4 MB of JSON and sorting the stop strings hold the GIL, which the engine thread
shares: the worst of them is reported), the long request's time to first chunk and
total time, and the time to build the stop strings' matcher (`serve.outputs.StopStrings`, built
at admission on a worker thread, not the engine thread), measured in this process.

    python benchmarks/stop_strings.py --quick     # 2 repeats: a smoke test, about a minute
    python benchmarks/stop_strings.py             # 10 repeats, on a quiet machine

Writes benchmarks/results/stop_strings.{json,md} (stop_strings_quick.* with --quick) with the git
SHA, package versions, hardware and the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import string
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in
from egmla.devices import thread_count  # noqa: E402
from egmla.files import output_directory, write_text  # noqa: E402
from egmla.training.config import seed_arg  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

# Sane maxima, checked when the arguments are read: the stop strings are built in this process
# and sent as one JSON body (the default, 100,000 x 40, is 4.4 MB); 10**12 of them would hang
# here for ever. Output tokens are bounded by tiny-mha's context (256) less the short prompt.
MAX_STOP_STRINGS = 1_000_000
MAX_STOP_LENGTH = 1_000
MAX_STOP_BYTES = 100_000_000  # --stop-strings x --stop-length
PROMPT = "the quick brown fox"


def tiny_export(directory: Path) -> Path:
    """tiny-mha (2 layers, d=64), random init (seed 0), with a byte-level BPE tokenizer of 260
    tokens trained on one sentence, written as an export the server loads."""
    import torch

    from egmla.checkpoint import save_export
    from egmla.data.tokenizer import train_bpe
    from egmla.models import Transformer
    from egmla.presets import preset

    tokenizer = train_bpe(["the quick brown fox jumps over the lazy dog"] * 8, 260,
                          directory / "tokenizer")
    torch.manual_seed(0)
    return save_export(Transformer(preset("tiny-mha", vocab_size=260)), directory / "export",
                       tokenizer=tokenizer)


@contextlib.contextmanager
def server(export: Path, threads: int):
    """`python -m serve` on a free port; yields its URL once /health answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--model", str(export), "--port", str(port),
         "--threads", str(threads), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=10).status_code == 200:
                    break
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise SystemExit("the server did not answer /health within 300 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def short_request(http: httpx.Client, url: str, tokens: int) -> float:
    """Seconds for one short completion, at the client."""
    start = time.perf_counter()
    reply = http.post(url + "/v1/completions", json={
        "model": "export", "prompt": PROMPT, "max_tokens": tokens,
        "temperature": 0, "ignore_eos": True})
    elapsed = time.perf_counter() - start
    if reply.status_code != 200 or reply.json()["usage"]["completion_tokens"] != tokens:
        raise SystemExit(f"short request failed: {reply.status_code} {reply.text[:300]}")
    return elapsed


def _stream(url: str, body: bytes, first_chunk, results) -> None:
    """The long request's client, in a process of its own (so that reading its stream does not
    compete with the short request's client for this process's GIL)."""
    start, first, chunks = time.perf_counter(), None, 0
    try:
        with httpx.stream("POST", url + "/v1/completions", content=body, timeout=600,
                          headers={"Content-Type": "application/json"}) as reply:
            if reply.status_code != 200:
                reply.read()
                raise RuntimeError(f"{reply.status_code} {reply.text[:300]}")
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - start
                        first_chunk.set()
        results.put({"first_chunk_s": first, "total_s": time.perf_counter() - start,
                     "chunks": chunks, "ended": time.monotonic()})
    except Exception as error:  # noqa: BLE001 - reported by the parent
        results.put({"error": repr(error)})
    finally:
        first_chunk.set()


class LongRequest:
    """The streamed long request, from a child process: `first_chunk` is set once its first
    chunk arrived (or it failed); `result()` waits for its end."""

    def __init__(self, url: str, body: bytes) -> None:
        context = multiprocessing.get_context("spawn")
        self.first_chunk, self._results = context.Event(), context.Queue()
        self._process = context.Process(target=_stream, args=(url, body, self.first_chunk,
                                                              self._results), daemon=True)
        self._process.start()

    def result(self) -> dict:
        result = self._results.get(timeout=600)
        self._process.join(timeout=60)
        if "error" in result:
            raise SystemExit(f"the long request failed: {result['error']}")
        return result


def loaded_round(http: httpx.Client, url: str, body: bytes, short_tokens: int) -> dict:
    """The short request, sent once the long one (`body`) has streamed its first chunk."""
    long = LongRequest(url, body)
    long.first_chunk.wait(timeout=600)
    short = short_request(http, url, short_tokens)
    short_done = time.monotonic()
    result = long.result()
    return {"short_s": short, "long_first_chunk_s": result["first_chunk_s"],
            "long_total_s": result["total_s"], "long_chunks": result["chunks"],
            "overlapped": result["ended"] > short_done}


def admitting_round(http: httpx.Client, url: str, body: bytes, short_tokens: int) -> dict:
    """Short requests back to back from the long one's start to its first chunk."""
    long = LongRequest(url, body)
    shorts = [short_request(http, url, short_tokens)]
    while not long.first_chunk.is_set():
        shorts.append(short_request(http, url, short_tokens))
    result = long.result()
    return {"short_s": shorts, "long_first_chunk_s": result["first_chunk_s"],
            "long_total_s": result["total_s"]}


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The bounds argparse's types do not check (see MAX_*), before the server starts."""
    if args.stop_strings > MAX_STOP_STRINGS:
        parser.error(f"--stop-strings {args.stop_strings}: at most {MAX_STOP_STRINGS:,}")
    if args.stop_length > MAX_STOP_LENGTH:
        parser.error(f"--stop-length {args.stop_length}: at most {MAX_STOP_LENGTH:,}")
    if args.stop_strings * args.stop_length > MAX_STOP_BYTES:
        parser.error(f"--stop-strings {args.stop_strings} x --stop-length {args.stop_length}: "
                     f"at most {MAX_STOP_BYTES:,} letters in all")
    from egmla.presets import preset

    room = preset("tiny-mha").max_seq_len - len(PROMPT.encode())  # byte-level BPE: <= 1 token a byte
    for name in ("long_tokens", "short_tokens"):
        if getattr(args, name) > room:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at most {room} "
                         "(tiny-mha's context less the prompt)")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=10, help="idle and loaded rounds each")
    parser.add_argument("--stop-strings", type=positive_int, default=100_000,
                        help=f"at most {MAX_STOP_STRINGS:,} (100,000)")
    parser.add_argument("--stop-length", type=positive_int, default=40,
                        help=f"letters per stop string, at most {MAX_STOP_LENGTH:,} (40); "
                             f"--stop-strings x --stop-length at most {MAX_STOP_BYTES:,}")
    parser.add_argument("--long-tokens", type=positive_int, default=128)
    parser.add_argument("--short-tokens", type=positive_int, default=8)
    parser.add_argument("--threads", type=thread_count, default=1, help="the server's torch threads")
    parser.add_argument("--seed", type=seed_arg, default=0, help="0 to 2**32 - 1 (0)")
    parser.add_argument("--output-dir", type=output_directory, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="2 repeats: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 2
    check_args(parser, args)

    from egmla.provenance import provenance
    from serve.outputs import StopStrings

    load_before = os.getloadavg()
    rng = random.Random(args.seed)
    stops = ["".join(rng.choices(string.ascii_lowercase, k=args.stop_length))
             for _ in range(args.stop_strings)]
    long = {"model": "export", "prompt": "the quick brown fox", "stream": True,
            "max_tokens": args.long_tokens, "temperature": 0.8, "seed": args.seed,
            "ignore_eos": True}
    body, control = json.dumps({**long, "stop": stops}).encode(), json.dumps(long).encode()
    builds = []
    for _ in range(3):
        start = time.perf_counter()
        StopStrings(stops)
        builds.append(time.perf_counter() - start)

    idle, loaded, controlled, admitting = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="egmla-stop-strings-") as tmp:
        export = tiny_export(Path(tmp))
        with server(export, args.threads) as url, httpx.Client(timeout=600) as http:
            for _ in range(3):  # warm up: first requests pay for lazy initialization
                short_request(http, url, args.short_tokens)
            loaded_round(http, url, body, args.short_tokens)
            for r in range(args.repeats):
                order = ("idle", "loaded", "control")
                for kind in order if r % 2 == 0 else order[::-1]:
                    if kind == "idle":
                        idle.append(short_request(http, url, args.short_tokens))
                    elif kind == "loaded":
                        loaded.append(loaded_round(http, url, body, args.short_tokens))
                    else:
                        controlled.append(loaded_round(http, url, control, args.short_tokens))
                admitting.append(admitting_round(http, url, body, args.short_tokens))
                print(f"round {r + 1}/{args.repeats}: idle {idle[-1] * 1000:.1f} ms, loaded "
                      f"{loaded[-1]['short_s'] * 1000:.1f} ms, control "
                      f"{controlled[-1]['short_s'] * 1000:.1f} ms (long request "
                      f"{loaded[-1]['long_total_s']:.2f} s), during its admission up to "
                      f"{max(admitting[-1]['short_s']) * 1000:.1f} ms", flush=True)

    idle_ms = median(idle) * 1000
    loaded_ms = median([x["short_s"] for x in loaded]) * 1000
    control_ms = median([x["short_s"] for x in controlled]) * 1000
    ratio = loaded_ms / idle_ms
    summary = {
        "short_idle_ms_median": round(idle_ms, 2),
        "short_loaded_ms_median": round(loaded_ms, 2),
        "ratio": round(ratio, 3), "acceptance_ratio_at_most": 2.0, "accepted": ratio <= 2.0,
        "short_idle_ms_range": [round(min(idle) * 1000, 2), round(max(idle) * 1000, 2)],
        "short_loaded_ms_range": [round(min(x["short_s"] for x in loaded) * 1000, 2),
                                  round(max(x["short_s"] for x in loaded) * 1000, 2)],
        "short_control_ms_median": round(control_ms, 2),
        "short_control_ms_range": [round(min(x["short_s"] for x in controlled) * 1000, 2),
                                   round(max(x["short_s"] for x in controlled) * 1000, 2)],
        "control_ratio": round(control_ms / idle_ms, 3),
        "long_control_total_s_median": round(median([x["long_total_s"] for x in controlled]), 3),
        "short_admitting_ms_worst_median": round(median([max(x["short_s"]) for x in admitting])
                                                 * 1000, 2),
        "short_admitting_ms_worst": round(max(max(x["short_s"]) for x in admitting) * 1000, 2),
        "long_first_chunk_s_median": round(median([x["long_first_chunk_s"] for x in loaded]), 3),
        "long_total_s_median": round(median([x["long_total_s"] for x in loaded]), 3),
        "all_overlapped": all(x["overlapped"] for x in loaded + controlled),
        "stop_strings_build_ms_median": round(median(builds) * 1000, 1),
        "long_request_body_bytes": len(body),
    }
    p = provenance()
    meta = {**p, "git_sha": p["git"]["sha"], "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": "tiny-mha (vocab 260), random init, float32, byte-level BPE"}
    report = {"meta": meta, "summary": summary,
              "rounds": {"idle_s": idle, "loaded": loaded, "control": controlled,
                         "admitting": admitting}}
    name = "stop_strings_quick" if args.quick else "stop_strings"
    write_text(args.output_dir / f"{name}.json", json.dumps(report, indent=2) + "\n", parents=True)
    table = markdown(meta, summary, args)
    write_text(args.output_dir / f"{name}.md", table)
    print("\n" + table)


def markdown(meta: dict, s: dict, args: argparse.Namespace) -> str:
    dirty = " (dirty tree)" if meta["git"]["dirty"] else ""
    lines = [
        "# A short request beside one with 100,000 stop strings",
        "",
        (f"{meta['time_utc']}; {meta['hardware']['cpu']}; git {meta['git_sha']}{dirty}; "
         f"load average {meta['load_avg_before'][0]} before, {meta['load_avg_after'][0]} after. "
         f"tiny-mha (random init, byte-level BPE of 260 tokens), `python -m serve --threads "
         f"{args.threads}`. Short: {args.short_tokens} tokens, not streamed. Long: "
         f"{args.long_tokens} tokens streamed, {args.stop_strings:,} stop strings of "
         f"{args.stop_length} letters ({s['long_request_body_bytes']:,} bytes of JSON). "
         f"{args.repeats} interleaved rounds, medians (min..max)."),
        "",
        "| short request | latency ms |",
        "|---|---:|",
        (f"| idle | {s['short_idle_ms_median']:.1f} ({s['short_idle_ms_range'][0]:.1f}.."
         f"{s['short_idle_ms_range'][1]:.1f}) |"),
        (f"| beside the long request | {s['short_loaded_ms_median']:.1f} "
         f"({s['short_loaded_ms_range'][0]:.1f}..{s['short_loaded_ms_range'][1]:.1f}) |"),
        (f"| ratio (acceptance: <= 2) | {s['ratio']:.2f}: "
         f"{'accepted' if s['accepted'] else 'NOT accepted'} |"),
        (f"| control: beside the same long request without stop strings | "
         f"{s['short_control_ms_median']:.1f} ({s['short_control_ms_range'][0]:.1f}.."
         f"{s['short_control_ms_range'][1]:.1f}); ratio {s['control_ratio']:.2f} |"),
        (f"| during the long request's admission, the worst of back-to-back ones (not in the "
         f"acceptance) | {s['short_admitting_ms_worst_median']:.1f} (..."
         f"{s['short_admitting_ms_worst']:.1f}) |"),
        "",
        (f"The long request: first chunk after {s['long_first_chunk_s_median']:.2f} s, done after "
         f"{s['long_total_s_median']:.2f} s ({s['long_control_total_s_median']:.2f} s without its "
         f"stop strings; medians); it was still running when the short one "
         f"finished in {'every' if s['all_overlapped'] else 'NOT every'} round. Building its "
         f"matcher (`StopStrings`, at admission, off the engine thread): "
         f"{s['stop_strings_build_ms_median']:.0f} ms."),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
