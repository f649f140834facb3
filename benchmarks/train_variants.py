"""Loss after equal tokens and training throughput per attention variant, at the quickstart size.

Each variant (MHA, GQA-2, MLA, EG-MLA kv, EG-MLA latent) trains with the quickstart recipe at an
equal parameter budget: the SwiGLU width d_ff of each variant is set so that its parameters
(gate tables excluded: they are lookups, not compute) match MHA's within 0.5%. Two seeds per
variant, runs interleaved (seed 0 of every variant, then seed 1) so machine noise spreads evenly.
Every run is a real `train.py` process; the numbers come from its summary.json and metrics.csv.

    python benchmarks/train_variants.py                  # 5 variants x 2 seeds x 300 steps
    python benchmarks/train_variants.py --steps 50 --seeds 0
    python benchmarks/train_variants.py --runs-dir runs/variants   # keep the runs, then:
    python -m eval.compare runs/variants --out runs/variants-comparison

Writes benchmarks/results/train_variants.{json,md} with the machine, versions and git SHA.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from egmla.files import output_directory, write_json, write_text  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from egmla.training.config import seed_arg  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

VARIANTS = ["small_mha", "small_gqa2", "small_mla", "small_egmla", "small_egmla_latent"]


def composed_model(attention: str, d_ff: int | None = None) -> dict:
    from egmla.training.compose import compose_config

    overrides = ["experiment=quickstart", f"model/attention={attention}"]
    if d_ff is not None:
        overrides.append(f"model.d_ff={d_ff}")
    return compose_config(overrides)["model"]


def matched_d_ff(attention: str, target: int) -> tuple[int, int]:
    """d_ff giving `attention` the parameter count `target` (gate tables excluded)."""
    from egmla.config import ModelConfig

    base = ModelConfig.from_dict(composed_model(attention))
    per_unit = 3 * base.d_model * base.n_layers  # SwiGLU params per unit of d_ff
    d_ff = base.d_ff + round((target - base.num_params(include_gate_tables=False)) / per_unit)
    cfg = ModelConfig.from_dict(composed_model(attention, d_ff))
    return d_ff, cfg.num_params(include_gate_tables=False)


def run(attention: str, seed: int, d_ff: int, steps: int, workdir: Path, export: bool,
        extra: tuple[str, ...] = (), tag: str = "") -> dict:
    """One `train.py` run of the quickstart recipe; `extra` overrides, `tag` joins the name."""
    name = f"{attention}{tag}-s{seed}"
    run_dir = workdir / name
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=quickstart", *extra,
           f"model/attention={attention}", f"model.d_ff={d_ff}", f"seed={seed}",
           f"trainer.max_steps={steps}", f"trainer.val_every_n_steps={steps}",
           f"trainer.checkpoint_every_n_steps={steps}", "trainer.limit_val_batches=1.0",
           "wandb.mode=disabled", f"export={str(export).lower()}", "sample_prompt=null",
           f"name={name}", f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{attention} seed {seed} failed:\n{out.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    with (run_dir / "metrics.csv").open() as f:
        rates = [float(r["train/tokens_per_s"]) for r in csv.DictReader(f)
                 if r.get("train/tokens_per_s")]
    info = json.loads((run_dir / "run_info.json").read_text())
    return {"attention": attention, "seed": seed, "d_ff": d_ff, "steps": summary["global_step"],
            "val_loss": summary["val_loss"], "unigram_val_loss": summary["unigram_val_loss"],
            "tokens_per_s": statistics.median(rates), "fit_seconds": summary["fit_seconds"],
            "params": info["params"], "params_without_gate_tables": info["params_without_gate_tables"],
            "kv_bytes_per_token_bf16": info["kv_bytes_per_token_bf16"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--seeds", type=seed_arg, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", type=output_directory, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--runs-dir", type=output_directory, metavar="DIR",
                        help="keep the run directories, each with its export, in "
                             "DIR/<variant>-s<seed> (a run already there is resumed, as "
                             "train.py does); default: a temporary directory, deleted at the "
                             "end, and no exports")
    args = parser.parse_args()

    from egmla.config import ModelConfig

    target = ModelConfig.from_dict(composed_model("small_mha")).num_params()
    budget = {v: matched_d_ff(v, target) for v in args.variants}
    rows = []
    if args.runs_dir:
        args.runs_dir.mkdir(parents=True, exist_ok=True)
    workdir = (contextlib.nullcontext(str(args.runs_dir.resolve())) if args.runs_dir
               else tempfile.TemporaryDirectory(prefix="egmla-bench-"))
    with workdir as tmp:
        for seed in args.seeds:
            for v in args.variants:
                row = run(v, seed, budget[v][0], args.steps, Path(tmp), export=bool(args.runs_dir))
                rows.append(row)
                print(f"{v:<20} seed {seed}: val loss {row['val_loss']:.4f}  "
                      f"{row['tokens_per_s']:7.0f} tok/s  d_ff {row['d_ff']}", flush=True)

    mha = [r["tokens_per_s"] for r in rows if r["attention"] == "small_mha"]
    mha_rate = statistics.mean(mha) if mha else None  # not run: no ratio to it
    summary = []
    for v in args.variants:
        rs = [r for r in rows if r["attention"] == v]
        losses = [r["val_loss"] for r in rs]
        rate = statistics.mean(r["tokens_per_s"] for r in rs)
        summary.append({
            "attention": v, "d_ff": rs[0]["d_ff"], "params_without_gate_tables":
            rs[0]["params_without_gate_tables"], "params": rs[0]["params"],
            "kv_bytes_per_token_bf16": rs[0]["kv_bytes_per_token_bf16"],
            "val_loss_mean": statistics.mean(losses), "val_loss_by_seed": losses,
            "tokens_per_s": round(rate, 1),
            "throughput_vs_mha": round(rate / mha_rate, 3) if mha_rate else None,
        })
    tokens = args.steps * 16 * 128
    meta = {**provenance(), "steps": args.steps, "tokens_per_run": tokens, "seeds": args.seeds,
            "recipe": "experiment=quickstart (seq 128, batch 16, AdamW 2e-3 cosine)",
            "unigram_val_loss": rows[0]["unigram_val_loss"]}
    lines = [
        "# Attention variants at the quickstart size: loss after equal tokens, throughput",
        "",
        f"{meta['time_utc']}; {meta['hardware']['cpu']}; git {meta['git']['sha']}; "
        f"{args.steps} steps = {tokens:,} tokens per run; seeds {args.seeds}; parameter budget "
        f"matched to MHA ({target:,}) through d_ff, gate tables excluded; unigram baseline "
        f"{meta['unigram_val_loss']:.3f}. Single learning rate (2e-3), not tuned per variant.",
        "",
        "| attention | d_ff | params (+gate tables) | KV B/token bf16 | val loss (mean; per seed) "
        "| tok/s | vs MHA |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['attention']} | {s['d_ff']} | {s['params_without_gate_tables']:,} "
            f"({s['params']:,}) | {s['kv_bytes_per_token_bf16']:,} | {s['val_loss_mean']:.4f}; "
            + ", ".join(f"{x:.4f}" for x in s["val_loss_by_seed"])
            + f" | {s['tokens_per_s']:,.0f} | "
            + ("-" if s["throughput_vs_mha"] is None else f"{s['throughput_vs_mha']:.2f}") + " |")
    md = "\n".join(lines) + "\n"
    write_json(args.out / "train_variants.json", {"meta": meta, "summary": summary, "runs": rows},
               indent=2, parents=True)
    write_text(args.out / "train_variants.md", md)
    print("\n" + md)


if __name__ == "__main__":
    main()
