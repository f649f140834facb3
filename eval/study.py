"""What the gate buys: EG-MLA against MLA and MHA with the controls that separate gating, token
identity and extra parameters (issue 17; the protocol and the results are in docs/study.md).

    python -m eval.study --runs-dir runs/study                 # every phase, resumable
    python -m eval.study --runs-dir runs/study --phase lr      # one phase
    python -m eval.study --runs-dir runs/study --dry-run       # list the runs and what is done
    python -m eval.study --runs-dir runs/study --summarize     # only rebuild summary.json

Every run is a real `train.py` process on the quickstart recipe (the small model, the embedded
corpus, its BPE tokenizer, AdamW with warmup and cosine decay), or on MQAR for the `mqar` phase.
The phases, in the order they run:

  lr         each arm at every learning rate of the grid, seed 0; the best by final validation
             loss (the whole held-out split) is the arm's learning rate ("best over LR"); while
             the best is at an edge of the grid, the grid grows by a factor of 2 past that edge
             (at most --lr-extensions times), so a chosen rate is a minimum, not an edge
  seeds      each arm at its learning rate, the other seeds
  long       the five arms that decide the question, 4x the tokens, at their learning rates
  ablations  EG-MLA kv's d_e and gate_group_size, at egmla_kv's learning rate
  mqar       every arm on MQAR (the recall task), at egmla_kv's learning rate
  eval       the offline lm-eval tasks on the final checkpoints of the seeds phase

Re-running skips finished runs and resumes an interrupted one from its last checkpoint, so the
study can be stopped and continued. A run is finished when its run directory holds summary.json
or when the record under --results holds it (the record is committed; run directories are not),
so a study continues on a fresh clone or another machine. The eval phase needs a run's export:
a run known only from the record, and not yet scored there, is trained again for it (same seed
and data order), and the record keeps the loss it had before beside the new one. After every
run the record under --results (default benchmarks/results/study) is rewritten: one JSON per
run (its summary and configuration, not its checkpoints) and summary.json with every arm's
parameters, KV bytes, learning-rate grid, chosen learning rate, per-seed losses with their mean
and 95% interval, and the paired differences against mla_dc32 and mla_param_matched.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.compare import interval, lm_eval_metrics, paired, tokens_trained
from eval.study_tables import render

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "study"

BASE = ["experiment=quickstart"]
BASE_STEPS = 300  # 300 x 16 x 128 = 614,400 tokens, as benchmarks/train_variants.py
LONG_FACTOR = 4
MQAR_STEPS = 500
LRS = (1e-3, 2e-3, 4e-3)
LR_EXTENSIONS = 2  # a best LR at the grid's edge adds the next doubling (halving), at most twice
SEEDS = (0, 1, 2)
VAL_EVERY = 50  # periodic validations: the loss-against-tokens curve (Fig. 1a)
LM_EVAL_TASKS = ("corpus_cloze", "corpus_perplexity", "mqar_recall")
EVAL_BATCH_SIZE = 64  # continuations a forward: about 2x lm-eval's default of 1 here, same scores
LM_EVAL_METRICS = ("corpus_cloze/acc", "corpus_cloze/acc_norm", "corpus_perplexity/word_perplexity",
                   "corpus_perplexity/bits_per_byte", "mqar_recall/acc")  # summarized per arm


@dataclass(frozen=True)
class Arm:
    name: str
    attention: str  # the configs/model/attention file
    overrides: tuple[str, ...] = ()
    what: str = ""


ARMS = [
    Arm("mha", "small_mha", what="multi-head attention"),
    Arm("gqa2", "small_gqa2", what="grouped-query, 2 KV heads"),
    Arm("mla", "small_mla", what="MLA, d_c 128"),
    Arm("mla_dc32", "small_mla_dc32", what="MLA at EG-MLA's latent width (d_c 32)"),
    Arm("mla_param_matched", "small_mla_dc32",
        what="MLA d_c 32, FFN widened to EG-MLA kv's total parameters (tables included)"),
    Arm("egmla_kv", "small_egmla", what="EG-MLA, gate on the up-projected K/V"),
    Arm("egmla_latent", "small_egmla_latent", what="EG-MLA, gate on the latent"),
    Arm("egmla_const_gate", "small_egmla_const_gate",
        what="control: EG-MLA kv with one gate row for every token (no token identity)"),
    Arm("mla_value_embed", "small_mla_value_embed",
        what="control: MLA d_c 32 plus a token-id embedding added to V (identity, no gating)"),
    Arm("egmla_hidden_gate", "small_egmla_hidden_gate",
        what="control: the latent gated by sigmoid(W h) from the hidden state"),
]
ARM = {a.name: a for a in ARMS}
LONG_ARMS = ("mla_dc32", "mla_param_matched", "egmla_kv", "egmla_latent", "mla_value_embed")
BASELINES = ("mla_dc32", "mla_param_matched")  # the paired differences are taken against these
ABLATIONS = {
    **{f"egmla_kv_de{d}": ("small_egmla", (f"model.attention.d_e={d}",)) for d in (16, 32, 128)},
    **{f"egmla_kv_group{g}": ("small_egmla", (f"model.attention.gate_group_size={g}",))
       for g in (2, 4)},
}
PHASES = ("lr", "seeds", "long", "ablations", "mqar", "eval")


@dataclass(frozen=True)
class Setup:
    """What a study covers: the defaults are the protocol; narrower ones are for a rehearsal or
    a user's own question (`extra`: train.py overrides added to every run)."""

    arms: tuple[str, ...] = tuple(a.name for a in ARMS)
    lrs: tuple[float, ...] = LRS
    lr_extensions: int = LR_EXTENSIONS
    seeds: tuple[int, ...] = SEEDS
    scale: float = 1.0
    extra: tuple[str, ...] = ()

    def steps(self, base: int) -> int:
        return max(2, round(base * self.scale))


