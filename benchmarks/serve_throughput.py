"""Serving throughput on SmolLM2-135M-Instruct (float32, CPU): our engine against transformers.

One workload, three systems, the same weights:

- `ours`: `serve.LLM(...).engine` (paged KV, continuous batching, chunked prefill), greedy;
- `generate`: transformers `model.generate` over static batches in arrival order, left padded,
  greedy; a batch runs until its longest request is done, and each row is cut to its own length;
  run at each of `--batch-sizes` (8, 16, 32), and the fastest is the baseline of the ratios;
- `generate_batch`: transformers continuous batching (the manager behind `model.generate_batch`,
  driven directly because `generate_batch` takes one `max_new_tokens` for every request), with
  the same KV capacity, page size and token budget as ours.

The workload: `--requests` prompts of random token ids (special tokens excluded), prompt lengths
uniform in 16..512 and output lengths uniform in 16..128, from `--seed`. EOS never stops a request,
so every request produces exactly its output length (checked). Throughput counts those requested
tokens over the wall time of the whole workload, all requests submitted at t=0. Before timing, each
system runs a short warm-up, and our KV pool is touched (`PagedKVCache.populate`, as `python -m
serve` does at start; `--cold-pool` leaves it untouched, so the timed run pays its page faults).
Correctness is checked lightly: the number of requests whose greedy
token ids equal ours exactly (float32 ties may flip a token; that is reported, not failed).

    python benchmarks/serve_throughput.py                       # 64 requests, all systems
    python benchmarks/serve_throughput.py --quick               # 8 short requests, smoke test
    python benchmarks/serve_throughput.py --systems ours generate --batch-sizes 16

Writes benchmarks/results/serve_throughput.{json,md} (serve_throughput_quick.* with --quick) with
the configuration, git SHA, versions and hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))  # measure the checkout this script is in
from egmla.devices import thread_count  # noqa: E402
from egmla.files import output_directory, write_json, write_text  # noqa: E402
from egmla.imports import KNOWN_MODELS  # noqa: E402
from egmla.provenance import machine_memory_bytes  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = KNOWN_MODELS[MODEL].context  # prompt + new tokens at most
SYSTEMS = ("ours", "generate", "generate_batch")


# ---- workload and models ----------------------------------------------------------------------


def make_workload(n: int, seed: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  vocab_size: int, special_ids: set[int]) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, in arrival order; lengths inclusive."""
    rng = random.Random(seed)
    allowed = [i for i in range(vocab_size) if i not in special_ids]
    workload = []
    for _ in range(n):
        prompt = rng.choices(allowed, k=rng.randint(*prompt_lens))
        workload.append((prompt, rng.randint(*output_lens)))
    return workload


def load_models(block_size: int, kv_cache_mib: int, max_num_seqs: int, max_batched_tokens: int):
    """Our LLM (from the egmla export of the GGUF) and transformers' Llama from the same GGUF,
    both float32; raises if their weights differ."""
    import transformers

    from egmla.imports import KNOWN_MODELS, state_dict_from_llama
    from serve import LLM

    llm = LLM(model=MODEL, block_size=block_size, kv_cache_memory=kv_cache_mib * 2**20,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens,
              dtype=torch.float32)
    path = KNOWN_MODELS[MODEL].path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    mapped = state_dict_from_llama(hf.state_dict(), llm.model.config)
    ours = llm.model.state_dict()
    differ = [k for k in ours if not torch.equal(ours[k], mapped[k])]
    if differ:
        raise SystemExit(f"our weights differ from transformers' for {differ[:5]}")
    return llm, hf


# ---- the three systems ------------------------------------------------------------------------


