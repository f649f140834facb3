"""What quantized weights cost in quality on SmolLM2-135M-Instruct: held-out perplexity of each
`--quantization` method against the same model in float32, paired window by window, and the
mean per-token KL divergence from float32. Methods: q8_0, q4_0 and q4_1 (made at load from the
float weights) and gguf (the packaged file's own blocks: Q4_1 layers, a Q8_0 head). The float32
model is itself the GGUF's Q4_1 weights decoded, so a method's cost is measured against the
float model we serve, not against SmolLM2's original bf16 release.

The text is the held-out split of two offline sources (studies.upcycling.quality's domains):
`recovery` (Python standard library source and other text on the machine) and `corpus` (the
embedded Shakespeare and King James Bible), 16 windows of 512 scored tokens each by default.
Both models run in float32 activations; the quantized one is `serve.LLM(...,
quantization=METHOD)`'s model (egmla.quant.quantize_model or load_gguf_weights), whose
products quantize the activations per block as llama.cpp does. Per window: the difference of mean token losses
(quantized - float32); its mean over windows with a Student-t interval (eval.stats), and the
perplexity ratio exp(mean difference).

    python benchmarks/quant_quality.py                       # every method, both domains
    python benchmarks/quant_quality.py --quantization q8_0 --windows 4 --out /tmp/q   # smoke

Writes OUT/quant_quality.{json,md} (benchmarks/results by default) with the configuration, git
SHA and versions.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in

from egmla import files  # noqa: E402
from egmla.devices import thread_count  # noqa: E402
from egmla.imports import gguf_source, load_pretrained  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from egmla.quant import QUANTIZATIONS, load_gguf_weights, quantize_model  # noqa: E402
from eval.stats import interval  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402
from studies.upcycling.quality import DOMAINS, eval_windows  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# A sane maximum of --windows: each window's float32 reference log-probabilities (512 x 49,152)
# are held in memory, 100 MB a window and domain (the default 16: 3.2 GB in all).
MAX_WINDOWS = 64


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


def quantized_model(method: str):
    """SmolLM2 in float32 with `method`'s weights, as serve.LLM(quantization=method) makes it."""
    model, _ = load_pretrained(MODEL, dtype=torch.float32)
    if method == "gguf":
        return load_gguf_weights(model.eval(), gguf_source(MODEL))
    return quantize_model(model.eval(), method)


def measure(methods: list[str], n_windows: int, threads: int) -> dict:
    """{method: {domain: figures}} against one float32 reference per domain."""
    torch.set_num_threads(threads)
    exact, tokenizer = load_pretrained(MODEL, dtype=torch.float32)
    exact.eval()
    references = {}
    for domain in DOMAINS:
        try:
            windows = eval_windows(tokenizer, domain, windows=n_windows)
        except ValueError as err:  # fewer held-out tokens than --windows asks for
            print(f"quant_quality.py: error: --windows {n_windows}: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"{domain}: {tuple(windows.shape)} token ids; float32 ...", flush=True)
        with torch.no_grad():
            reference = [exact(windows[s:s + 4, :-1]).float().log_softmax(-1)
                         for s in range(0, len(windows), 4)]
        base = [(-ref.gather(-1, windows[s:s + 4, 1:, None])[..., 0]).mean(-1)
                for s, ref in zip(range(0, len(windows), 4), reference)]
        references[domain] = (windows, reference, torch.cat(base).tolist())
    del exact
    report = {}
    for method in methods:
        quantized = quantized_model(method)
        report[method] = {}
        for domain, (windows, reference, base) in references.items():
            print(f"{domain}: {method} ...", flush=True)
            losses, kls = window_losses(quantized, reference, windows)
            diff = interval([q - f for q, f in zip(losses, base)])
            report[method][domain] = {
                "windows": len(windows), "tokens_scored": windows[:, 1:].numel(),
                "ppl_float32": math.exp(sum(base) / len(base)),
                "ppl_quantized": math.exp(sum(losses) / len(losses)),
                "loss_difference": diff,
                "ppl_ratio": math.exp(diff["mean"]),
                "ppl_ratio_interval": [math.exp(diff["low"]), math.exp(diff["high"])],
                "kl_mean_nats": sum(kls) / len(kls),
                "per_window": {"float32": base, "quantized": losses, "kl": kls},
            }
        del quantized
    return report


def markdown(result: dict) -> str:
    meta, c = result["meta"], result["config"]
    lines = [f"# Quantized weights: quality against float32, {MODEL}", "",
             (f"{meta['time_utc']}; git {meta['git']['sha'][:10]}"
              f"{' (dirty tree)' if meta['git']['dirty'] else ''}; torch "
              f"{meta['versions'].get('torch')}; {c['windows']} windows of 512 scored tokens per "
              f"domain; methods {', '.join(c['quantization'])}."), "",
             ("Loss difference: per window, mean token loss quantized - float32; mean over the "
              "windows with its 95% Student-t interval. Perplexity ratio: exp of it."), "",
             ("| method | domain | ppl float32 | ppl quantized | loss difference [95% CI] "
              "| ppl ratio [95% CI] | KL nats/token |"),
             "|---|---|---:|---:|---|---|---:|"]
    for method, domains in result["methods"].items():
        for domain, r in domains.items():
            d = r["loss_difference"]
            lo, hi = r["ppl_ratio_interval"]
            lines.append(f"| {method} | {domain} | {r['ppl_float32']:.3f} | "
                         f"{r['ppl_quantized']:.3f} | "
                         f"{d['mean']:+.5f} [{d['low']:+.5f}, {d['high']:+.5f}] | "
                         f"{r['ppl_ratio']:.4f} [{lo:.4f}, {hi:.4f}] | {r['kl_mean_nats']:.5f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", choices=QUANTIZATIONS, nargs="+", default=list(QUANTIZATIONS),
                   help="the methods measured (default: all, %(default)s)")
    p.add_argument("--windows", type=positive_int, default=16,
                   help=f"held-out windows of 512 scored tokens per domain, at most {MAX_WINDOWS} "
                        "(default %(default)s)")
    p.add_argument("--threads", type=thread_count, default=2, help="torch threads (2)")
    p.add_argument("--out", type=files.output_directory, default=ROOT / "benchmarks" / "results",
                   help="where quant_quality.{json,md} go (benchmarks/results)")
    args = p.parse_args(argv)
    if args.windows > MAX_WINDOWS:
        p.error(f"--windows {args.windows}: at most {MAX_WINDOWS} (100 MB of reference "
                "log-probabilities a window and domain)")
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[key] = "1"
    domains = measure(args.quantization, args.windows, args.threads)
    result = {"meta": provenance(), "load_average": os.getloadavg(),
              "config": {"quantization": args.quantization, "windows": args.windows,
                         "threads": args.threads, "model": MODEL},
              "methods": domains}
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_json(args.out / "quant_quality.json", result, indent=2)
    md = markdown(result)
    files.write_text(args.out / "quant_quality.md", md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