@dataclass(frozen=True)
class Run:
    phase: str
    arm: str
    attention: str
    lr: float
    seed: int
    steps: int
    overrides: tuple[str, ...] = field(default=())
    base: tuple[str, ...] = tuple(BASE)
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.arm}-lr{self.lr:g}-s{self.seed}-{self.steps}"

    def directory(self, runs_dir: Path) -> Path:
        return runs_dir / self.phase / self.name

    def command(self, runs_dir: Path) -> list[str]:
        return [sys.executable, str(ROOT / "train.py"), *self.base,
                f"model/attention={self.attention}", *self.overrides, *self.extra,
                f"optim.lr={self.lr}", f"seed={self.seed}", f"trainer.max_steps={self.steps}",
                f"trainer.val_every_n_steps={min(VAL_EVERY, self.steps)}",
                f"trainer.checkpoint_every_n_steps={min(VAL_EVERY, self.steps)}",
                "wandb.mode=disabled", "sample_prompt=null", f"name={self.name}",
                f"hydra.run.dir={self.directory(runs_dir)}"]


# ---- the arms' configurations ------------------------------------------------------------------


def model_of(attention: str, overrides: Iterable[str] = (), base: Iterable[str] = BASE):
    from egmla.config import ModelConfig

    return ModelConfig.from_dict(_composed_model(attention, tuple(overrides), tuple(base)))


@functools.lru_cache(maxsize=None)
def _composed_model(attention: str, overrides: tuple[str, ...], base: tuple[str, ...]) -> dict:
    """The model section Hydra composes for these overrides (composed once: the record is
    rewritten after every run and describes every arm)."""
    from egmla.training.compose import compose_config

    return compose_config([*base, f"model/attention={attention}", *overrides])["model"]


def param_matched_d_ff(base: Iterable[str] = BASE) -> int:
    """d_ff that gives MLA d_c 32 as many parameters as EG-MLA kv, lookup tables included."""
    target = model_of("small_egmla", base=base).num_params(include_gate_tables=True)
    mla = model_of("small_mla_dc32", base=base)
    per_unit = 3 * mla.d_model * mla.n_layers  # SwiGLU parameters per unit of d_ff
    return mla.d_ff + round((target - mla.num_params()) / per_unit)


def arm_overrides(arm: str, base: Iterable[str] = BASE) -> tuple[str, ...]:
    if arm == "mla_param_matched":
        return (f"model.d_ff={param_matched_d_ff(base)}",)
    return ARM[arm].overrides if arm in ARM else ABLATIONS[arm][1]


