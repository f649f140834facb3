"""The study's statistics and its record: per arm the losses by seed at its chosen rate with a
mean and 95% interval, the long runs, MQAR and lm-eval, and the paired differences (same seed,
hence the same data order) against each baseline; the declared families of comparisons with
raw and Holm-adjusted p-values; written, with one JSON per run and the tables, under
--results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from egmla import files
from eval.stats import holm, interval, paired, paired_p
from studies.gating.arms import arm_overrides, describe
from studies.gating.plan import choose_lrs, selection_loss
from studies.gating.protocol import (ABLATIONS, ARM, ARMS, BASE, BASE_STEPS, BASELINES, FAMILIES,
                                     LEARNED_RECALL, LM_EVAL_METRICS, LONG_ARMS, LONG_FACTOR,
                                     MQAR_FAIR_STEPS, MQAR_FAMILIES, MQAR_STEPS, Setup)


def summarize(records: list[dict[str, Any]], chosen: dict[str, float],
              setup: Setup = Setup(), chosen_mqar: dict[str, float] | None = None) -> dict[str, Any]:
    """Per arm: its configuration, the LR grid, the chosen LR, the losses by seed at that LR with
    mean and 95% interval, the long runs, MQAR, and the paired differences (same seed, hence the
    same data order) against each baseline arm."""
    arms: dict[str, Any] = {}
    chosen_mqar = chosen_mqar or {}
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
        mqar = recall_by_seed(arms[arm]["mqar_accuracy_by_seed"])
        arms[arm]["mqar_model"] = next(  # MQAR's model is another size: its own bytes, params
            ({"params": r["params"], "kv_bytes_per_token_bf16": r["kv_bytes_per_token_bf16"]}
             for r in rows if r["phase"].startswith("mqar") and r.get("params")), None)
        arms[arm]["mqar_mean_accuracy"] = interval(list(mqar.values())) if mqar else None
        arms[arm]["mqar_fair"] = mqar_fair(rows, chosen_mqar.get(arm))
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
            if entry["mqar_fair"] and other["mqar_fair"]:  # recall, each at its MQAR rate
                entry["mqar_fair"]["paired_differences"][base] = paired(
                    _fair_recall(entry), _fair_recall(other))
            if entry["mqar_accuracy_by_seed"] and other["mqar_accuracy_by_seed"]:
                entry["paired_differences_mqar"][base] = paired(
                    *(recall_by_seed(e["mqar_accuracy_by_seed"]) for e in (entry, other)))
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
                         "mqar_fair_steps": MQAR_FAIR_STEPS,
                         "recipe": BASE, "lr_grid": list(setup.lrs),
                         "lr_extensions": setup.lr_extensions,
                         "selection": "best final validation loss over the LR grid, first seed "
                         "(best over LR); a best at an edge grows the grid by a factor of 2 "
                         "past it, at most lr_extensions times"},
            "arms": arms, "comparisons": comparisons(arms), "remakes": remakes(records)}


def _val_loss(entry: dict[str, Any]) -> dict[int, float]:
    return entry["val_loss_by_seed"]


def _fair_recall(entry: dict[str, Any]) -> dict[int, float]:
    return recall_by_seed((entry.get("mqar_fair") or {}).get("accuracy_by_seed") or {})


MEASURES = {"val_loss": (FAMILIES, _val_loss), "mqar_recall": (MQAR_FAMILIES, _fair_recall)}


def comparisons(arms: dict[str, Any]) -> list[dict[str, Any]]:
    """Each declared family's comparisons, paired by seed: of the validation loss
    (protocol.FAMILIES) and of the fair MQAR runs' recall (protocol.MQAR_FAMILIES): the
    difference `arm - against` with its 95% interval, the paired t-test's p, and that p
    Holm-adjusted within the family (over the comparisons it has data for so far)."""
    out = []
    for measure, (families, by_seed) in MEASURES.items():
        for family, pairs in families.items():
            out += _family(family, measure, pairs, arms, by_seed)
    return out


def _family(family: str, measure: str, pairs, arms: dict[str, Any], by_seed) -> list[dict[str, Any]]:
    rows = []
    for arm, against in pairs:
        if arm not in arms or against not in arms:
            continue
        mine, theirs = by_seed(arms[arm]), by_seed(arms[against])
        common = sorted(set(mine) & set(theirs))
        if not common:
            continue
        diffs = [mine[s] - theirs[s] for s in common]
        rows.append({"family": family, "measure": measure, "arm": arm, "against": against,
                     **paired(mine, theirs), "p": paired_p(diffs)})
    tested = [r for r in rows if r["p"] is not None]
    for r, adjusted in zip(tested, holm([r["p"] for r in tested])):
        r["p_holm"] = adjusted
    return [{**r, "family_size": len(tested), "p_holm": r.get("p_holm")} for r in rows]


def mqar_fair(rows: list[dict[str, Any]], lr: float | None) -> dict[str, Any] | None:
    """An arm's fair MQAR runs (mqar_lr, mqar_seeds): its grid (validation loss, seed 0), its
    chosen rate, and at that rate the recall by seed (each slice and their mean), the mean's
    interval over the seeds and each slice's, how many seeds learned the lookup (recall past
    LEARNED_RECALL), and (summarize adds them) the recall's paired differences against each
    baseline; None before any such run."""
    grid = {f"{r['lr']:g}": selection_loss(r) for r in rows if r["phase"] == "mqar_lr"}
    if not grid:
        return None
    at_lr = {r["seed"]: r["mqar_accuracy"] for r in rows
             if r["phase"] in ("mqar_lr", "mqar_seeds") and r["lr"] == lr and r["mqar_accuracy"]}
    by_seed = dict(sorted(at_lr.items()))
    slices = sorted({k for acc in by_seed.values() for k in acc})
    means = [mqar_mean(a) for a in by_seed.values()]
    return {"lr_grid_val_loss": grid, "lr": lr, "lr_protocol": "best over LR on MQAR (seed 0)",
            "accuracy_by_seed": by_seed, "mean_accuracy": interval(means),
            "learned_seeds": sum(m > LEARNED_RECALL for m in means), "learned_recall": LEARNED_RECALL,
            "by_slice": {k: interval([a[k] for a in by_seed.values() if k in a]) for k in slices},
            "paired_differences": {}}  # against each baseline, filled by summarize


def remakes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs trained again (for an export on a machine without their run directory): the
    loss each had, the loss it has now, and the difference, largest first."""
    rows = [{"run": f"{r['phase']}-{r['run']}", "arm": r["arm"], "seed": r["seed"],
             "recorded_val_loss": r["remade"]["recorded_val_loss"], "val_loss": r["val_loss"],
             "difference": r["val_loss"] - r["remade"]["recorded_val_loss"]}
            for r in records if "remade" in r]
    return sorted(rows, key=lambda row: -abs(row["difference"]))


