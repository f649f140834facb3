"""Activation locality of a model's MLPs: which neurons fire, how often, and how stable that is.

    python -m eval.locality profile --model runs/drelu --out runs/drelu/locality
    python -m eval.locality profile --model SmolLM2-135M-Instruct --sparsity 0.5 --tokens 20000
    python -m eval.locality sweep --model SmolLM2-135M-Instruct --targets 0.1 0.2 0.3 0.4 0.5

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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from egmla.models.sparse_ffn import (LayerPredictor, Threshold, calibrate_thresholds, firing,
                                     layer_thresholds, over_mlp_inputs,
                                     predictors_to_tensors)
from serve.__main__ import parse_bytes
from eval.selfdebug.report import write_atomic

SOURCES = ("corpus-a", "corpus-b", "gsm8k", "humaneval")
UNION_BATCHES = (1, 4, 16)
BATCH = 16  # sequences per forward pass: the largest union batch
TOP_SHARE = 0.2  # the hot set whose stability across sources is reported
COVERAGE = 0.8  # "X% of neurons give 80% of firings"
CURVE_POINTS = 101
CALIBRATION_TOKENS = 4096  # of corpus-a, for --sparsity's per-layer thresholds
SWEEP_TARGETS = (0.1, 0.2, 0.3, 0.4, 0.5)


class UsageError(ValueError):
    """A bad command-line value or input; `main` prints it as one line and exits 2."""


# ---- text sources -----------------------------------------------------------------------------


def source_texts(name: str) -> list[str]:
    """The texts of one source (see the module doc); offline, from installed packages."""
    if name in ("corpus-a", "corpus-b"):
        from egmla.data.corpus import corpus_documents, stable_fraction

        first = name == "corpus-a"
        return [d.text for d in corpus_documents() if (stable_fraction(d.name) < 0.5) == first]
    if name == "gsm8k":
        from eval.tasks.gsm8k.utils import data_file

        with open(data_file()) as f:
            return ["\n\n".join(json.loads(line)["question"] for line in f if line.strip())]
    if name == "humaneval":
        from eval.selfdebug.datasets import load_humaneval

        return ["\n\n".join(problem.prompt for problem in load_humaneval())]
    raise UsageError(f"unknown source {name!r}; known: {', '.join(SOURCES)}")


def token_stream(tokenizer, texts: list[str], needed: int, piece: int = 50_000) -> list[int]:
    """The texts' token ids, in order, tokenized a piece of characters at a time until there are
    `needed` (a piece boundary may split a word: a few tokens in tens of thousands)."""
    ids: list[int] = []
    for text in texts:
        for start in range(0, len(text), piece):
            ids += tokenizer.encode(text[start:start + piece])
            if len(ids) >= needed:
                return ids
    return ids


def windows(token_ids: list[int], seq_len: int, tokens: int) -> torch.Tensor:
    """(n, seq_len) consecutive windows of the token stream, n * seq_len <= tokens, n a
    multiple of BATCH (at least one batch)."""
    n = min(len(token_ids) // seq_len, max(tokens // seq_len, BATCH)) // BATCH * BATCH
    if n == 0:
        raise UsageError(f"the source has {len(token_ids)} tokens, fewer than one batch of "
                         f"{BATCH} x {seq_len}; lower --seq-len")
    return torch.tensor(token_ids[: n * seq_len]).view(n, seq_len)


# ---- what fires -------------------------------------------------------------------------------


class LayerStats:
    """Firing statistics of one layer, accumulated over batches of (B, T, d_ff) masks."""

    def __init__(self, d_ff: int) -> None:
        self.counts = torch.zeros(d_ff, dtype=torch.long)
        self.tokens = 0
        self.per_token: list[torch.Tensor] = []  # active fraction of each token
        self.union = {b: [] for b in UNION_BATCHES}

    def add(self, mask: torch.Tensor) -> None:
        B, T, d_ff = mask.shape
        self.counts += mask.sum((0, 1))
        self.tokens += B * T
        self.per_token.append(mask.float().mean(-1).flatten())
        for b in UNION_BATCHES:
            if B % b == 0:
                grouped = mask.view(B // b, b, T, d_ff).any(1)  # b sequences at one position
                self.union[b].append(grouped.float().mean(-1).flatten())

    def summary(self) -> dict[str, Any]:
        fractions = torch.cat(self.per_token)
        q = torch.quantile(fractions, torch.tensor([0.1, 0.5, 0.9])).tolist()
        return {
            "tokens": self.tokens,
            "active_fraction": {"mean": fractions.mean().item(), "p10": q[0], "p50": q[1],
                                "p90": q[2]},
            "sparsity": 1 - fractions.mean().item(),
            "neurons_for_80pct": coverage_share(self.counts),
            "never_fired": (self.counts == 0).float().mean().item(),
            "union_sparsity": {str(b): 1 - torch.cat(v).mean().item()
                               for b, v in self.union.items() if v},
            "curve": concentration_curve(self.counts),
        }


def coverage_share(counts: torch.Tensor, coverage: float = COVERAGE) -> float | None:
    """The smallest share of neurons (most frequent first) that give `coverage` of all firings;
    None when nothing fired."""
    total = counts.sum().item()
    if total == 0:
        return None
    cum = counts.sort(descending=True).values.cumsum(0).double() / total
    k = int(torch.searchsorted(cum, torch.tensor([coverage], dtype=torch.float64)).item()) + 1
    return min(k, counts.numel()) / counts.numel()


def concentration_curve(counts: torch.Tensor, points: int = CURVE_POINTS) -> list[float]:
    """Share of all firings given by the top x share of neurons, at x = 0, 1/(points-1), ..., 1."""
    total = counts.sum().item()
    cum = torch.cat([torch.zeros(1), counts.sort(descending=True).values.cumsum(0).double()])
    idx = torch.linspace(0, counts.numel(), points).round().long()
    return (cum[idx] / total).tolist() if total else [0.0] * points


def top_overlap(a: torch.Tensor, b: torch.Tensor, share: float = TOP_SHARE) -> float:
    """|top(a) & top(b)| / |top(a)|, top = the `share` most frequent neurons."""
    k = max(1, round(share * a.numel()))
    ta, tb = set(a.topk(k).indices.tolist()), set(b.topk(k).indices.tolist())
    return len(ta & tb) / k


def profile_model(model, batches: Iterator[torch.Tensor], threshold: Threshold = 0.0,
                  progress: Callable[[int], None] | None = None) -> list[LayerStats]:
    """Run `model` over the (B, T) token batches and gather each layer's LayerStats, firing
    at `threshold` (one for every layer, or one per layer)."""
    layers = [LayerStats(block.mlp.w_up.out_features) for block in model.layers]
    thresholds = layer_thresholds(threshold, len(model.layers))

    def counted(batches):
        for ids in batches:
            yield ids
            if progress:
                progress(ids.numel())
    over_mlp_inputs(model, counted(batches),
                    lambda i, mlp, x: layers[i].add(firing(mlp, x, thresholds[i])))
    return layers


def pooled(layers: list[LayerStats]) -> dict[str, Any]:
    counts = torch.cat([s.counts for s in layers])
    return {"neurons_for_80pct": coverage_share(counts), "curve": concentration_curve(counts),
            "sparsity": sum(s.summary()["sparsity"] for s in layers) / len(layers)}


# ---- the report -------------------------------------------------------------------------------


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

    write_atomic(path, png_bytes(fig))
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------


def _number(kind: type, ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: `kind(text)`, refused in one line unless `ok(value)`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a {'number' if kind is float else kind.__name__}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule}")
        return value
    return parse


def positive(kind: type) -> Callable[[str], Any]:
    return _number(kind, lambda v: v > 0, "> 0")


non_negative_float = _number(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
share = _number(float, lambda v: 0 <= v <= 1, "in [0, 1]")
open_share = _number(float, lambda v: 0 < v < 1, "in (0, 1)")


def default_out(model: str | Path) -> Path:
    """Where the commands write for `model` by default: <model>/locality for a directory, else
    runs/locality/<name> (benchmarks/activation_locality.py looks for predictors there)."""
    return Path(model) / "locality" if Path(model).is_dir() else Path("runs") / "locality" / Path(model).name


def _model_args(p: argparse.ArgumentParser, tokens: int, what: str = "per source") -> None:
    p.add_argument("--model", required=True,
                   help="an export or run directory, a known name (SmolLM2-135M-Instruct), or a "
                        "transformers directory: what egmla.imports.load_pretrained takes")
    p.add_argument("--tokens", type=positive(int), default=tokens,
                   help=f"tokens {what}, at most (default {tokens}; whole batches of 16 "
                        "windows)")
    p.add_argument("--seq-len", type=positive(int), default=256,
                   help="tokens per window (default 256)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: <model>/locality for a directory, else "
                        "runs/locality/<name>)")


def _common(p: argparse.ArgumentParser, tokens: int) -> None:
    _model_args(p, tokens)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--threshold", type=non_negative_float, default=0.0,
                     help="a neuron fires only above this score (default 0: exact zeros only; "
                          "SwiGLU needs a threshold or --sparsity)")
    how.add_argument("--sparsity", type=open_share, default=None,
                     help="instead of --threshold: a threshold per layer, calibrated so that "
                          "this share of its neurons is skipped per token (CATS; e.g. 0.5)")


def build_parser() -> argparse.ArgumentParser:
    from eval import predictors

    parser = argparse.ArgumentParser(
        prog="python -m eval.locality",
        description="Activation locality of a model's MLPs (PowerInfer's measurements).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="which neurons fire, how often, how stably (module doc)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, 50_000)
    p.add_argument("--data", nargs="+", choices=SOURCES, default=list(SOURCES), metavar="SOURCE",
                   help=f"text sources (default: all of {', '.join(SOURCES)})")
    p = sub.add_parser("predictors", help="train per-layer predictors of the firing neurons",
                       description=predictors.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, 20_000)
    p.add_argument("--held-out-tokens", type=positive(int), default=8192,
                   help="held-out tokens (corpus-b) for recall and perplexity (default 8192)")
    p.add_argument("--ranks", type=positive(int), nargs="+", default=[32, 64, 128],
                   help="predictor ranks to try, in order (default 32 64 128)")
    hot = p.add_mutually_exclusive_group()
    hot.add_argument("--hot", type=share, nargs="+", default=[0.1],
                     help="share of each layer's neurons, most frequent first, always computed "
                          "(default 0.1); several: each is tried (see above)")
    hot.add_argument("--hot-budget", type=parse_bytes, metavar="BYTES",
                     help="instead of --hot: a memory budget for the hot tier (512KiB, 8MiB): the "
                          "most often firing neurons of the whole model whose weights fit in it")
    p.add_argument("--recall", type=share, nargs="+", default=[0.95],
                   help="recall of the cold neurons' firings the bias is calibrated to (0.95); "
                        "several: each is tried (see above)")
    p.add_argument("--tolerance", type=non_negative_float, default=0.01,
                   help="relative perplexity increase over dense that is accepted (0.01: 1%%)")
    p.add_argument("--steps", type=positive(int), default=400,
                   help="training steps per predictor (default 400)")
    p = sub.add_parser("sweep", help="the perplexity a target sparsity costs (magnitude cuts)",
                       description=sweep.__doc__)
    _model_args(p, 8192, "of held-out text (corpus-b)")
    p.add_argument("--targets", type=open_share, nargs="+", default=list(SWEEP_TARGETS),
                   help="target sparsities, each calibrated as --sparsity is (default "
                        f"{' '.join(map(str, SWEEP_TARGETS))})")
    p.add_argument("--tolerance", type=non_negative_float, default=0.01,
                   help="the perplexity increase over dense the report's 'largest target within' "
                        "line accepts (0.01: 1%%)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    from egmla.checkpoint import CheckpointError
    from egmla.imports import load_pretrained
    from egmla.provenance import provenance

    start, made_at = time.perf_counter(), provenance()  # the code that runs: the start's SHA
    try:
        model, tokenizer = load_pretrained(args.model, dtype=torch.float32)
        if tokenizer is None:
            raise UsageError(f"{args.model}: no tokenizer comes with this model, so its text "
                             "sources cannot be tokenized")
        if args.seq_len > model.config.max_seq_len:
            raise UsageError(f"--seq-len {args.seq_len}: the model's max_seq_len is "
                             f"{model.config.max_seq_len}")
        model.eval()
        if getattr(args, "sparsity", None) is not None:
            args.threshold = sparsity_thresholds(model, tokenizer, args.sparsity, args.seq_len)
        if args.command == "profile":
            report, tensors = build_report(model, tokenizer, list(dict.fromkeys(args.data)),
                                           args.tokens, args.seq_len, args.threshold)
            metadata = None
        elif args.command == "sweep":
            report, tensors = sweep(model, tokenizer, args.targets, args.tokens, args.seq_len,
                                    args.tolerance), {}
        else:
            report, tensors, metadata = build_predictors(model, tokenizer, args)
    except (UsageError, CheckpointError, FileNotFoundError) as err:
        print(f"locality: error: {err}", file=sys.stderr)
        return 2
    out = args.out or default_out(args.model)
    report["meta"] = {**made_at, "model": str(args.model), "ffn": model.config.ffn,
                      "d_ff": model.config.d_ff, "n_layers": model.config.n_layers,
                      "threshold": getattr(args, "threshold", None),
                      "sparsity": getattr(args, "sparsity", None),
                      "seq_len": args.seq_len, "config": config,
                      "elapsed_s": round(time.perf_counter() - start, 1)}
    import safetensors.torch

    out.mkdir(parents=True, exist_ok=True)
    name = args.command
    write_atomic(out / f"{name}.json", (json.dumps(report, indent=2) + "\n").encode())
    if name == "profile":
        md = markdown(report)
        write_atomic(out / "neuron_counts.safetensors", safetensors.torch.save(tensors))
        plot(report, out / "profile.png")
        files = "profile.json, profile.md, profile.png, neuron_counts.safetensors"
    elif name == "sweep":
        md = sweep_markdown(report)
        sweep_plot(report, out / "sweep.png")
        files = "sweep.json, sweep.md, sweep.png"
    else:
        md = predictors_markdown(report)
        files = "predictors.json, predictors.md"
        if tensors:
            write_atomic(out / "predictors.safetensors", safetensors.torch.save(tensors, metadata))
            files += ", predictors.safetensors"
        else:  # none within the tolerance: no file (an older one would not match the report)
            (out / "predictors.safetensors").unlink(missing_ok=True)
    write_atomic(out / f"{name}.md", md.encode())
    print(md)
    print(f"wrote {', '.join(f'{out}/{f}' for f in files.split(', '))}")
    return 0


# ---- the cost of a target sparsity -------------------------------------------------------------


def sweep(model, tokenizer, targets: list[float], tokens: int, seq_len: int,
          tolerance: float) -> dict[str, Any]:
    """What a magnitude cut (TEAL, CATS) costs. For each target sparsity: the per-layer
    thresholds calibrated for it on the first 4,096 tokens of corpus-a (as --sparsity does), the
    share of (token, neuron) pairs they skip on held-out text (corpus-b), and the perplexity
    there of the model computing only what fires, against dense. The report names the largest
    target within the tolerance: the sparsity a model gives for free."""
    from eval import predictors as P

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


# ---- predictors -------------------------------------------------------------------------------


def build_predictors(model, tokenizer, args
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    """Train and choose predictors (eval.predictors' doc); the report, and the tensors and
    metadata to save (none if no rank was within the tolerance)."""
    from eval import predictors as P

    def data(source: str, tokens: int) -> torch.Tensor:
        ids = token_stream(tokenizer, source_texts(source), max(tokens, BATCH * args.seq_len))
        return windows(ids, args.seq_len, tokens)

    train_ids, held_ids = data("corpus-a", args.tokens), data("corpus-b", args.held_out_tokens)
    print(f"collecting MLP inputs: {train_ids.numel()} training and {held_ids.numel()} held-out "
          "tokens ...", file=sys.stderr, flush=True)
    train = P.collect(model, train_ids.split(BATCH), args.threshold)
    orders = [P.frequency_order(fired) for _, fired in train]
    P.reorder(model, orders)
    train = [(x, fired[:, order]) for (x, fired), order in zip(train, orders)]
    held = P.collect(model, held_ids.split(BATCH), args.threshold)
    held_x, held_fired = [x for x, _ in held], [f for _, f in held]
    dense = P.perplexity(model, held_ids.split(BATCH))
    thresholds = layer_thresholds(args.threshold, len(model.layers))
    # the reference a predictor is held to: the model computing exactly what fires (at a
    # threshold, SwiGLU's firing set, an approximation of its own; else dense itself)
    reference = dense if not any(thresholds) else P.perplexity(
        model, held_ids.split(BATCH), lambda i, mlp, x: firing(mlp, x, thresholds[i]))
    if reference != dense:
        print(f"perplexity {reference:.3f} at the thresholds alone (dense {dense:.3f}, "
              f"{reference / dense - 1:+.2%}): the predictors' reference", file=sys.stderr,
              flush=True)
    if args.hot_budget is not None:
        cfg = model.config
        neuron_bytes = cfg.ffn_matrices * cfg.d_model * model.layers[0].mlp.w_up.weight.element_size()
        hot_options = {None: P.hot_under_budget([f.sum(0) for _, f in train], neuron_bytes,
                                                args.hot_budget)}
    else:
        hot_options = {share: P.hot_by_share(train, share) for share in dict.fromkeys(args.hot)}
    tried, chosen, best = [], None, None
    for rank, hots, recall, preds, rows in P.fit(model, train, held_x, held_fired, args.ranks,
                                                 list(hot_options.values()),
                                                 list(dict.fromkeys(args.recall)), args.steps):
        if chosen is not None and rank != chosen:
            break  # a smaller rank had a setting within the tolerance

        def keep(i, mlp, x, preds=preds, hots=hots):
            mask = preds[i](x)
            mask[:, :hots[i]] = True
            return mask & firing(mlp, x, thresholds[i])

        ppl = P.perplexity(model, held_ids.split(BATCH), keep)
        share = next(s for s, h in hot_options.items() if h is hots)
        entry = {"rank": rank, "hot_share": share, "hot": hots, "recall_target": recall,
                 "perplexity": ppl, "relative_increase": ppl / reference - 1,
                 "vs_dense": ppl / dense - 1,
                 "density": sum(r["density"] for r in rows) / len(rows), "layers": rows,
                 "params_share_of_model": sum(p.params() for p in preds) / model.num_params()}
        tried.append(entry)
        print(f"rank {rank}, hot {'budget' if share is None else share}, recall target {recall}: "
              f"perplexity {ppl:.3f} (reference {reference:.3f}, "
              f"{entry['relative_increase']:+.2%}), "
              f"recall {sum(r['recall'] or 0 for r in rows) / len(rows):.3f}, "
              f"density {entry['density']:.3f}", file=sys.stderr, flush=True)
        if entry["relative_increase"] <= args.tolerance and (
                best is None or entry["density"] < best[0]["density"]):
            chosen, best = rank, (entry, preds)
    report = {"dense_perplexity": dense, "reference_perplexity": reference, "tried": tried,
              "chosen_rank": chosen,
              "tolerance": args.tolerance, "hot_budget_bytes": args.hot_budget,
              "recall_target": None, "hot_share": None, "hot": None,
              "train_tokens": train_ids.numel(), "held_out_tokens": held_ids.numel()}
    if best is None:
        report["note"] = (f"no rank in {args.ranks} kept perplexity within {args.tolerance:.1%} "
                          "of the reference; nothing saved")
        return report, {}, {}
    entry, preds = best
    report.update(recall_target=entry["recall_target"], hot_share=entry["hot_share"],
                  hot=entry["hot"])
    tensors, metadata = predictors_to_tensors(
        [LayerPredictor(*layer) for layer in zip(preds, orders, entry["hot"])], args.threshold)
    if args.sparsity is not None:
        metadata["sparsity"] = repr(args.sparsity)
    return report, tensors, metadata


def predictors_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    budget = report["hot_budget_bytes"]
    chosen = ("none chosen" if report["chosen_rank"] is None else
              f"chosen: rank {report['chosen_rank']}, hot block "
              + (f"share {report['hot_share']}" if budget is None else f"under a {budget:,}-byte budget")
              + f" ({', '.join(map(str, report['hot']))} neurons by layer), recall target "
              f"{report['recall_target']}")
    dense, reference = report["dense_perplexity"], report["reference_perplexity"]
    held_to = ("dense" if reference == dense else
               f"the {describe_threshold(meta['threshold'], meta.get('sparsity'))} alone, "
               f"perplexity {reference:.3f} ({reference / dense - 1:+.2%} over dense)")
    lines = [f"# Predictors: {meta['model']}", "",
             (f"ffn {meta['ffn']}; {report['train_tokens']} training tokens (corpus-a), "
              f"{report['held_out_tokens']} held out (corpus-b); dense perplexity "
              f"{dense:.3f}; reference: {held_to}; tolerance {report['tolerance']:.1%} over the "
              f"reference; {chosen}; git {str(meta['git'].get('sha'))[:10]}."), "",
             ("| rank | hot share | recall target | perplexity | vs reference | vs dense | "
              "mean recall | mean density | mean firing | predictor params / model |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in report["tried"]:
        n = len(t["layers"])
        lines.append(
            f"| {t['rank']} | {'budget' if t['hot_share'] is None else t['hot_share']} | "
            f"{t['recall_target']} | {t['perplexity']:.3f} | {t['relative_increase']:+.2%} | "
            f"{t['vs_dense']:+.2%} | "
            f"{sum(r['recall'] or 0 for r in t['layers']) / n:.3f} | {t['density']:.1%} | "
            f"{sum(r['firing_density'] for r in t['layers']) / n:.1%} | "
            f"{t['params_share_of_model']:.1%} |")
    lines += ["", f"Chosen rank: {report['chosen_rank']}" + (
        f" ({report['note']})" if report.get("note") else "")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