def describe(attention: str, overrides: Iterable[str], base: Iterable[str] = BASE) -> dict[str, Any]:
    import torch

    from egmla.models import cache_spec_for

    cfg = model_of(attention, overrides, base)
    spec = cache_spec_for(cfg)
    return {"attention": cfg.attention.to_dict(), "variant": cfg.attention.label(cfg),
            "d_e": getattr(cfg.attention, "d_e", None), "d_ff": cfg.d_ff,
            "params": cfg.num_params(include_gate_tables=True),
            "params_without_lookup_tables": cfg.num_params(include_gate_tables=False),
            "kv_bytes_per_token_bf16": spec.bytes_per_token(torch.bfloat16),
            "kv_elements_per_token": spec.elements_per_token()}


# ---- the plan ----------------------------------------------------------------------------------


def lr_grid(losses: dict[float, float], setup: Setup = Setup()) -> tuple[list[float], float | None]:
    """The learning rates one arm needs given its losses so far (lr -> final validation loss),
    and the best of them once the grid is settled (every point has run and the best is not at
    an edge that may still grow), else None. A loss that is not finite (a diverged run) counts
    as the worst."""
    grid = sorted(setup.lrs)
    low, high = grid[0] / 2 ** setup.lr_extensions, grid[-1] * 2 ** setup.lr_extensions

    def loss(lr: float) -> float:
        value = losses[lr]
        return value if value is not None and math.isfinite(value) else math.inf

    while all(lr in losses for lr in grid):
        best = min(grid, key=lambda lr: (loss(lr), lr))
        if best == grid[-1] and best * 2 <= high:
            grid.append(best * 2)
        elif best == grid[0] and len(grid) > 1 and best / 2 >= low:
            grid.insert(0, best / 2)
        else:
            return grid, best
    return grid, None


def _lr_losses(records: list[dict[str, Any]], arm: str) -> dict[float, float]:
    return {r["lr"]: selection_loss(r) for r in records if r["phase"] == "lr" and r["arm"] == arm}


def selection_loss(r: dict[str, Any]) -> float:
    """The loss a run had when its phase used it: for a run trained again for its export (on
    another machine its loss differs, by up to about 0.01 after 300 steps), the loss recorded
    before. So a remake does not reopen a learning rate chosen against runs not remade."""
    return r["remade"]["recorded_val_loss"] if "remade" in r else r["val_loss"]


def plan(phase: str, records: list[dict[str, Any]], setup: Setup = Setup()) -> list[Run]:
    """The runs of `phase` given the runs recorded so far: the LR grid grows from its results,
    and the phases after `lr` need the learning rates it chooses."""
    steps, arms, first = setup.steps(BASE_STEPS), setup.arms, setup.seeds[0]

    def run(phase, arm, lr, seed, steps, base=tuple(BASE)) -> Run:
        attention = ARM[arm].attention if arm in ARM else ABLATIONS[arm][0]
        return Run(phase, arm, attention, lr, seed, steps, arm_overrides(arm, base), base,
                   setup.extra)

    if phase == "lr":
        return [run("lr", arm, lr, first, steps) for arm in arms
                for lr in lr_grid(_lr_losses(records, arm), setup)[0]]
    chosen = choose_lrs(records, setup)
    need = list(arms) if phase in ("seeds", "long") else ["egmla_kv"]
    missing = [a for a in need if a not in chosen]
    if missing:
        raise StudyError(f"phase {phase!r} needs the learning rates the lr phase chooses; "
                         f"not yet chosen for: {', '.join(missing)}")
    if phase == "seeds":
        return [run("seeds", arm, chosen[arm], seed, steps)
                for seed in setup.seeds[1:] for arm in arms]
    if phase == "long":
        return [run("long", arm, chosen[arm], first, steps * LONG_FACTOR)
                for arm in LONG_ARMS if arm in arms]
    if phase == "ablations":
        return [run("ablations", name, chosen["egmla_kv"], seed, steps)
                for seed in setup.seeds for name in ABLATIONS]
    if phase == "mqar":
        return [run("mqar", arm, chosen["egmla_kv"], seed, setup.steps(MQAR_STEPS),
                    ("experiment=mqar_sweep",)) for seed in setup.seeds for arm in arms]
    raise StudyError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")


