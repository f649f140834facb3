"""Activation locality of a model's MLPs: which neurons fire, how often, and how stable that is.

    python -m studies.locality profile --model runs/drelu --out runs/drelu/locality
    python -m studies.locality profile --model SmolLM2-135M-Instruct --sparsity 0.5 --tokens 20000
    python -m studies.locality sweep --model SmolLM2-135M-Instruct --targets 0.1 0.2 0.3 0.4 0.5

A neuron of a layer's MLP fires for a token where its hidden activation h is non-zero
(egmla.models.layers.FeedForward; exact sparsity for the ReLU family) and, with `--threshold t`,
where its deciding score is above t as well: |silu(gate)| for SwiGLU (TEAL / CATS-style
magnitude thresholds, the training-free baseline), the gate (relu2: up) pre-activation for the
ReLU family. With `--sparsity s` instead, each layer gets its own threshold, the s quantile of
its scores over the first 4,096 tokens of corpus-a (CATS's calibration: about s of each layer's
neurons are skipped per token). This is the set `egmla.models.sparse_ffn.SparseDecode` computes.

For each text source (`--data`: the embedded corpus's two halves, GSM8K questions, HumanEval
prompts), windows of `--seq-len` tokens in batches of 16 sequences, and for each layer:

- the fraction of neurons that fire per token (mean and quantiles over tokens); its complement
  is the sparsity;
- each neuron's firing frequency, and its concentration: the share of neurons that give 80% of
  all firings (PowerInfer's "26% of neurons give 80% of activations"), per layer and pooled over
  the model, with the curve (share of firings against share of neurons, most frequent first);
- the union sparsity of a decode batch: the fraction of neurons that fire for some row of a
  batch of B sequences at one position (B = 1, 4, 16; Deja Vu's point that batching erodes it);
- across sources: the overlap of the top 20% most frequent neurons (PowerInfer: > 90%).

Writes OUT/profile.json (config, git SHA, versions, the thresholds, everything above), OUT/profile.md,
OUT/profile.png (the curves and the union sparsity), and OUT/neuron_counts.safetensors (per
source and layer, the firing count of every neuron, for reordering neurons hot-first).

`sweep` measures what a target sparsity costs: for each target, the per-layer thresholds
calibrated for it, the share of neurons they skip on held-out text (corpus-b) and the
perplexity there of the model computing only what fires, against dense (OUT/sweep.json,
sweep.md, sweep.png). `predictors` is described in its own `--help`.

The package: sources (the texts, tokenized into windows), firing (what fires, per layer),
profile (the report and its plot; per-layer thresholds for a target sparsity), sweep,
predictors (eval's PowerInfer-style predictors, trained and chosen), cli (this command line),
and runs (`python -m studies.locality.runs`, the issue-19 pipeline: train, profile,
predictors and benchmark, resumable; with `--steps lean`, issue 42's re-run of the leaner
predictors beside the defaults).
"""

from studies.locality.cli import build_parser, default_out, main
from studies.locality.firing import (LayerStats, concentration_curve, coverage_share, pooled,
                                     profile_model, top_overlap)
from studies.locality.profile import build_report, describe_threshold, markdown, sparsity_thresholds
from studies.locality.sources import BATCH, SOURCES, UsageError, source_texts, token_stream, windows

__all__ = ["BATCH", "SOURCES", "LayerStats", "UsageError", "build_parser", "build_report",
           "concentration_curve", "coverage_share", "default_out", "describe_threshold", "main",
           "markdown", "pooled", "profile_model", "source_texts", "sparsity_thresholds", "token_stream",
           "top_overlap", "windows"]
