"""`sweep`: what a target sparsity costs (TEAL, CATS): for each target, the calibrated
thresholds, the share of neurons they skip on held-out text, and the perplexity there against
dense."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from egmla.models.sparse_ffn import firing
from studies.locality.profile import CALIBRATION_TOKENS, save_png, sparsity_thresholds
from studies.locality.sources import BATCH, source_texts, token_stream, windows


SWEEP_TARGETS = (0.1, 0.2, 0.3, 0.4, 0.5)


def sweep(model, tokenizer, targets: list[float], tokens: int, seq_len: int,
          tolerance: float) -> dict[str, Any]:
    """What a magnitude cut (TEAL, CATS) costs. For each target sparsity: the per-layer
    thresholds calibrated for it on the first 4,096 tokens of corpus-a (as --sparsity does), the
    share of (token, neuron) pairs they skip on held-out text (corpus-b), and the perplexity
    there of the model computing only what fires, against dense. The report names the largest
    target within the tolerance: the sparsity a model gives for free."""
    from studies.locality import predictors as P

    ids = token_stream(tokenizer, source_texts("corpus-b"), max(tokens, BATCH * seq_len))
    held = windows(ids, seq_len, tokens)
    dense = P.perplexity(model, held.split(BATCH))
    print(f"dense perplexity {dense:.3f} on {held.numel()} tokens of corpus-b", file=sys.stderr,
          flush=True)
    points = []
    for target in sorted(set(targets)):
        thresholds = sparsity_thresholds(model, tokenizer, target, seq_len)
        skipped, pairs = [0] * len(model.layers), [0] * len(model.layers)

        def keep(i, mlp, x, thresholds=thresholds, skipped=skipped, pairs=pairs):
            mask = firing(mlp, x, thresholds[i])
            skipped[i] += int((~mask).sum())
            pairs[i] += mask.numel()
            return mask

        ppl = P.perplexity(model, held.split(BATCH), keep)
        point = {"target": target, "thresholds": thresholds,
                 "held_out_sparsity": sum(skipped) / sum(pairs),
                 "layer_sparsity": [k / n for k, n in zip(skipped, pairs)],
                 "perplexity": ppl, "vs_dense": ppl / dense - 1}
        points.append(point)
        print(f"target {target}: {point['held_out_sparsity']:.1%} skipped on corpus-b, "
              f"perplexity {ppl:.3f} ({point['vs_dense']:+.2%})", file=sys.stderr, flush=True)
    within = [p["target"] for p in points if p["vs_dense"] <= tolerance]
    return {"dense_perplexity": dense, "held_out_tokens": held.numel(), "tolerance": tolerance,
            "points": points, "largest_within_tolerance": max(within, default=None)}


def sweep_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    best = report["largest_within_tolerance"]
    lines = [f"# The cost of a target sparsity: {meta['model']}", "",
             (f"ffn {meta['ffn']}; per-layer thresholds calibrated on {CALIBRATION_TOKENS} tokens "
              f"of corpus-a for each target; perplexity on {report['held_out_tokens']} held-out "
              f"tokens of corpus-b ({meta['seq_len']}-token windows), dense "
              f"{report['dense_perplexity']:.3f}; git {str(meta['git'].get('sha'))[:10]}."), "",
             "| target | thresholds | skipped (held out) | perplexity | vs dense |",
             "|---:|---|---:|---:|---:|"]
    for p in report["points"]:
        lines.append(f"| {p['target']:.0%} | {min(p['thresholds']):.3g}..{max(p['thresholds']):.3g} "
                     f"| {p['held_out_sparsity']:.1%} | {p['perplexity']:.3f} | "
                     f"{p['vs_dense']:+.2%} |")
    lines += ["", f"Largest target within {report['tolerance']:.1%} of dense: "
                  + ("none" if best is None else f"{best:.0%}") + "."]
    return "\n".join(lines) + "\n"


def sweep_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    points = report["points"]
    ax.plot([100 * p["held_out_sparsity"] for p in points], [100 * p["vs_dense"] for p in points],
            marker="o", label=f"{report['meta']['ffn']}, per-layer thresholds")
    ax.axhline(100 * report["tolerance"], color="grey", lw=0.8, ls="--",
               label=f"{report['tolerance']:.0%} tolerance")
    ax.set(xlabel="neurons skipped per token, held-out text (%)",
           ylabel="perplexity increase over dense (%)",
           title=f"the cost of a magnitude cut: {Path(report['meta']['model']).name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