class StudyError(ValueError):
    """Bad input or a failed run; printed as one line, exit status 2."""


# ---- running -----------------------------------------------------------------------------------


def execute(run: Run, runs_dir: Path, log) -> dict[str, Any]:
    """Train (or resume) one run; return its record. A finished run is read, not re-run."""
    directory = run.directory(runs_dir)
    if not (directory / "summary.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        log(f"{run.phase:9s} {run.name} ...")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (directory.parent / f"{run.name}.log").open("w") as out:
            done = subprocess.run(run.command(runs_dir), stdout=out, stderr=subprocess.STDOUT,
                                  cwd=ROOT, env=env)
        if done.returncode != 0:
            raise StudyError(f"{run.name} failed (exit {done.returncode}); its log: "
                             f"{directory.parent / (run.name + '.log')}")
        log(f"{run.phase:9s} {run.name} done in {time.perf_counter() - started:.0f} s")
        # A finished run keeps its export and metrics; its checkpoints (weights and optimizer
        # state, 100+ MB a run) are only needed to resume, which a finished run never does.
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)
    return record(run, directory)


def record(run: Run, directory: Path) -> dict[str, Any]:
    summary = json.loads((directory / "summary.json").read_text())
    info = json.loads((directory / "run_info.json").read_text())
    curve = []
    metrics = directory / "metrics.csv"
    if metrics.is_file():
        with metrics.open() as f:
            for row in csv.DictReader(f):  # every periodic validation: loss, MQAR accuracy
                if row.get("val/loss"):
                    curve.append({"step": int(float(row["step"])), **{
                        k.removeprefix("val/"): float(v) for k, v in row.items()
                        if k.startswith("val/") and v not in ("", None)}})
    config = json.loads((directory / "config.json").read_text())
    return {"run": run.name, "phase": run.phase, "arm": run.arm, "lr": run.lr, "seed": run.seed,
            "steps": summary["global_step"],
            "tokens": tokens_trained(config, summary["global_step"]),
            "val_loss": summary["val_loss"],
            "unigram_val_loss": summary.get("unigram_val_loss"),
            "mqar_accuracy": summary.get("mqar_accuracy"), "fit_seconds": summary["fit_seconds"],
            "params": info["params"], "kv_bytes_per_token_bf16": info["kv_bytes_per_token_bf16"],
            "val_curve": curve, "lm_eval": lm_eval_scores(directory),
            "git": info["starts"][-1].get("git")}


def lm_eval_scores(directory: Path) -> dict[str, float]:
    return lm_eval_metrics(directory) if (directory / "eval").is_dir() else {}


