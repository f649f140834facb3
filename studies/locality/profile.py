"""`profile`: the firing report over the sources (JSON, markdown, the plot), and the per-layer
thresholds a target sparsity calibrates."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from egmla.files import write_bytes
from egmla.models.sparse_ffn import Threshold, calibrate_thresholds
from studies.locality.firing import (COVERAGE, CURVE_POINTS, UNION_BATCHES, pooled, profile_model,
                                     top_overlap)
from studies.locality.sources import BATCH, source_texts, token_stream, windows


CALIBRATION_TOKENS = 4096  # of corpus-a, for --sparsity's per-layer thresholds


def build_report(model, tokenizer, sources: list[str], tokens: int, seq_len: int,
                 threshold: Threshold) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from tqdm import tqdm

    per_source, counts = {}, {}
    for name in sources:
        ids = token_stream(tokenizer, source_texts(name), max(tokens, BATCH * seq_len))
        data = windows(ids, seq_len, tokens)
        with tqdm(total=data.numel(), desc=f"profile {name}", unit="tok", file=sys.stderr) as bar:
            layers = profile_model(model, iter(data.split(BATCH)), threshold, bar.update)
        per_source[name] = {"layers": [s.summary() for s in layers], "model": pooled(layers)}
        for i, s in enumerate(layers):
            counts[f"{name}.layer{i}"] = s.counts
    overlaps = {}
    for a_i, a in enumerate(sources):
        for b in sources[a_i + 1:]:
            overlaps[f"{a} vs {b}"] = [top_overlap(counts[f"{a}.layer{i}"], counts[f"{b}.layer{i}"])
                                       for i in range(len(model.layers))]
    return {"sources": per_source, "top20_overlap": overlaps}, counts


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# Activation locality: {meta['model']}", "",
             (f"ffn {meta['ffn']}, {describe_threshold(meta['threshold'], meta.get('sparsity'))}, "
              f"{meta['seq_len']}-token "
              f"windows; git {str(meta['git'].get('sha'))[:10]}."), "",
             ("| source | layer | tokens | sparsity | active p10/p50/p90 | neurons for 80% | "
              "never fired | union sparsity B=1/4/16 |"), "|---|---|---:|---:|---|---:|---:|---|"]
    for name, src in report["sources"].items():
        for layer, s in enumerate(src["layers"]):
            a, u = s["active_fraction"], s["union_sparsity"]
            lines.append(
                f"| {name} | {layer} | {s['tokens']} | {s['sparsity']:.1%} | {a['p10']:.1%} / "
                f"{a['p50']:.1%} / {a['p90']:.1%} | {_pct(s['neurons_for_80pct'])} | "
                f"{s['never_fired']:.1%} | {' / '.join(f'{u[k]:.1%}' for k in sorted(u, key=int))} |")
        m = src["model"]
        lines.append(f"| {name} | all | | {m['sparsity']:.1%} | | {_pct(m['neurons_for_80pct'])} "
                     "| | |")
    if report["top20_overlap"]:
        lines += ["", "Overlap of the top 20% most frequent neurons, per layer:", "",
                  "| sources | per layer |", "|---|---|"]
        for pair, v in report["top20_overlap"].items():
            lines.append(f"| {pair} | {', '.join(f'{x:.0%}' for x in v)} |")
    return "\n".join(lines) + "\n"


def describe_threshold(threshold: Threshold, sparsity: float | None = None) -> str:
    """'threshold 0.05', or 'per-layer thresholds 0.112..0.205 for 50% sparsity'."""
    if not isinstance(threshold, (list, tuple)):
        return f"threshold {threshold}"
    target = "" if sparsity is None else f" for {sparsity:.0%} sparsity"
    return f"per-layer thresholds {min(threshold):.3g}..{max(threshold):.3g}{target}"


def sparsity_thresholds(model, tokenizer, sparsity: float, seq_len: int = 256) -> list[float]:
    """Each layer's threshold for a target `sparsity`, calibrated on the first
    CALIBRATION_TOKENS tokens of corpus-a (egmla.models.sparse_ffn.calibrate_thresholds)."""
    ids = token_stream(tokenizer, source_texts("corpus-a"), CALIBRATION_TOKENS)
    data = windows(ids, min(seq_len, max(1, len(ids) // BATCH)), CALIBRATION_TOKENS)
    thresholds = calibrate_thresholds(model, data.split(BATCH), sparsity)
    print(f"per-layer thresholds for sparsity {sparsity} ({data.numel()} tokens of corpus-a): "
          f"{', '.join(f'{t:.4g}' for t in thresholds)}", file=sys.stderr, flush=True)
    return thresholds


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [i / (CURVE_POINTS - 1) for i in range(CURVE_POINTS)]
    first = next(iter(report["sources"]))
    for i, s in enumerate(report["sources"][first]["layers"]):
        left.plot(x, s["curve"], label=f"layer {i}", lw=1)
    left.plot(x, report["sources"][first]["model"]["curve"], "k--", label="whole model", lw=1.5)
    left.axhline(COVERAGE, color="grey", lw=0.5)
    left.set(xlabel="share of neurons (most frequent first)", ylabel="share of all firings",
             title=f"concentration ({first})")
    left.legend(fontsize=7)
    for name, src in report["sources"].items():
        sizes = sorted({int(b) for s in src["layers"] for b in s["union_sparsity"]})
        mean = [sum(s["union_sparsity"][str(b)] for s in src["layers"]) / len(src["layers"])
                for b in sizes]
        right.plot(sizes, [100 * m for m in mean], marker="o", label=name)
    right.set(xscale="log", xlabel="decode batch (sequences)", ylabel="union sparsity (%)",
              title="neurons no row of the batch needs (mean over layers)")
    right.set_xticks(list(UNION_BATCHES), [str(b) for b in UNION_BATCHES])
    right.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


def save_png(fig, path: Path) -> None:
    """Write the figure to `path` whole or not at all, and close it."""
    import matplotlib.pyplot as plt

    from eval.compare import png_bytes

    write_bytes(path, png_bytes(fig), mode=0o644, parents=True)
    plt.close(fig)
