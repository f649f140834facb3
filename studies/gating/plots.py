"""The study's figures (the paper's Fig. 1 a-c, and recall on MQAR), drawn by eval.compare's
plot from the records alone, so a fresh clone redraws them without the run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from egmla import files
from studies.gating.arms import arm_overrides, describe
from studies.gating.protocol import ABLATIONS, ARM
from studies.gating.summary import mqar_mean


MQAR_METRIC = "MQAR recall (mean over 4, 8, 16 pairs)"
FIGURES = {  # file -> (phases whose runs it shows, x axis, metric)
    "fig_loss_vs_tokens.png": (("long",), "tokens", "val_loss"),  # the paper's Fig. 1a
    "fig_loss_vs_de.png": (("ablations", "lr", "seeds"), "d_e", "val_loss"),  # Fig. 1b
    "fig_loss_vs_kv_bytes.png": (("lr", "seeds"), "kv_bytes", "val_loss"),  # Fig. 1c
    "fig_accuracy_vs_kv_bytes.png": (("lr", "seeds"), "kv_bytes", "corpus_cloze/acc"),  # Fig. 1c
    "fig_mqar_vs_kv_bytes.png": (("mqar",), "kv_bytes", MQAR_METRIC),  # egmla_kv's rate
    "fig_mqar_fair_vs_kv_bytes.png": (("mqar_lr", "mqar_seeds"), "kv_bytes", MQAR_METRIC),
}


def at_chosen_lr(r: dict[str, Any], chosen: dict[str, float],
                 on_mqar: dict[str, float] | None = None) -> bool:
    """Whether a run is at the rate its phase uses: its arm's chosen rate, egmla_kv's for the
    ablations and the first MQAR phase, and the arm's MQAR rate (`on_mqar`) for the fair ones."""
    if r["phase"] in ("mqar_lr", "mqar_seeds"):
        return r["lr"] == (on_mqar or {}).get(r["arm"])
    own = r["arm"] in ARM and r["phase"] not in ("ablations", "mqar")
    return r["lr"] == chosen.get(r["arm"] if own else "egmla_kv")


def write_figures(results: Path, chosen: dict[str, float], records: list[dict[str, Any]],
                  on_mqar: dict[str, float] | None = None) -> list[str]:
    """The study's figures (the paper's Fig. 1 a-c, and recall on MQAR) from the runs recorded
    so far, each over the runs at their phase's learning rate (`on_mqar`: the rates the fair
    MQAR grid chose); a figure with no runs (or no value of its metric) yet is skipped. Drawn
    from the records alone, so a fresh clone redraws them without the run directories."""
    from eval.compare import CompareError, plot, png_bytes  # matplotlib: only when drawing

    written = []
    for name, (phases, x, metric) in FIGURES.items():
        rows = [row for row in figure_rows(
            [r for r in records if r["phase"] in phases and at_chosen_lr(r, chosen, on_mqar)
             and (x != "d_e" or r["arm"] == "egmla_kv" or r["arm"].startswith("egmla_kv_de"))],
            metric) if row["metric_value"] is not None]
        if not rows:
            continue
        try:
            figure = plot(rows, x)
        except CompareError:
            continue
        files.write_bytes(results / name, png_bytes(figure))
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
