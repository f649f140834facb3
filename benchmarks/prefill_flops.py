"""Prefill against the machine's matrix-multiply peak: the fraction of its measured GEMM
throughput that our engine's prefill of SmolLM2-135M-Instruct reaches, float32 and bfloat16.

Per dtype, in one process, interleaved round by round:

- `gemm peak`: the best of 5 square 2048^3 matrix products in that dtype (MACs / s), measured in
  this run (PyTorch's matmul; bf16 natively where the CPU multiplies bf16, AVX512-BF16 here);
- `prefill`: one new prompt of `--tokens` random token ids through `serve.LLM` (one request,
  `max_tokens=1`, prefix caching off, a token budget that takes the prompt in one step), the
  wall time of `generate`, the median over `--repeats` rounds.

Achieved = the prefill's multiply-accumulates over its time: every linear layer of every block
for every token, causal attention's scores and weighted values (H x head_dim x T(T+1) per
layer) and the LM head for the last token only (what the engine computes), with the embedding
lookup, norms, RoPE, activations and cache writes counted as time but not as MACs.

    python benchmarks/prefill_flops.py              # fp32 and bf16, 128 / 512 / 2048 tokens
    python benchmarks/prefill_flops.py --quick      # fp32, 64 tokens, 1 round (a smoke test)

Writes benchmarks/results/prefill_flops.{json,md} (prefill_flops_quick.* with --quick) with the
configuration, git SHA, versions and load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from egmla import files  # noqa: E402
from egmla.devices import thread_count  # noqa: E402
from egmla.imports import KNOWN_MODELS  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = KNOWN_MODELS[MODEL].context  # prompt + new tokens at most
SLACK = 8  # max_model_len is the longest prompt + this
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prefill_macs(model, tokens: int) -> int:
    """Multiply-accumulates of a prefill of `tokens` new tokens (see the module doc)."""
    cfg = model.config
    linear = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    head_dim = cfg.d_model // cfg.n_heads
    attention = cfg.n_layers * cfg.n_heads * head_dim * tokens * (tokens + 1)
    return linear * tokens + attention + model.lm_head.weight.numel()


def gemm_peak(dtype: torch.dtype, rounds: int = 5, n: int = 2048) -> float:
    """The best of `rounds` n^3 matrix products in `dtype`, in MACs per second."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        a @ b
        best = max(best, n**3 / (time.perf_counter() - start))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--tokens", nargs="+", type=positive_int, default=[128, 512, 2048],
                   help=f"prompt lengths, at most {CONTEXT - SLACK} (default 128 512 2048)")
    p.add_argument("--repeats", type=positive_int, default=5, help="interleaved rounds (5)")
    p.add_argument("--threads", type=thread_count, default=2, help="torch threads (2)")
    p.add_argument("--quick", action="store_true",
                   help="by default fp32, 64 tokens, 1 round (options given explicitly still apply)")
    p.add_argument("--out", type=files.output_directory, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        p.set_defaults(dtypes=["float32"], tokens=[64], repeats=1)
        args = p.parse_args(argv)
    longest = max(args.tokens)
    if longest + SLACK > CONTEXT:
        p.error(f"--tokens {longest}: at most {CONTEXT - SLACK} ({MODEL}'s context is {CONTEXT})")
    torch.set_num_threads(args.threads)
    from serve import LLM, SamplingParams

    load_before = os.getloadavg()
    try:
        llms = {name: LLM(model=MODEL, dtype=DTYPES[name], enable_prefix_caching=False,
                          max_num_batched_tokens=max(2048, longest), max_model_len=longest + SLACK,
                          kv_cache_memory=256 * 2**20)
                for name in args.dtypes}
    except ValueError as err:  # a setting the model refuses (CheckpointError included)
        p.error(f"{MODEL}: {err}")
    for name, llm in llms.items():  # the 256 MiB KV pool may hold fewer tokens than the context
        if longest + 1 > (room := llm.engine.max_request_tokens):
            p.error(f"--tokens {longest}: at most {room - 1} in {name} (the model's context or "
                    "its KV pool)")
    vocab = next(iter(llms.values())).model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for llm in llms.values():  # warm-up: first calls allocate and load
        llm.generate([{"prompt_token_ids": list(range(100, 116))}], params, use_tqdm=False)
    times: dict[tuple[str, int], list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for name in args.dtypes:
            peaks.setdefault(name, []).append(gemm_peak(DTYPES[name]))
            for n in args.tokens:
                prompt = torch.randint(100, vocab, (n,), generator=g).tolist()
                start = time.perf_counter()
                llms[name].generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                times.setdefault((name, n), []).append(time.perf_counter() - start)
        print(f"round {rep + 1}/{args.repeats} done", flush=True)
    rows = []
    for name in args.dtypes:
        peak = max(peaks[name])
        for n in args.tokens:
            runs = times[(name, n)]
            median = statistics.median(runs)
            macs = prefill_macs(llms[name].model, n)
            rows.append({"dtype": name, "tokens": n, "median_s": median, "runs_s": runs,
                         "macs": macs, "achieved_gmac_s": macs / median / 1e9,
                         "gemm_peak_gmac_s": peak / 1e9, "fraction_of_peak": macs / median / peak})
    result = {"meta": provenance(), "config": {k: v for k, v in vars(args).items() if k != "out"},
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "gemm_peak_runs_gmac_s": {k: [x / 1e9 for x in v] for k, v in peaks.items()},
              "rows": rows}
    stem = "prefill_flops_quick" if args.quick else "prefill_flops"
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_json(args.out / f"{stem}.json", result, indent=2)
    md = markdown(result)
    files.write_text(args.out / f"{stem}.md", md)
    print("\n" + md)
    return 0


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# Prefill against the GEMM peak: SmolLM2-135M-Instruct through serve.LLM", "",
             (f"{meta['time_utc']}; git {meta['git']['sha'][:10]}"
              f"{' (dirty tree)' if meta['git']['dirty'] else ''}; torch "
              f"{meta['versions'].get('torch')}; {result['config']['threads']} threads; load "
              f"average {result['load_average']['before']} before, "
              f"{result['load_average']['after']} after; {result['config']['repeats']} "
              "interleaved rounds (median)."), "",
             "| dtype | prompt tokens | prefill ms | GMAC | achieved GMAC/s | GEMM peak GMAC/s "
             "| of peak |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['median_s'] * 1e3:.0f} | "
                     f"{r['macs'] / 1e9:.1f} | {r['achieved_gmac_s']:.1f} | "
                     f"{r['gemm_peak_gmac_s']:.1f} | {r['fraction_of_peak']:.2f} |")
    lines += ["", ("MACs: every block's linear layers for every token, causal attention's scores "
                   "and values, the LM head for the last token. GEMM peak: the best square "
                   "2048^3 matmul in the dtype, measured in the same run.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
