"""Which initialization of EG-MLA's gate trains best: `random`, `matched` or `small` (gate_init).

At the quickstart size and recipe (train_variants' parameter budget, 300 steps = 614,400
tokens, one learning rate 2e-3, not tuned per arm), for both gate positions and each
`model.attention.gate_init`, over seeds; every run is a real `train.py` process. Besides the
validation loss it records, on the freshly built model, the scale of what the gate norm sees
and hands on (min over tokens of the gated vector's variance, std of the norm's output) and the
gate's std: the quantities docs/attention.md argues from.

    python benchmarks/gate_init.py          # kv x 3 inits + latent x 2 (matched == random), 2 seeds
    python benchmarks/gate_init.py --seeds 0 --steps 50   # a smoke run

Writes benchmarks/results/gate_init.{json,md}. A run directory under --runs-dir that already
finished is reused (train.py resumes or reports), so an interrupted study continues.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_variants import composed_model, matched_d_ff, run  # noqa: E402

from egmla.files import output_directory, output_prefix, write_json, write_text  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from egmla.training.config import seed_arg  # noqa: E402
from eval.stats import interval  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

POSITIONS = {"kv": "small_egmla", "latent": "small_egmla_latent"}
INITS = ["random", "matched", "small"]


def init_diagnostics(attention: str, gate_init: str, d_ff: int) -> dict:
    """The gate and its norm at initialization, on the composed model (seed 0, 2 x 128 tokens)."""
    from egmla.config import ModelConfig
    from egmla.models import Transformer

    cfg = composed_model(attention, d_ff)
    cfg["attention"]["gate_init"] = gate_init
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict(cfg)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    seen = []
    hooks = [b.attn.gate_norm.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
             for b in model.layers]
    with torch.no_grad():
        model(ids)
        gate_std = statistics.mean(b.attn.gate(ids).std().item() for b in model.layers)
    for h in hooks:
        h.remove()
    return {"gate_std": gate_std,
            "norm_input_min_var": min(z.var(-1).min().item() for z, _ in seen),
            "norm_output_std": statistics.mean(y.std().item() for _, y in seen),
            "norm_eps": model.config.norm_eps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--seeds", type=seed_arg, nargs="+", default=[0, 1])
    p.add_argument("--positions", nargs="+", choices=list(POSITIONS), default=list(POSITIONS))
    p.add_argument("--inits", nargs="+", choices=INITS, default=INITS)
    p.add_argument("--runs-dir", type=output_directory, default=ROOT / "runs" / "gate_init")
    p.add_argument("--out", type=output_prefix, default=ROOT / "benchmarks" / "results" / "gate_init")
    args = p.parse_args(argv)

    from egmla.config import ModelConfig

    target = ModelConfig.from_dict(composed_model("small_mha")).num_params()
    d_ff = {pos: matched_d_ff(att, target)[0] for pos, att in POSITIONS.items()}
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    arms = [(pos, init) for pos in args.positions for init in args.inits
            if not (pos == "latent" and init == "matched")]  # under latent, matched == random
    for seed in args.seeds:  # interleaved: every arm of seed 0, then seed 1
        for pos, init in arms:
            row = run(POSITIONS[pos], seed, d_ff[pos], args.steps, args.runs_dir.resolve(),
                      export=False, extra=(f"model.attention.gate_init={init}",), tag=f"-{init}")
            rows.append({**row, "position": pos, "gate_init": init})
            print(f"{pos:6} {init:7} seed {seed}: val loss {row['val_loss']:.4f}", flush=True)
    results = []
    for pos, init in arms:
        losses = [r["val_loss"] for r in rows if r["position"] == pos and r["gate_init"] == init]
        ci = interval(losses)  # Student-t over the seeds
        half = None if ci["low"] is None else ci["high"] - ci["mean"]
        results.append({"position": pos, "gate_init": init, "val_loss_mean": ci["mean"],
                        "val_loss_ci95_half": half, "val_losses": losses,
                        **init_diagnostics(POSITIONS[pos], init, d_ff[pos])})
    info = provenance()
    write_json(args.out.with_suffix(".json"),
               {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "arms": results, "runs": rows, **info}, indent=2, parents=True)
    lines = [
        "# EG-MLA gate initialization: validation loss after equal tokens", "",
        f"{info['hardware'].get('cpu', 'CPU')}; git {info['git']['sha']}"
        f"{' (dirty tree)' if info['git']['dirty'] else ''}; quickstart recipe, {args.steps} steps "
        f"({rows[0]['steps'] * 16 * 128:,} tokens) per run, seeds {args.seeds}, one learning rate "
        "(2e-3) for every arm; d_ff matched to MHA's parameter count (gate tables excluded). "
        "Interval: mean +- t(95%) x standard error over seeds (2 seeds: a wide interval).", "",
        "At initialization (seed 0): `g std` is the gate's std, `norm in min var` the smallest "
        "per-token variance of the vector entering the gate norm (eps = 1e-5), `norm out std` the "
        "std of what the norm hands on.", "",
        "| position | gate_init | val loss (mean +- CI; per seed) | g std | norm in min var | norm out std |",
        "|---|---|---|---:|---:|---:|"]
    for a in results:
        ci = "" if a["val_loss_ci95_half"] is None else f" +- {a['val_loss_ci95_half']:.4f}"
        seeds = ", ".join(f"{x:.4f}" for x in a["val_losses"])
        lines.append(f"| {a['position']} | {a['gate_init']} | {a['val_loss_mean']:.4f}{ci}; {seeds} "
                     f"| {a['gate_std']:.3g} | {a['norm_input_min_var']:.3g} | "
                     f"{a['norm_output_std']:.3g} |")
    write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
