"""What a smaller KV cache buys a server: capacity, decode throughput and fragmentation.

Five backbones of equal width (the small-* presets: 4 layers, d=256, 8 heads, random init,
float32), MHA, GQA, MLA, EG-MLA kv and EG-MLA latent, each given the same KV memory budget:

(a) capacity: blocks the budget holds (`cache_spec().bytes_per_token` x block size, checked
    against the bytes `PagedKVCache` allocates), how many sequences of `--seq-len` tokens fit,
    and decode tokens/s through `LLMEngine` with that many sequences at once (capped at
    `--max-seqs`), and with the number every model fits (the smallest fit), so that the gain
    from capacity and the cost per token are both visible. Decode tokens/s counts the first
    `--measure-steps` steps where every one of the N sequences decodes (after all prefills);
    the sequences are then aborted.
(b) a mixed workload at the same budget: 48 requests, prompt lengths uniform in 16..256, half
    of them behind a shared 64-token system prompt, output lengths in 16..64, all at t=0: output
    tokens/s, fragmentation (`fragmentation_mean`: unused / reserved KV slots over the run),
    preemptions, peak concurrency and prefix-cache hit rate.
(c) the same mixed workload on `--sweep-model` with block sizes 8, 16, 32, 64.

    python benchmarks/serve_capacity.py                     # 64 MiB, 512-token sequences
    python benchmarks/serve_capacity.py --quick             # smoke test, seconds
    python benchmarks/serve_capacity.py --kv-mib 32 --seq-len 256

Single runs on a shared CPU: compare models within one run, not across runs. Writes
benchmarks/results/serve_capacity.{json,md} (serve_capacity_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))  # measure the checkout this script is in
from egmla.devices import thread_count  # noqa: E402
from egmla.files import output_directory, write_json, write_text  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

MODELS = ["small-mha", "small-gqa2", "small-mla", "small-egmla", "small-egmla-latent"]


def build(name: str):
    from egmla.models import Transformer
    from egmla.presets import preset

    torch.manual_seed(0)
    return Transformer(preset(name)).eval()


def engine_for(model, kv_bytes: int, block_size: int, max_seqs: int, max_batched_tokens: int):
    """An engine whose block pool is the most `kv_bytes` holds; checks analytic == allocated."""
    from serve import EngineConfig, LLMEngine

    per_block = model.cache_spec().bytes_per_token(torch.float32) * block_size
    engine = LLMEngine(model, EngineConfig(block_size=block_size, kv_cache_memory=kv_bytes,
                                           max_num_seqs=max_seqs,
                                           max_num_batched_tokens=max_batched_tokens))
    num_blocks, allocated = engine.config.num_blocks, engine.cache.nbytes()
    if num_blocks != kv_bytes // per_block or allocated != num_blocks * per_block:
        raise SystemExit(f"{type(model.layers[0].attn).__name__}: PagedKVCache allocated "
                         f"{allocated} bytes in {num_blocks} blocks; cache_spec says "
                         f"{kv_bytes // per_block} blocks of {per_block}")
    return engine, per_block


def warm_up(model) -> None:
    from serve import EngineConfig, LLMEngine, SamplingParams

    LLMEngine(model, EngineConfig(num_blocks=32)).generate([[1] * 40, [2] * 9],
                                                          SamplingParams(max_tokens=4, temperature=0))


# ---- (a) capacity and decode throughput at full concurrency ------------------------------------


def decode_throughput(model, args, n: int) -> dict:
    """n sequences of seq_len tokens (seq_len - decode_tokens prompt, decode_tokens generated);
    tokens/s over the steps where all n decode together."""
    from serve import SamplingParams

    engine, _ = engine_for(model, args.kv_mib * 2**20, args.block_size, n, args.max_batched_tokens)
    rng = random.Random(args.seed)
    prompt_len = args.seq_len - args.decode_tokens
    ids = [engine.add_request([rng.randrange(model.config.vocab_size) for _ in range(prompt_len)],
                              SamplingParams(max_tokens=args.decode_tokens, temperature=0)) for _ in range(n)]
    steps, seconds = 0, 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished() and steps < args.measure_steps:
        full = (not engine.waiting and len(engine.running) == n
                and all(s.output for s in engine.running))
        t = time.perf_counter()
        engine.step()
        if full:
            steps, seconds = steps + 1, seconds + time.perf_counter() - t
    for i in ids:  # measured enough: stop the rest
        engine.abort(i)
    m = engine.metrics()
    return {"concurrency": n, "decode_steps_measured": steps,
            "decode_tokens_per_s": round(n * steps / seconds, 1) if steps else None,
            "decode_step_ms": round(1000 * seconds / steps, 2) if steps else None,
            "wall_s": round(time.perf_counter() - t0, 2), "preemptions": m["preemptions"],
            "peak_running": m["peak_running"]}


def capacity(name: str, model, args) -> dict:
    engine, per_block = engine_for(model, args.kv_mib * 2**20, args.block_size, 1,
                                   args.max_batched_tokens)
    blocks = engine.config.num_blocks
    per_seq = -(-args.seq_len // args.block_size)
    del engine
    return {"model": name, "attention": type(model.layers[0].attn).__name__,
            "params": sum(p.numel() for p in model.parameters()),
            "kv_bytes_per_token": model.cache_spec().bytes_per_token(torch.float32),
            "block_bytes": per_block, "blocks": blocks, "fit_sequences": blocks // per_seq}


# ---- (b), (c) mixed workload ------------------------------------------------------------------


def mixed_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab_size) for _ in range(args.shared_prefix)]
    lo, hi = args.mixed_prompt_lens
    requests = []
    for i in range(args.mixed_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))]
        requests.append(((system if i % 2 == 0 else []) + prompt,
                         rng.randint(*args.mixed_output_lens)))
    return requests


def run_mixed(model, args, block_size: int, workload) -> dict:
    from serve import SamplingParams

    engine, _ = engine_for(model, args.kv_mib * 2**20, block_size, args.max_seqs,
                           args.max_batched_tokens)
    t0 = time.perf_counter()
    for prompt, k in workload:
        engine.add_request(prompt, SamplingParams(max_tokens=k, temperature=0))
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    m = engine.metrics()
    return {"block_size": block_size, "blocks": engine.config.num_blocks,
            "output_tokens": m["output_tokens"], "wall_s": round(wall, 2),
            "output_tokens_per_s": round(m["output_tokens"] / wall, 1),
            "fragmentation_mean": round(m["fragmentation_mean"], 4),
            "prefix_cache_hit_rate": round(m["prefix_cache_hit_rate"], 4),
            "preemptions": m["preemptions"], "peak_running": m["peak_running"],
            "steps": m["steps"], "ttft_mean_s": round(m["ttft_mean_s"], 3)}


# ---- report -----------------------------------------------------------------------------------


def markdown(meta: dict, cap: list[dict], mixed: list[dict], sweep: list[dict]) -> str:
    c = meta["config"]
    def f(x, spec):
        return "" if x is None else format(x, spec)

    lines = [
        "# Serving capacity at a fixed KV budget, CPU",
        "",
        (f"{meta['time_utc']}; {meta['cpu']}, {meta['torch_threads']} threads; torch "
         f"{meta['torch']}; git {meta['git_sha']}{' (dirty tree)' if meta['git']['dirty'] else ''}."
         f" small-* presets (4 layers, d=256, 8 heads), random init, float32; KV budget "
         f"{c['kv_mib']} MiB; single runs."),
        "",
        f"## (a) Capacity and decode throughput, block size {c['block_size']}",
        "",
        (f"Sequences of {c['seq_len']} tokens ({c['seq_len'] - c['decode_tokens']} prompt + "
         f"{c['decode_tokens']} generated). Decode tok/s over the first {c['measure_steps']} steps "
         f"where all N sequences decode; N = min(fit, {c['max_seqs']}), and the smallest fit of "
         "all models."),
        "",
        ("| model | KV bytes/token | blocks | sequences fit | N | decode tok/s | ms/step | "
         "N common | decode tok/s | ms/step |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cap:
        a, b = r["at_fit"], r["at_common"]
        lines.append(
            f"| {r['model']} | {r['kv_bytes_per_token']:,} | {r['blocks']:,} | "
            f"{r['fit_sequences']:,} | {a['concurrency']} | {f(a['decode_tokens_per_s'], ',.0f')} |"
            f" {f(a['decode_step_ms'], '.1f')} | {b['concurrency']} | "
            f"{f(b['decode_tokens_per_s'], ',.0f')} | {f(b['decode_step_ms'], '.1f')} |")
    lo, hi = c["mixed_prompt_lens"]
    olo, ohi = c["mixed_output_lens"]
    head = ("| {} | output tok/s | fragmentation mean | prefix-cache hit rate | preemptions | "
            "peak seqs | TTFT mean s | steps |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"

    def row(key, r):
        return (f"| {key} | {r['output_tokens_per_s']:,.0f} | {r['fragmentation_mean']:.3f} | "
                f"{r['prefix_cache_hit_rate']:.3f} | {r['preemptions']} | {r['peak_running']} | "
                f"{r['ttft_mean_s']:.2f} | {r['steps']} |")

    lines += ["", f"## (b) Mixed workload, block size {c['block_size']}", "",
              (f"{c['mixed_requests']} requests at t=0: prompts {lo}..{hi} tokens, every other one "
               f"after a shared {c['shared_prefix']}-token system prompt; outputs {olo}..{ohi}; "
               f"at most {c['max_seqs']} sequences and {c['max_batched_tokens']} tokens a step."),
              "", head.format("model"), rule]
    lines += [row(r["model"], r) for r in mixed]
    lines += ["", f"## (c) Block-size sweep, {c['sweep_model']}, same mixed workload", "",
              head.format("block size").replace("| output", "| blocks | output"),
              rule.replace("|---|", "|---|---:|", 1)]
    lines += [row(str(r["block_size"]), r).replace(" | ", f" | {r['blocks']:,} | ", 1)
              for r in sweep]
    return "\n".join(lines) + "\n"


# --quick changes these defaults; an option given explicitly still wins
QUICK = {"kv_mib": 4, "seq_len": 128, "decode_tokens": 32, "max_seqs": 16, "measure_steps": 8,
         "mixed_requests": 16, "mixed_prompt_lens": (16, 64), "mixed_output_lens": (8, 32),
         "shared_prefix": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-mib", type=positive_int, default=64, help="KV memory budget per model")
    parser.add_argument("--seq-len", type=positive_int, default=512,
                        help="tokens per sequence in (a), at most the presets' context")
    parser.add_argument("--decode-tokens", type=positive_int, default=128,
                        help="generated per sequence, (a)")
    parser.add_argument("--measure-steps", type=positive_int, default=16,
                        help="decode steps timed in (a); the sequences are then aborted")
    parser.add_argument("--max-seqs", type=positive_int, default=64, help="cap on concurrent sequences")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--block-sizes", type=positive_int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--max-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--mixed-requests", type=positive_int, default=48)
    parser.add_argument("--mixed-prompt-lens", type=positive_int, nargs=2, default=(16, 256),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--mixed-output-lens", type=positive_int, nargs=2, default=(16, 64),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--shared-prefix", type=int, default=64, help="tokens, >= 0 (64)")
    parser.add_argument("--sweep-model", default="small-mha", choices=MODELS)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=thread_count, default=os.cpu_count() or 1)
    parser.add_argument("--output-dir", type=output_directory, default=RESULTS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: by default 4 MiB, 128-token sequences, 16 mixed requests "
                             "(options given explicitly still apply)")
    args = parser.parse_args(argv)
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.decode_tokens >= args.seq_len:
        parser.error(f"--decode-tokens {args.decode_tokens} must be < --seq-len {args.seq_len}")
    if args.shared_prefix < 0:
        parser.error(f"--shared-prefix {args.shared_prefix}: must be >= 0")
    for name in ("mixed_prompt_lens", "mixed_output_lens"):
        lo, hi = getattr(args, name)
        if lo > hi:
            parser.error(f"--{name.replace('_', '-')} {lo} {hi}: MIN must be <= MAX")
    from egmla.presets import preset
    from egmla.provenance import machine_memory_bytes

    context = min(preset(name).max_seq_len for name in {*args.models, args.sweep_model})
    if args.seq_len > context:
        parser.error(f"--seq-len {args.seq_len} exceeds the presets' context {context}")
    longest = args.shared_prefix + args.mixed_prompt_lens[1] + args.mixed_output_lens[1]
    if longest > context:
        parser.error(f"--shared-prefix {args.shared_prefix} + --mixed-prompt-lens MAX "
                     f"{args.mixed_prompt_lens[1]} + --mixed-output-lens MAX "
                     f"{args.mixed_output_lens[1]} = {longest} exceeds the presets' context {context}")
    memory = machine_memory_bytes()
    if memory is not None and args.kv_mib * 2**20 > memory:
        parser.error(f"--kv-mib {args.kv_mib}: more than this machine's memory "
                     f"({memory // 2**20:,} MiB)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    models = {name: build(name) for name in dict.fromkeys([*args.models, args.sweep_model])}
    warm_up(next(iter(models.values())))

    cap = [capacity(name, models[name], args) for name in args.models]
    common = min(min(r["fit_sequences"], args.max_seqs) for r in cap)
    if common < 1:
        raise SystemExit(f"a {args.seq_len}-token sequence does not fit in {args.kv_mib} MiB "
                         "for every model: raise --kv-mib")
    for r in cap:
        model = models[r["model"]]
        r["at_fit"] = decode_throughput(model, args, min(r["fit_sequences"], args.max_seqs))
        r["at_common"] = (r["at_fit"] if r["at_fit"]["concurrency"] == common
                          else decode_throughput(model, args, common))
        print(f"(a) {r['model']:<20} fit {r['fit_sequences']:4}  N={r['at_fit']['concurrency']:3} "
              f"{r['at_fit']['decode_tokens_per_s']} tok/s  N={common} "
              f"{r['at_common']['decode_tokens_per_s']} tok/s", flush=True)

    vocab = next(iter(models.values())).config.vocab_size
    workload = mixed_workload(args, vocab)
    mixed = []
    for name in args.models:
        mixed.append({"model": name, **run_mixed(models[name], args, args.block_size, workload)})
        print(f"(b) {name:<20} {mixed[-1]['output_tokens_per_s']} tok/s, fragmentation "
              f"{mixed[-1]['fragmentation_mean']}", flush=True)
    sweep = []
    for bs in args.block_sizes:
        sweep.append(run_mixed(models[args.sweep_model], args, bs, workload))
        print(f"(c) block {bs:3} {sweep[-1]['output_tokens_per_s']} tok/s, fragmentation "
              f"{sweep[-1]['fragmentation_mean']}, prefix hits {sweep[-1]['prefix_cache_hit_rate']}",
              flush=True)

    from egmla.presets import PRESETS
    from egmla.provenance import provenance

    p = provenance()
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k != "output_dir"}
    meta = {**p, "git_sha": p["git"]["sha"], "cpu": p["hardware"]["cpu"],
            "torch": p["versions"]["torch"], "torch_threads": torch.get_num_threads(),
            "config": config, "presets": {n: PRESETS[n] for n in models}}
    name = "serve_capacity_quick" if args.quick else "serve_capacity"
    write_json(args.output_dir / f"{name}.json",
               {"meta": meta, "capacity": cap, "mixed": mixed, "block_size_sweep": sweep},
               indent=2, parents=True)
    md = markdown(meta, cap, mixed, sweep)
    write_text(args.output_dir / f"{name}.md", md)
    print("\n" + md)


if __name__ == "__main__":
    main()