def run_ours(llm, workload: list[tuple[list[int], int]], progress: bool, populate: bool = True) -> dict:
    from serve import LLMEngine, SamplingParams

    # Warm-up on a small engine of its own, so the measured engine's metrics cover the workload only.
    warm = LLMEngine(llm.model, dataclasses.replace(llm.engine.config, num_blocks=64))
    warm.generate([workload[0][0][:32], workload[-1][0][:16]], SamplingParams(max_tokens=4, temperature=0))

    engine = llm.engine
    t0 = time.perf_counter()
    if populate:  # the pool's page faults before the clock, as `python -m serve` takes them at start
        engine.cache.populate()
    populate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=k, temperature=0.0))
           for p, k in workload]
    finished: dict[int, list[int]] = {}  # seq id -> output, from what step() returns
    with tqdm(total=sum(k for _, k in workload), desc="ours", unit="tok",
              disable=not progress) as bar:
        while engine.has_unfinished():
            for seq in engine.step():
                finished[seq.seq_id] = list(seq.output)
            if progress:
                live = sum(len(s.output) for s in (*engine.running, *engine.waiting))
                bar.update(sum(map(len, finished.values())) + live - bar.n)
    wall = time.perf_counter() - t0
    outputs = [finished[i] for i in ids]
    m = engine.metrics()
    return {
        "outputs": outputs, "wall_s": wall, "pool_populated": populate, "populate_s": populate_s,
        "engine": {**{k: m[k] for k in ("ttft_mean_s", "tpot_mean_s", "peak_running",
                                        "preemptions", "fragmentation_mean",
                                        "prefix_cache_hit_rate", "steps", "kv_blocks_total",
                                        "output_tokens_per_s")},
                   # tokens that went through the model (recomputation after preemption included)
                   "prefill_tokens_computed": engine.stats.prefill_tokens,
                   "decode_tokens_computed": engine.stats.decode_tokens},
        "engine_config": {k: (str(v) if isinstance(v, torch.dtype) else v)
                          for k, v in vars(engine.config).items()},
    }


def run_generate(hf, workload: list[tuple[list[int], int]], batch_size: int, pad_id: int,
                 progress: bool) -> dict:
    from transformers import GenerationConfig

    def batch_generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, (p, _) in enumerate(batch):  # left padding
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        longest = max(k for _, k in batch)
        # eos_token_id=None: nothing stops a row and nothing suppresses EOS (min_new_tokens would
        # mask EOS out of the logits and change greedy outputs).
        cfg = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=None,
                               pad_token_id=pad_id)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        new = out[:, width:]  # (B, longest)
        if new.shape[1] != longest:
            raise RuntimeError(f"generate returned {new.shape[1]} new tokens, {longest} asked")
        return [new[b, :k].tolist() for b, (_, k) in enumerate(batch)], len(batch) * longest, ids.numel()

    batch_generate([(workload[0][0][:32], 4), (workload[-1][0][:16], 4)])  # warm-up
    outputs, generated, prompt_tokens = [], 0, 0
    t0 = time.perf_counter()
    with tqdm(total=len(workload), desc="generate", unit="req", disable=not progress) as bar:
        for i in range(0, len(workload), batch_size):
            batch = workload[i : i + batch_size]
            outs, n, padded = batch_generate(batch)
            outputs += outs
            generated, prompt_tokens = generated + n, prompt_tokens + padded
            bar.update(len(batch))
    return {"outputs": outputs, "wall_s": time.perf_counter() - t0, "generated_tokens": generated,
            "prefill_tokens_computed": prompt_tokens}