def recall_by_seed(accuracy_by_seed: dict[int, dict[str, float] | None]) -> dict[int, float]:
    """Each seed's recall (mqar_mean), for the seeds that have one."""
    return {seed: mqar_mean(acc) for seed, acc in accuracy_by_seed.items() if acc}


def mqar_mean(accuracy: dict[str, float]) -> float:
    """A MQAR run's recall accuracy, the mean over its validation slices (4, 8, 16 pairs)."""
    return sum(accuracy.values()) / len(accuracy)


def write_results(results: Path, records: list[dict[str, Any]], setup: Setup) -> None:
    from egmla.provenance import provenance
    from studies.gating.tables import render  # here: `python -m studies.gating.tables` runs it fresh

    results.mkdir(parents=True, exist_ok=True)
    (results / "runs").mkdir(exist_ok=True)
    for r in records:
        files.write_json(results / "runs" / f"{r['phase']}-{r['run']}.json", r)
    chosen, on_mqar = choose_lrs(records, setup), choose_lrs(records, setup, "mqar_lr")
    summary = {**summarize(records, chosen, setup, on_mqar), "chosen_lr": chosen,
               "chosen_lr_mqar": on_mqar, "provenance": provenance(), "runs": len(records)}
    files.write_json(results / "summary.json", summary)
    files.write_text(results / "tables.md", render(json.loads(json.dumps(summary))))  # as read back