def stored_records(results: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The runs recorded under RESULTS/runs, by (phase, run name): finished runs, whether or not
    their run directories are still here."""
    kept = {}
    for path in sorted((results / "runs").glob("*.json")):
        try:
            r = json.loads(path.read_text())
            kept[(r["phase"], r["run"])] = r
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StudyError(f"{path}: not a study run record ({type(e).__name__}: {e})") from None
    return kept


def remake(run: Run, runs_dir: Path, kept: dict[str, Any], log) -> dict[str, Any]:
    """Train again a run known only from the record (its export is needed): the same command,
    so the same seed and data order; the record keeps the loss it had before."""
    log(f"{run.phase:9s} {run.name}: only in the record; trained again for its export")
    return {**execute(run, runs_dir, log), **_before(kept, remade=True)}


def _before(kept: dict[str, Any] | None, remade: bool = False) -> dict[str, Any]:
    """`remade`: what the record held before the run was trained again (its loss and git SHA,
    and how it was recovered), for a run record built anew from its run directory. `remade`
    says the run was just trained again; otherwise only a record that says so (or that was
    recovered, so that its run directory can only be a remake's) carries it."""
    if not kept:
        return {}
    if "remade" in kept:
        return {"remade": kept["remade"]}
    if not (remade or "recovered" in kept):
        return {}
    return {"remade": {"recorded_val_loss": kept["val_loss"], "recorded_git": kept.get("git"),
                       **({"recovered": kept["recovered"]} if "recovered" in kept else {})}}


def score(run: Run, runs_dir: Path, log, limit: int | None = None) -> None:
    """The offline lm-eval tasks on a run's final export, into RUN/eval (skipped if there);
    `limit`: the first documents of each task only (a rehearsal)."""
    directory = run.directory(runs_dir)
    if (directory / "eval").is_dir() and lm_eval_scores(directory):
        return
    log(f"eval      {run.name} ...")
    cmd = [sys.executable, "-m", "eval.lm_eval", "--model", "egmla", "--model_args",
           f"pretrained={directory / 'export'}", "--tasks", ",".join(LM_EVAL_TASKS),
           "--include_path", str(ROOT / "eval" / "tasks"), "--output_path", str(directory / "eval"),
           "--batch_size", str(EVAL_BATCH_SIZE),
           *(["--limit", str(limit)] if limit else [])]
    with (directory.parent / f"{run.name}.eval.log").open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise StudyError(f"lm-eval on {run.name} failed (exit {done.returncode})")


# ---- statistics --------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], chosen: dict[str, float],
              setup: Setup = Setup()) -> dict[str, Any]:
    """Per arm: its configuration, the LR grid, the chosen LR, the losses by seed at that LR with
    mean and 95% interval, the long runs, MQAR, and the paired differences (same seed, hence the
    same data order) against each baseline arm."""
    arms: dict[str, Any] = {}
    for arm in [a.name for a in ARMS] + list(ABLATIONS):
        rows = [r for r in records if r["arm"] == arm]
        if not rows:
            continue
        grid = {f"{r['lr']:g}": selection_loss(r) for r in rows if r["phase"] == "lr"}
        lr = chosen.get(arm if arm in ARM else "egmla_kv")
        at_lr = {r["seed"]: r["val_loss"] for r in rows
                 if r["phase"] in ("lr", "seeds", "ablations") and r["lr"] == lr}
        seeds = dict(sorted(at_lr.items()))
        attention, overrides = ((ARM[arm].attention, arm_overrides(arm)) if arm in ARM
                                else ABLATIONS[arm])
        arms[arm] = {
            "what": ARM[arm].what if arm in ARM else "ablation of egmla_kv",
            **describe(attention, overrides),
            "lr_grid_val_loss": grid, "lr": lr, "lr_protocol": "best over LR (seed 0)",
            "val_loss_by_seed": seeds, "val_loss": interval(list(seeds.values())),
            "long": [{"seed": r["seed"], "tokens": r["tokens"], "val_loss": r["val_loss"]}
                     for r in rows if r["phase"] == "long"],
            "mqar_accuracy_by_seed": {r["seed"]: r["mqar_accuracy"] for r in rows
                                      if r["phase"] == "mqar"},
        }
        mqar = {seed: mqar_mean(acc) for seed, acc in arms[arm]["mqar_accuracy_by_seed"].items()
                if acc}
        arms[arm]["mqar_model"] = next(  # MQAR's model is another size: its own bytes, params
            ({"params": r["params"], "kv_bytes_per_token_bf16": r["kv_bytes_per_token_bf16"]}
             for r in rows if r["phase"] == "mqar" and r.get("params")), None)
        arms[arm]["mqar_mean_accuracy"] = interval(list(mqar.values())) if mqar else None
        scored = {r["seed"]: r["lm_eval"] for r in rows
                  if r["phase"] in ("lr", "seeds") and r["lr"] == lr and r.get("lm_eval")}
        arms[arm]["lm_eval_by_seed"] = dict(sorted(scored.items()))
        arms[arm]["lm_eval"] = {m: interval([v[m] for v in scored.values() if m in v])
                                for m in LM_EVAL_METRICS if any(m in v for v in scored.values())}
    for arm, entry in arms.items():  # against each baseline, paired by seed
        entry["paired_differences"] = {}
        entry["paired_differences_mqar"] = {}
        entry["paired_differences_lm_eval"] = {m: {} for m in entry["lm_eval"]}
        # an ablation is also paired with what it ablates
        for base in (*BASELINES, "egmla_kv") if arm in ABLATIONS else BASELINES:
            if base not in arms or base == arm:
                continue
            other = arms[base]
            entry["paired_differences"][base] = paired(entry["val_loss_by_seed"],
                                                       other["val_loss_by_seed"])
            if entry["mqar_accuracy_by_seed"] and other["mqar_accuracy_by_seed"]:
                entry["paired_differences_mqar"][base] = paired(
                    *({s: mqar_mean(a) for s, a in e["mqar_accuracy_by_seed"].items() if a}
                      for e in (entry, other)))
            for m in entry["lm_eval"]:
                if m in other["lm_eval"]:
                    entry["paired_differences_lm_eval"][m][base] = paired(
                        *({s: v[m] for s, v in e["lm_eval_by_seed"].items() if m in v}
                          for e in (entry, other)))
    return {"protocol": {"arms": [a.name for a in ARMS], "ablations": list(ABLATIONS),
                         "baselines": list(BASELINES), "long_arms": list(LONG_ARMS),
                         "lm_eval_metrics": list(LM_EVAL_METRICS),
                         "base_steps": BASE_STEPS, "tokens_per_step": 16 * 128,
                         "long_factor": LONG_FACTOR, "mqar_steps": MQAR_STEPS,
                         "recipe": BASE, "lr_grid": list(setup.lrs),
                         "lr_extensions": setup.lr_extensions,
                         "selection": "best final validation loss over the LR grid, first seed "
                         "(best over LR); a best at an edge grows the grid by a factor of 2 "
                         "past it, at most lr_extensions times"},
            "arms": arms, "remakes": remakes(records)}


def remakes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs trained again (for an export on a machine without their run directory): the
    loss each had, the loss it has now, and the difference, largest first."""
    rows = [{"run": f"{r['phase']}-{r['run']}", "arm": r["arm"], "seed": r["seed"],
             "recorded_val_loss": r["remade"]["recorded_val_loss"], "val_loss": r["val_loss"],
             "difference": r["val_loss"] - r["remade"]["recorded_val_loss"]}
            for r in records if "remade" in r]
    return sorted(rows, key=lambda row: -abs(row["difference"]))


def mqar_mean(accuracy: dict[str, float]) -> float:
    """A MQAR run's recall accuracy, the mean over its validation slices (4, 8, 16 pairs)."""
    return sum(accuracy.values()) / len(accuracy)


def choose_lrs(records: list[dict[str, Any]], setup: Setup = Setup()) -> dict[str, float]:
    """Each arm's best learning rate on the first seed, once its grid is settled."""
    best = {arm: lr_grid(_lr_losses(records, arm), setup)[1] for arm in ARM}
    return {arm: lr for arm, lr in best.items() if lr is not None}


def write_results(results: Path, records: list[dict[str, Any]], setup: Setup) -> None:
    from egmla.provenance import provenance

    results.mkdir(parents=True, exist_ok=True)
    (results / "runs").mkdir(exist_ok=True)
    for r in records:
        _write_atomic(results / "runs" / f"{r['phase']}-{r['run']}.json", r)
    chosen = choose_lrs(records, setup)
    summary = {**summarize(records, chosen, setup), "chosen_lr": chosen, "provenance": provenance(),
               "runs": len(records)}
    _write_atomic(results / "summary.json", summary)
    _write_bytes_atomic(results / "tables.md",
                        render(json.loads(json.dumps(summary))).encode())  # as read back


MQAR_METRIC = "MQAR recall (mean over 4, 8, 16 pairs)"
FIGURES = {  # file -> (phases whose runs it shows, x axis, metric)
    "fig_loss_vs_tokens.png": (("long",), "tokens", "val_loss"),  # the paper's Fig. 1a
    "fig_loss_vs_de.png": (("ablations", "lr", "seeds"), "d_e", "val_loss"),  # Fig. 1b
    "fig_loss_vs_kv_bytes.png": (("lr", "seeds"), "kv_bytes", "val_loss"),  # Fig. 1c
    "fig_accuracy_vs_kv_bytes.png": (("lr", "seeds"), "kv_bytes", "corpus_cloze/acc"),  # Fig. 1c
    "fig_mqar_vs_kv_bytes.png": (("mqar",), "kv_bytes", MQAR_METRIC),
}


def at_chosen_lr(r: dict[str, Any], chosen: dict[str, float]) -> bool:
    """Whether a run is at the rate its phase uses: its arm's chosen rate, or egmla_kv's for the
    ablations and MQAR."""
    own = r["arm"] in ARM and r["phase"] not in ("ablations", "mqar")
    return r["lr"] == chosen.get(r["arm"] if own else "egmla_kv")


def write_figures(results: Path, chosen: dict[str, float],
                  records: list[dict[str, Any]]) -> list[str]:
    """The study's figures (the paper's Fig. 1 a-c, and recall on MQAR) from the runs recorded
    so far, each over the runs at their phase's learning rate; a figure with no runs (or no
    value of its metric) yet is skipped. Drawn from the records alone, so a fresh clone redraws
    them without the run directories."""
    from eval.compare import CompareError, plot, png_bytes

    written = []
    for name, (phases, x, metric) in FIGURES.items():
        rows = [row for row in figure_rows(
            [r for r in records if r["phase"] in phases and at_chosen_lr(r, chosen)
             and (x != "d_e" or r["arm"] == "egmla_kv" or r["arm"].startswith("egmla_kv_de"))],
            metric) if row["metric_value"] is not None]
        if not rows:
            continue
        try:
            figure = plot(rows, x)
        except CompareError:
            continue
        _write_bytes_atomic(results / name, png_bytes(figure))
        written.append(name)
    return written


def metric_value(r: dict[str, Any], metric: str) -> float | None:
    """A record's value of a figure's metric: the final validation loss, an lm-eval score, or
    the MQAR recall accuracy; None where the run has none."""
    if metric == "val_loss":
        return r["val_loss"]
    if metric == MQAR_METRIC:
        return mqar_mean(r["mqar_accuracy"]) if r.get("mqar_accuracy") else None
    return (r.get("lm_eval") or {}).get(metric)


def figure_rows(records: list[dict[str, Any]], metric: str = "val_loss") -> list[dict[str, Any]]:
    """eval.compare's rows for study records: grouped by arm (its seeds), `metric` as the
    metric, the arm's sizes from its configuration, the periodic validations as the curve."""
    rows = []
    for r in records:
        attention, overrides = ((ARM[r["arm"]].attention, arm_overrides(r["arm"]))
                                if r["arm"] in ARM else ABLATIONS[r["arm"]])
        arm = describe(attention, overrides)  # at the study's size; a run's own sizes first
        rows.append({"run": r["run"], "group": r["arm"], "variant": arm["variant"],
                     "seed": r["seed"], "params": r.get("params") or arm["params"],
                     "kv_dtype": "bf16", "d_e": arm["d_e"], "kv_bytes_per_token":
                         r.get("kv_bytes_per_token_bf16") or arm["kv_bytes_per_token_bf16"],
                     "steps": r["steps"], "tokens": r["tokens"], "metric": metric,
                     "metric_value": metric_value(r, metric), "curve": {
                         "val/" + k: {p["step"]: p[k] for p in r["val_curve"] if k in p}
                         for k in {k for p in r["val_curve"] for k in p if k != "step"}}})
    return rows


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_atomic(path: Path, data: Any) -> None:
    _write_bytes_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


# ---- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "study",
                        help="where the runs (and their checkpoints) go (default: runs/study)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where the record goes (default: benchmarks/results/study)")
    parser.add_argument("--phase", choices=[*PHASES, "all"], default="all")
    parser.add_argument("--arms", nargs="+", choices=list(ARM), default=[a.name for a in ARMS],
                        metavar="ARM", help=f"the arms (default: all: {', '.join(ARM)})")
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LRS), metavar="LR",
                        help=f"the learning-rate grid (default: {' '.join(map(str, LRS))})")
    parser.add_argument("--lr-extensions", type=int, default=LR_EXTENSIONS, metavar="N",
                        help="how many times a best learning rate at the grid's edge may double "
                             f"(or halve) the grid past it (default: {LR_EXTENSIONS}; 0: the "
                             "grid as given)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), metavar="SEED",
                        help="the seeds; the first is the LR grid's (default: 0 1 2)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every run's steps (a quick rehearsal: --scale 0.02)")
    parser.add_argument("--extra", nargs="+", default=[], metavar="OVERRIDE",
                        help="train.py overrides added to every run (a rehearsal: "
                             "trainer.final_val_batches=2); they change what the study measures")
    parser.add_argument("--eval-limit", type=int, metavar="N",
                        help="score only the first N documents of each lm-eval task (a "
                             "rehearsal; it changes what the study measures)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the runs: done (its run directory), kept (only in the "
                             "record under --results) or todo")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the record")
    args = parser.parse_args(argv)
    if not args.scale > 0:
        parser.error(f"--scale {args.scale}: must be > 0")
    if any(not lr > 0 for lr in args.lrs):
        parser.error(f"--lrs {' '.join(map(str, args.lrs))}: learning rates must be > 0")
    if args.lr_extensions < 0:
        parser.error(f"--lr-extensions {args.lr_extensions}: must be >= 0")
    if args.eval_limit is not None and args.eval_limit < 1:
        parser.error(f"--eval-limit {args.eval_limit}: must be >= 1")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: repeated seed")
    args.setup = Setup(tuple(dict.fromkeys(args.arms)), tuple(dict.fromkeys(args.lrs)),
                       args.lr_extensions, tuple(args.seeds), args.scale, tuple(args.extra))
    log = lambda message: print(time.strftime("%H:%M:%S"), message, flush=True)  # noqa: E731
    try:
        return _run(args, log)
    except StudyError as error:
        print(f"python -m eval.study: error: {error}", file=sys.stderr)
        return 2