def cb_config(block_size: int, num_blocks: int, max_batched_tokens: int, max_num_seqs: int):
    """Same capacity as our engine: num_blocks whole-model blocks of page_size tokens each."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                    max_batch_tokens=max_batched_tokens,
                                    max_requests_per_batch=max_num_seqs)


def run_generate_batch(hf, workload: list[tuple[list[int], int]], cb_kwargs: dict,
                       progress: bool) -> dict:
    from transformers import GenerationConfig

    def generation_config():  # the manager writes into it (eos -> -1), so one per run
        return GenerationConfig(do_sample=False, max_new_tokens=max(k for _, k in workload),
                                eos_token_id=None, pad_token_id=0)

    def run(requests, bar=None):
        results = {}
        with hf.continuous_batching_context_manager(
                generation_config=generation_config(),
                continuous_batching_config=cb_config(**cb_kwargs)) as manager:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=k, eos_token_id=-1,
                                       record_timestamps=True) for p, k in requests]
            while len(results) < len(ids):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError(f"the generation thread stopped after {len(results)}"
                                           f" of {len(ids)} requests")
                    continue
                if r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                    results[r.request_id] = r
                    if bar is not None:
                        bar.update(1)
            wall = time.perf_counter() - t0
        return [results[i] for i in ids], wall

    run([(workload[0][0][:32], 4), (workload[-1][0][:16], 4)])  # warm-up
    with tqdm(total=len(workload), desc="generate_batch", unit="req", disable=not progress) as bar:
        results, wall = run(workload, bar)
    ttft = [r.timestamps[0] - r.created_time for r in results if r.timestamps]
    return {"outputs": [list(r.generated_tokens) for r in results], "wall_s": wall,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "attn_implementation": hf.config._attn_implementation}


# ---- report -----------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests with identical token ids, and the mean fraction of tokens before the first
    difference (1.0 when identical)."""
    def prefix(x, y):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        return n / max(len(x), len(y), 1)

    return {"exact": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "mean_prefix_fraction": round(statistics.fmean(prefix(x, y) for x, y in zip(a, b)), 4)}


