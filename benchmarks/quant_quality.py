"""What quantized weights cost in quality on SmolLM2-135M-Instruct: held-out perplexity of each
`--quantization` method against the same model in float32, paired window by window, and the
mean per-token KL divergence from float32.

The text is the held-out split of two offline sources (studies.upcycling.quality's domains):
`recovery` (Python standard library source and other text on the machine) and `corpus` (the
embedded Shakespeare and King James Bible), 16 windows of 512 scored tokens each by default.
Both models run in float32 activations; the quantized one is `serve.LLM(...,
quantization=METHOD)`'s model (egmla.quant.quantize_model), whose products quantize the
activations per block as llama.cpp does. Per window: the difference of mean token losses
(quantized - float32); its mean over windows with a Student-t interval (eval.stats), and the
perplexity ratio exp(mean difference).

    python benchmarks/quant_quality.py                       # q8_0, both domains
    python benchmarks/quant_quality.py --windows 4 --out /tmp/q   # a smoke run

Writes OUT/quant_quality.{json,md} (benchmarks/results by default) with the configuration, git
SHA and versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in

from egmla import files  # noqa: E402
from egmla.imports import load_pretrained  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from egmla.quant import METHODS, quantize_model  # noqa: E402
from eval.stats import interval  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402
from studies.upcycling.quality import DOMAINS, eval_windows  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


@torch.no_grad()
def window_losses(model, reference, windows: torch.Tensor, batch: int = 4) -> tuple[list, list]:
    """Per window: the model's mean token loss, and its mean KL divergence from `reference`
    (whose log-probabilities are given, one tensor per batch)."""
    losses, kls = [], []
    for i, start in enumerate(range(0, len(windows), batch)):
        rows = windows[start:start + batch]
        log_q = model(rows[:, :-1]).float().log_softmax(-1)
        losses += (-log_q.gather(-1, rows[:, 1:, None])[..., 0]).mean(-1).tolist()
        if reference is not None:
            log_p = reference[i]
            kls += (log_p.exp() * (log_p - log_q)).sum(-1).mean(-1).tolist()
    return losses, kls


def measure(method: str, n_windows: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    exact, tokenizer = load_pretrained(MODEL, dtype=torch.float32)
    quantized, _ = load_pretrained(MODEL, dtype=torch.float32)
    quantize_model(quantized.eval(), method)
    exact.eval()
    report = {}
    for domain in DOMAINS:
        windows = eval_windows(tokenizer, domain, windows=n_windows)
        print(f"{domain}: {tuple(windows.shape)} token ids; float32 ...", flush=True)
        with torch.no_grad():
            reference = [exact(windows[s:s + 4, :-1]).float().log_softmax(-1)
                         for s in range(0, len(windows), 4)]
        base = [(-ref.gather(-1, windows[s:s + 4, 1:, None])[..., 0]).mean(-1)
                for s, ref in zip(range(0, len(windows), 4), reference)]
        base = torch.cat(base).tolist()
        print(f"{domain}: {method} ...", flush=True)
        losses, kls = window_losses(quantized, reference, windows)
        diff = interval([q - f for q, f in zip(losses, base)])
        report[domain] = {
            "windows": len(windows), "tokens_scored": windows[:, 1:].numel(),
            "ppl_float32": math.exp(sum(base) / len(base)),
            "ppl_quantized": math.exp(sum(losses) / len(losses)),
            "loss_difference": diff,
            "ppl_ratio": math.exp(diff["mean"]),
            "ppl_ratio_interval": [math.exp(diff["low"]), math.exp(diff["high"])],
            "kl_mean_nats": sum(kls) / len(kls),
            "per_window": {"float32": base, "quantized": losses, "kl": kls},
        }
    return report


def markdown(result: dict) -> str:
    meta, c = result["meta"], result["config"]
    lines = [f"# Quantized weights: quality against float32, {MODEL}", "",
             (f"{meta['time_utc']}; git {meta['git']['sha'][:10]}"
              f"{' (dirty tree)' if meta['git']['dirty'] else ''}; torch "
              f"{meta['versions'].get('torch')}; {c['windows']} windows of 512 scored tokens per "
              f"domain; method `{c['quantization']}`."), "",
             ("Loss difference: per window, mean token loss quantized - float32; mean over the "
              "windows with its 95% Student-t interval. Perplexity ratio: exp of it."), "",
             "| domain | ppl float32 | ppl quantized | loss difference [95% CI] | ppl ratio [95% CI] | KL nats/token |",
             "|---|---:|---:|---|---|---:|"]
    for domain, r in result["domains"].items():
        d = r["loss_difference"]
        lo, hi = r["ppl_ratio_interval"]
        lines.append(f"| {domain} | {r['ppl_float32']:.3f} | {r['ppl_quantized']:.3f} | "
                     f"{d['mean']:+.5f} [{d['low']:+.5f}, {d['high']:+.5f}] | "
                     f"{r['ppl_ratio']:.4f} [{lo:.4f}, {hi:.4f}] | {r['kl_mean_nats']:.5f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", choices=METHODS, default="q8_0",
                   help="the method measured (default %(default)s)")
    p.add_argument("--windows", type=positive_int, default=16,
                   help="held-out windows of 512 scored tokens per domain (default %(default)s)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (2)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where quant_quality.{json,md} go (benchmarks/results)")
    args = p.parse_args(argv)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[key] = "1"
    domains = measure(args.quantization, args.windows, args.threads)
    result = {"meta": provenance(), "load_average": os.getloadavg(),
              "config": {"quantization": args.quantization, "windows": args.windows,
                         "threads": args.threads, "model": MODEL},
              "domains": domains}
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_json(args.out / "quant_quality.json", result, indent=2)
    md = markdown(result)
    files.write_text(args.out / "quant_quality.md", md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