def _run(args, log) -> int:
    setup = args.setup
    selected = PHASES if args.phase == "all" else (args.phase,)
    train_here = not (args.dry_run or args.summarize)
    stored = stored_records(args.results)
    records: dict[Path, dict[str, Any]] = {}
    for phase in PHASES[:-1]:  # the training phases, in order: each may need the one before
        seen: set[Path] = set()
        while True:  # a phase's plan may grow from its own results (the LR grid does)
            try:
                runs = plan(phase, list(records.values()), setup)
            except StudyError:
                if phase in selected and train_here:
                    raise
                if args.dry_run:
                    print(f"wait  {phase:9s} (needs the learning rates of the lr phase)")
                break
            new = [r for r in runs if r.directory(args.runs_dir) not in seen]
            if not new:
                break
            for run in new:
                directory = run.directory(args.runs_dir)
                seen.add(directory)
                finished = (directory / "summary.json").is_file()
                kept = stored.get((run.phase, run.name))
                if args.dry_run:
                    state = "done" if finished else "kept" if kept else "todo"
                    print(f"{state:4s}  {phase:9s} {run.name}")
                if finished:  # what the record knew before a remake stays in it
                    records[directory] = {**record(run, directory), **_before(kept)}
                elif kept:
                    records[directory] = kept
                elif phase in selected and train_here:
                    records[directory] = execute(run, args.runs_dir, log)
                    write_results(args.results, list(records.values()), setup)
    if args.dry_run:
        return 0
    if "eval" in selected and not args.summarize:
        for run in eval_runs(list(records.values()), setup):
            directory = run.directory(args.runs_dir)
            if directory not in records:  # its phase has not run yet
                continue
            if not (directory / "summary.json").is_file():  # known from the record alone
                if records[directory].get("lm_eval"):  # and scored: nothing to do
                    continue
                records[directory] = remake(run, args.runs_dir, records[directory], log)
                write_results(args.results, list(records.values()), setup)
            score(run, args.runs_dir, log, args.eval_limit)
            records[directory] = {**record(run, directory), **_before(records[directory])}
            write_results(args.results, list(records.values()), setup)  # each score as it comes
    chosen = choose_lrs(list(records.values()), setup)
    write_results(args.results, list(records.values()), setup)
    figures = write_figures(args.results, chosen, list(records.values()))
    log(f"{len(records)} runs recorded in {args.results}"
        + (f"; figures: {', '.join(figures)}" if figures else ""))
    return 0


def eval_runs(records: list[dict[str, Any]], setup: Setup) -> list[Run]:
    """The runs lm-eval scores: every arm's seeds at its chosen learning rate."""
    chosen = choose_lrs(records, setup)
    if any(arm not in chosen for arm in setup.arms):
        return []
    at_lr = [r for r in plan("lr", records, setup) if r.lr == chosen[r.arm]]
    return at_lr + plan("seeds", records, setup)


if __name__ == "__main__":
    sys.exit(main())
