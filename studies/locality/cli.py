"""`python -m studies.locality profile|sweep|predictors`: the command line (the package's
docstring says what each measures)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from egmla.files import output_directory, write_bytes
from egmla.units import parse_bytes
from studies.locality.predictors import build_predictors, predictors_markdown
from studies.locality.profile import build_report, markdown, plot, sparsity_thresholds
from studies.locality.sources import SOURCES, UsageError
from studies.locality.sweep import SWEEP_TARGETS, sweep, sweep_markdown, sweep_plot


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
    p.add_argument("--out", type=output_directory, default=None,
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
    import studies.locality as package
    from studies.locality import predictors

    parser = argparse.ArgumentParser(
        prog="python -m studies.locality",
        description="Activation locality of a model's MLPs (PowerInfer's measurements).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="which neurons fire, how often, how stably (module doc)",
                       description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def recorded_config(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as a report's meta.config holds them (paths as text): what a
    pipeline compares to tell whether a report was made with the settings it would use."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = recorded_config(args)
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
    saved = safetensors.torch.save(tensors, metadata) if name == "predictors" and tensors else None
    if saved is not None:  # the file's hash in its report: a benchmark can name what it timed
        report["meta"]["predictors_sha256"] = hashlib.sha256(saved).hexdigest()
    write_bytes(out / f"{name}.json", (json.dumps(report, indent=2) + "\n").encode(), mode=0o644)
    if name == "profile":
        md = markdown(report)
        write_bytes(out / "neuron_counts.safetensors", safetensors.torch.save(tensors), mode=0o644)
        plot(report, out / "profile.png")
        files = "profile.json, profile.md, profile.png, neuron_counts.safetensors"
    elif name == "sweep":
        md = sweep_markdown(report)
        sweep_plot(report, out / "sweep.png")
        files = "sweep.json, sweep.md, sweep.png"
    else:
        md = predictors_markdown(report)
        files = "predictors.json, predictors.md"
        if saved is not None:
            write_bytes(out / "predictors.safetensors", saved, mode=0o644)
            files += ", predictors.safetensors"
        else:  # none within the tolerance: no file (an older one would not match the report)
            (out / "predictors.safetensors").unlink(missing_ok=True)
    write_bytes(out / f"{name}.md", md.encode(), mode=0o644)
    print(md)
    print(f"wrote {', '.join(f'{out}/{f}' for f in files.split(', '))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