def markdown(meta: dict, rows: list[dict], ours: dict | None, checks: dict, errors: dict) -> str:
    c = meta["config"]
    lines = [
        f"# Serving throughput, {MODEL} float32, CPU",
        "",
        (f"{meta['time_utc']}; {meta['cpu']}, {c['threads']} threads; torch {meta['torch']}, "
         f"transformers {meta['transformers']}; git {meta['git_sha']}"
         f"{' (dirty tree)' if meta['git']['dirty'] else ''}; load average "
         f"{meta['load_average_1m_before_after'][0]} before, "
         f"{meta['load_average_1m_before_after'][1]} after; one run per system."),
        (f"{c['requests']} requests, seed {c['seed']}, prompt lengths {c['prompt_lens']}, output "
         f"lengths {c['output_lens']} (uniform), EOS ignored; greedy; all requests submitted at t=0."),
        (f"generate: static batches of {', '.join(map(str, c['batch_sizes']))} (left padded; the "
         f"fastest is the 'vs generate' baseline). ours and generate_batch: "
         f"block/page size {c['block_size']}, {c['num_blocks']} blocks ({c['kv_cache_mib']} MiB KV),"
         f" token budget {c['max_batched_tokens']}, at most {c['max_num_seqs']} sequences per step."),
        "",
        ("| system | output tokens | generated tokens | prefill tokens computed | wall s | "
         "output tok/s | vs best generate | TTFT mean s |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        vs = "" if r["vs_generate"] is None else f"{r['vs_generate']:.2f}"
        ttft = "" if r.get("ttft_mean_s") is None else f"{r['ttft_mean_s']:.2f}"
        pre = "" if r["prefill_tokens_computed"] is None else f"{r['prefill_tokens_computed']:,}"
        lines.append(f"| {r['system']} | {r['output_tokens']:,} | {r['generated_tokens']:,} | "
                     f"{pre} | {r['wall_s']:.1f} | {r['output_tokens_per_s']:.1f} | {vs} | {ttft} |")
    lines.append("")
    lines.append("Generated tokens include those a static batch computes past a row's own length "
                 "and then discards; prefill tokens computed include left padding (generate) and "
                 "prompts recomputed after a preemption (ours); not reported by generate_batch.")
    if ours:
        e = ours["engine"]
        lines += ["", "Our engine, `engine.metrics()`:", "",
                  ("| TTFT mean s | TPOT mean ms | peak concurrent seqs | preemptions | "
                   "fragmentation mean | prefix-cache hit rate | steps |"),
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  (f"| {e['ttft_mean_s']:.2f} | {1000 * e['tpot_mean_s']:.1f} | {e['peak_running']} | "
                   f"{e['preemptions']} | {e['fragmentation_mean']:.3f} | "
                   f"{e['prefix_cache_hit_rate']:.3f} | {e['steps']} |")]
    if checks:
        lines += ["", ("Greedy outputs, requests with identical token ids (mean fraction of tokens "
                   "before the first difference):"), ""]
        for pair, a in checks.items():
            lines.append(f"- {pair}: {a['exact']}/{a['of']} ({a['mean_prefix_fraction']:.3f})")
    for system, err in errors.items():
        lines += ["", f"**{system} failed**:", "", "```", err.strip(), "```"]
    return "\n".join(lines) + "\n"


def profile(llm, workload: list[tuple[list[int], int]], path: Path, top: int = 30) -> None:
    """Our engine on the workload under cProfile; the `top` functions by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    r = run_ours(llm, workload, progress=False)
    profiler.disable()
    out = io.StringIO()
    out.write(f"{len(workload)} requests, {sum(map(len, r['outputs']))} output tokens, "
              f"{r['wall_s']:.1f} s under cProfile\n")
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    write_text(path, out.getvalue(), parents=True)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-lens", type=positive_int, nargs=2, default=(16, 512),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-lens", type=positive_int, nargs=2, default=(16, 128),
                        metavar=("MIN", "MAX"), help=f"MAX + --prompt-lens MAX at most {CONTEXT}")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[8, 16, 32],
                        help="static batch sizes of `generate`, each run in turn")
    parser.add_argument("--block-size", type=positive_int, default=16, help="KV block (page) size")
    parser.add_argument("--kv-cache-mib", type=positive_int, default=1024,
                        help="KV pool of ours and CB (generate's cache is unbounded)")
    parser.add_argument("--max-batched-tokens", type=positive_int, default=512,
                        help="token budget of one step, ours and CB")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64,
                        help="rows of one step, ours and CB")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--threads", type=thread_count, default=os.cpu_count() or 1)
    parser.add_argument("--output-dir", type=output_directory, default=RESULTS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: by default 8 requests, prompts 16..64, outputs 8..16 "
                             "(options given explicitly still apply)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--cold-pool", action="store_true",
                        help="do not touch our KV pool before timing: each page's first write "
                             "pays its fault (and any huge-page compaction) in the timed run")
    parser.add_argument("--profile", action="store_true",
                        help="run only our engine under cProfile; write the top functions by "
                             "tottime to serve_throughput_profile.txt instead of the tables")
    args = parser.parse_args()
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        parser.set_defaults(requests=8, prompt_lens=(16, 64), output_lens=(8, 16))
        args = parser.parse_args()
    for name in ("prompt_lens", "output_lens"):
        lo, hi = getattr(args, name)
        if lo > hi:
            parser.error(f"--{name.replace('_', '-')} {lo} {hi}: MIN must be <= MAX")
    if args.prompt_lens[1] + args.output_lens[1] > CONTEXT:
        parser.error(f"--prompt-lens MAX {args.prompt_lens[1]} + --output-lens MAX "
                     f"{args.output_lens[1]}: at most {CONTEXT} ({MODEL}'s context)")
    memory = machine_memory_bytes()
    if memory is not None and args.kv_cache_mib * 2**20 > memory:
        parser.error(f"--kv-cache-mib {args.kv_cache_mib}: more than this machine's memory "
                     f"({memory // 2**20:,} MiB)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    progress = not args.no_progress

    llm, hf = load_models(args.block_size, args.kv_cache_mib, args.max_num_seqs,
                          args.max_batched_tokens)
    tok = llm.tokenizer
    workload = make_workload(args.requests, args.seed, tuple(args.prompt_lens),
                             tuple(args.output_lens), llm.model.config.vocab_size,
                             set(tok.all_special_ids))
    num_blocks = llm.engine.config.num_blocks
    cb_kwargs = {"block_size": args.block_size, "num_blocks": num_blocks,
                 "max_batched_tokens": args.max_batched_tokens, "max_num_seqs": args.max_num_seqs}

    name = "serve_throughput_quick" if args.quick else "serve_throughput"
    if args.profile:
        profile(llm, workload, args.output_dir / f"{name}_profile.txt")
        return

    results, errors = {}, {}
    load_before = os.getloadavg()  # a shared machine: say how busy it was
    for system in SYSTEMS:  # fixed order: generate_batch switches the attention implementation
        if system not in args.systems:
            continue
        print(f"running {system} ...", flush=True)
        try:
            if system == "ours":
                results[system] = run_ours(llm, workload, progress, populate=not args.cold_pool)
            elif system == "generate":
                pad = tok.pad_token_id if tok.pad_token_id is not None else 0
                for size in args.batch_sizes:
                    print(f"  batch size {size}", flush=True)
                    results[f"generate b{size}"] = run_generate(hf, workload, size, pad, progress)
            else:
                results[system] = run_generate_batch(hf, workload, cb_kwargs, progress)
        except Exception:  # noqa: BLE001  record the error and carry on with the other systems
            errors[system] = traceback.format_exc(limit=4)
            print(f"{system} failed:\n{errors[system]}", flush=True)

    wanted = [k for _, k in workload]
    rows = []
    for system, r in results.items():
        got = [len(o) for o in r["outputs"]]
        if got != wanted:
            bad = sum(g != w for g, w in zip(got, wanted))
            raise SystemExit(f"{system}: {bad} requests did not produce their output length")
        tokens = sum(got)
        rows.append({"system": system, "output_tokens": tokens,
                     "generated_tokens": r.get("generated_tokens", tokens),
                     "prefill_tokens_computed": (r["engine"]["prefill_tokens_computed"]
                                                 if system == "ours"
                                                 else r.get("prefill_tokens_computed")),
                     "wall_s": round(r["wall_s"], 3),
                     "output_tokens_per_s": round(tokens / r["wall_s"], 2),
                     "ttft_mean_s": (r["engine"]["ttft_mean_s"] if system == "ours"
                                     else r.get("ttft_mean_s"))})
    static = [r for r in rows if r["system"].startswith("generate b")]
    best = max(static, key=lambda r: r["output_tokens_per_s"])["system"] if static else None
    base = next((r["output_tokens_per_s"] for r in rows if r["system"] == best), None)
    for r in rows:
        r["vs_generate"] = None if base is None else round(r["output_tokens_per_s"] / base, 3)
    checks = {f"{a} vs {b}": agreement(results[a]["outputs"], results[b]["outputs"])
              for a, b in (("ours", best), ("ours", "generate_batch"), (best, "generate_batch"))
              if a in results and b in results}

    from egmla.provenance import provenance

    p = provenance()
    config = {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                 if k not in ("output_dir", "no_progress")},
              "model": MODEL, "dtype": "float32", "num_blocks": num_blocks,
              "generate_batch_config": {k: v for k, v in vars(cb_config(**cb_kwargs)).items()
                                        if not k.startswith("_") and isinstance(
                                            v, (int, float, bool, str, type(None)))}}
    meta = {**p, "git_sha": p["git"]["sha"], "cpu": p["hardware"]["cpu"],
            "torch": p["versions"]["torch"], "transformers": p["versions"]["transformers"],
            "torch_threads": torch.get_num_threads(), "config": config,
            "load_average_1m_before_after": [round(load_before[0], 2),
                                             round(os.getloadavg()[0], 2)]}
    ours = results.get("ours")
    report = {
        "meta": meta, "summary": rows,
        "ours_engine": ours and {**ours["engine"], "engine_config": ours["engine_config"],
                                 "pool_populated": ours["pool_populated"], "populate_s": ours["populate_s"]},
        "generate_batch_attn_implementation": results.get("generate_batch", {}).get(
            "attn_implementation"),
        "correctness": checks, "errors": errors,
        "requests": [{"prompt_len": len(p_), "output_len": k} for p_, k in workload],
    }
    write_json(args.output_dir / f"{name}.json", report, indent=2, parents=True)
    md = markdown(meta, rows, ours, checks, errors)
    write_text(args.output_dir / f"{name}.md", md)
    print("\n" + md)


if __name__ == "__main__":
    main()
