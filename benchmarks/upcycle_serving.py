"""What the converted SmolLM2 models buy a server: sequences of 2,048 tokens in a fixed KV budget.

For the original SmolLM2-135M-Instruct (GQA: 11,520 cached elements per token) and each given
export (MLA and EG-MLA conversions, `studies.upcycling`), in one run, float32, the same budget:
the blocks the budget holds (the bytes `PagedKVCache` allocates, checked against
`cache_spec()`), how many 2,048-token sequences fit, and decode tokens/s through the engine
with that many sequences at once (at most --max-seqs) and with the number the original fits,
so that both the gain from capacity and the cost per token show. Every engine is filled first
(the prefills, untimed), then the timed decode windows run interleaved, each repeat timing
every engine in turn, the order rotating; the median of the repeats is reported, and each
speed as the per-repeat ratio to the original's in the same repeat.

    python benchmarks/upcycle_serving.py --model mla24=runs/upcycle/mla-dc24-s0/export \\
        --model egmla-kv24=runs/upcycle/egmla-kv-dc24-s0/export
    python benchmarks/upcycle_serving.py --quick ...   # a smoke test: 16 MiB, 256 tokens

Writes benchmarks/results/upcycle/serving.{json,md} (serving_quick.* with --quick; --out
elsewhere).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # measure the checkout this script is in
from egmla.checkpoint import CheckpointError, read_export_config  # noqa: E402
from egmla.files import output_directory, write_json, write_text  # noqa: E402
from egmla.provenance import machine_memory_bytes  # noqa: E402
from eval.stats import paired_ratios  # noqa: E402 - the checkout's, after the line above
from serve.__main__ import positive_int  # noqa: E402
_spec = importlib.util.spec_from_file_location("serve_capacity", HERE / "serve_capacity.py")
serve_capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_capacity)
SOURCE = "SmolLM2-135M-Instruct"


# --quick changes these defaults; an option given explicitly still wins
QUICK = {"kv_mib": 16, "seq_len": 256, "measure_steps": 3, "repeats": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=[], metavar="NAME=EXPORT",
                   help="a converted export to measure beside the original (repeatable)")
    p.add_argument("--kv-mib", type=positive_int, default=256, help="the KV budget (default 256 MiB)")
    p.add_argument("--seq-len", type=positive_int, default=2048,
                   help="tokens per sequence (default 2048), at most every model's context")
    p.add_argument("--decode-tokens", type=positive_int, default=16,
                   help="of which at least this many generated (default 16; more where many "
                        "sequences decode at once); the rest is prompt")
    p.add_argument("--measure-steps", type=positive_int, default=8,
                   help="decode steps timed with every sequence decoding (default 8)")
    p.add_argument("--max-seqs", type=positive_int, default=32, help="concurrency cap (default 32)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--repeats", type=positive_int, default=3, help="default 3 (1 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: by default 16 MiB, 256-token sequences, 3 steps, 1 repeat "
                        "(options given explicitly still apply)")
    p.add_argument("--out", type=output_directory, default=HERE / "results" / "upcycle",
                   help="where the record goes (default benchmarks/results/upcycle)")
    args = p.parse_args(argv)
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    names = set()
    for item in args.model:
        name, _, path = item.partition("=")
        if not (name and path):
            p.error(f"--model {item!r}: expected NAME=EXPORT")
        if name in names or name == "original":
            p.error(f"--model {item!r}: the name {name!r} is taken (each once; 'original' is "
                    f"{SOURCE})")
        names.add(name)
        try:
            context = read_export_config(path)[0].max_seq_len
        except CheckpointError as err:  # missing, not an export, unreadable
            p.error(f"--model {item!r}: {err}")
        if args.seq_len > context:
            p.error(f"--seq-len {args.seq_len} exceeds {name}'s context {context}")
    if args.decode_tokens >= args.seq_len:
        p.error(f"--decode-tokens {args.decode_tokens} must be < --seq-len {args.seq_len}")
    memory = machine_memory_bytes()
    if memory is not None and args.kv_mib * 2**20 > memory:
        p.error(f"--kv-mib {args.kv_mib}: more than this machine's memory "
                f"({memory // 2**20:,} MiB)")
    return args


def usage_error(message: str) -> int:
    """A bad input found after the arguments were read (it needed a model): one line, exit 2."""
    print(f"upcycle_serving.py: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    from egmla.checkpoint import load_export
    from egmla.imports import load_pretrained
    from egmla.provenance import provenance

    args = parse_args(argv)
    models = {"original": load_pretrained(SOURCE, dtype=torch.float32)[0].eval()}
    if args.seq_len > (context := models["original"].config.max_seq_len):
        return usage_error(f"--seq-len {args.seq_len} exceeds {SOURCE}'s context {context}")
    for item in args.model:
        name, path = item.split("=", 1)
        models[name] = load_export(path, dtype=torch.float32).eval()
    caps = {name: serve_capacity.capacity(name, m, args) for name, m in models.items()}
    short = [n for n, c in caps.items() if c["fit_sequences"] < 1]
    if short:
        return usage_error(f"--kv-mib {args.kv_mib} holds no sequence of --seq-len {args.seq_len} "
                           f"for {', '.join(short)}: give a larger budget")
    common = min(caps["original"]["fit_sequences"], args.max_seqs)
    for name in models:  # before any engine is filled: every one must have room to decode
        for n in {min(caps[name]["fit_sequences"], args.max_seqs), common}:
            if Decoding.tokens_to_generate(args, n) >= args.seq_len:
                return usage_error(f"--seq-len {args.seq_len}: too short to decode {n} sequences "
                                   f"for {args.repeats} x {args.measure_steps} steps")
    # Every model's engines are filled first (the prefills, untimed: the costly part), then the
    # decode windows run interleaved: each repeat times --measure-steps steps of every engine
    # in turn, the order rotating each repeat.
    engines = {}
    for name, model in models.items():
        for key, n in (("at_fit", min(caps[name]["fit_sequences"], args.max_seqs)),
                       ("at_common", common)):
            engines[name, key] = Decoding(model, args, n)
            print(f"{name}: {n} sequences prefilled ({key})", flush=True)
    runs: dict[str, dict[str, list[float]]] = {n: {"at_fit": [], "at_common": []} for n in models}
    order = list(engines)
    for repeat in range(args.repeats):
        for name, key in order[repeat % len(order):] + order[:repeat % len(order)]:
            runs[name][key].append(engines[name, key].window(args.measure_steps))
        print(f"repeat {repeat}: " + ", ".join(
            f"{n} {runs[n]['at_fit'][-1]:.1f} / {runs[n]['at_common'][-1]:.1f}" for n in models)
            + " tok/s (as many as fit / as many as the original fits)", flush=True)
    rows = []
    for name in models:
        row = {**caps[name], "kv_elements_per_token": models[name].cache_spec().elements_per_token()}
        for key in ("at_fit", "at_common"):
            tps = runs[name][key]
            row[key] = {"concurrency": engines[name, key].n,
                        "prompt_tokens": engines[name, key].prompt_len,
                        "decode_tokens_per_s_median": statistics.median(tps),
                        "decode_tokens_per_s": tps,
                        # each repeat's tok/s over the original's in the same repeat
                        "ratio_to_original": paired_ratios(tps, runs["original"][key])}
        rows.append(row)
    meta = {**provenance(), "config": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()}, "load_avg": os.getloadavg(),
            "exports": {name: export_identity(path) for name, path in
                        (item.split("=", 1) for item in args.model)},
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = args.out
    stem = "serving_quick" if args.quick else "serving"
    write_json(out / f"{stem}.json", {"meta": meta, "rows": rows}, parents=True)
    md = markdown(meta, rows, args)
    write_text(out / f"{stem}.md", md)
    print(md)
    return 0


def export_identity(path: str) -> dict:
    """What an export measured was: its weights' sha256 and how it was converted (the cost
    measured here depends on the architecture, not on the weights)."""
    import hashlib

    weights = Path(path) / "model.safetensors"
    digest = hashlib.sha256()
    with weights.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    upcycle = json.loads((Path(path) / "config.json").read_text()).get("extra", {}).get("upcycle")
    return {"path": str(path), "sha256": digest.hexdigest(),
            "conversion": {**upcycle["options"], "calibration_tokens": upcycle.get(
                "calibration_tokens")} if upcycle else None}


class Decoding:
    """An engine holding n sequences of --seq-len tokens, all prefilled and decoding: enough
    tokens are left to generate (at least --decode-tokens) for every timed window to be n
    sequences decoding together, whatever n is (a sequence starts decoding while the later
    ones prefill, so with few tokens to generate the first would finish before the last
    began)."""

    def __init__(self, model, args, n: int) -> None:
        import random

        from serve import SamplingParams

        self.n = n
        self.engine, _ = serve_capacity.engine_for(model, args.kv_mib * 2**20, args.block_size, n,
                                                   args.max_batched_tokens)
        generate = self.tokens_to_generate(args, n)
        if generate >= args.seq_len:
            raise SystemExit(f"--seq-len {args.seq_len}: too short to decode {n} sequences for "
                             f"{args.repeats} x {args.measure_steps} steps")
        self.prompt_len = args.seq_len - generate
        rng = random.Random(args.seed)
        for _ in range(n):
            self.engine.add_request(
                [rng.randrange(model.config.vocab_size) for _ in range(self.prompt_len)],
                SamplingParams(max_tokens=generate, temperature=0))
        while not self._decoding():
            if not self.engine.has_unfinished():
                raise SystemExit(f"{n} sequences finished before all of them were decoding")
            self.engine.step()

    @staticmethod
    def tokens_to_generate(args, n: int) -> int:
        """Tokens each of n sequences is left to generate: enough for every timed window."""
        prefill_steps = -(-n * args.seq_len // args.max_batched_tokens) + n  # chunks, boundaries
        return max(args.decode_tokens, prefill_steps + args.repeats * args.measure_steps + 2)

    def _decoding(self) -> bool:
        e = self.engine
        return not e.waiting and len(e.running) == self.n and all(s.output for s in e.running)

    def window(self, steps: int) -> float:
        """Decode tokens/s over `steps` steps in which all n sequences decode."""
        started = time.perf_counter()
        for _ in range(steps):
            if not self._decoding():
                raise SystemExit(f"{self.n} sequences: one stopped decoding inside a window")
            self.engine.step()
        return self.n * steps / (time.perf_counter() - started)


def markdown(meta: dict, rows: list[dict], args) -> str:
    lengths = sorted({r[k]["prompt_tokens"] for r in rows for k in ("at_fit", "at_common")})
    prompts = f"{lengths[0]:,}" if len(lengths) == 1 else f"{lengths[0]:,}-{lengths[-1]:,}"
    lines = [f"# Converted SmolLM2 served at a fixed KV budget ({args.kv_mib} MiB, float32)", "",
             f"{meta['time_utc']}; git {meta['git']['sha'][:10]}"
             f"{' (dirty tree)' if meta['git']['dirty'] else ''}; "
             f"load {', '.join(f'{x:.2f}' for x in meta['load_avg'])}. Sequences of "
             f"{args.seq_len} tokens, prompt and generated ({prompts}-token prompts: the more "
             "sequences, the more tokens each is left to generate, so that every timed step "
             f"has all of them decoding); decode tok/s over {args.measure_steps} steps with "
             f"every sequence decoding, median of {args.repeats} interleaved repeats; x "
             "original: the median of the per-repeat ratios to the original's tok/s in the same "
             "repeat, with the 95% interval of their mean. N: sequences decoding at once, as "
             "many as fit (at most --max-seqs), then as many as the original fits.", "",
             f"Machine: {meta['hardware']['cpu']}, {meta['hardware']['cpu_count']} cores.", "",
             "| model | KV elem./token | KV bytes/token | blocks | sequences fit | N | decode tok/s "
             "| x original | N common | decode tok/s | x original |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def times(r):
        spread = "" if r["low"] is None else f" [{r['low']:.2f}, {r['high']:.2f}]"
        return f"{r['median']:.2f}x{spread}"

    for r in rows:
        a, c = r["at_fit"], r["at_common"]
        lines.append(f"| {r['model']} | {r['kv_elements_per_token']:,} | "
                     f"{r['kv_bytes_per_token']:,} | {r['blocks']:,} | {r['fit_sequences']:,} | "
                     f"{a['concurrency']} | {a['decode_tokens_per_s_median']:,.1f} | "
                     f"{times(a['ratio_to_original'])} | {c['concurrency']} | "
                     f"{c['decode_tokens_per_s_median']:,.1f} | {times(c['ratio_to_original'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
