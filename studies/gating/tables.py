"""The study's tables, in markdown, from its summary.json alone: the study writes them to
benchmarks/results/study/tables.md beside it, and docs/study.md quotes them, each after a
`<!-- study table: NAME -->` line (a test holds the quotes to the record):

    python -m studies.gating.tables        # rewrite docs/study.md's tables from the record
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "study"

LM_EVAL_NAMES = {"corpus_cloze/acc": "cloze acc", "corpus_cloze/acc_norm": "cloze acc_norm",
                 "corpus_perplexity/word_perplexity": "word ppl",
                 "corpus_perplexity/bits_per_byte": "bits/byte", "mqar_recall/acc": "MQAR task acc"}
LEGEND = ("Losses are nats per token on the whole held-out split. Differences are paired by seed "
          "(same initialization and data order), with their 95% Student-t interval; `*` marks an "
          "interval that excludes zero. An accuracy's interval is cut at 0 and 1, the ends of its "
          "range. `(n=1)`: one seed so far, no interval.")
PAIRED_LM_EVAL = ("corpus_cloze/acc", "corpus_perplexity/bits_per_byte", "mqar_recall/acc")


def _plan(summary: dict[str, Any]) -> dict[str, Any]:
    """The study's design as its summary records it: the arms (in order), the ablations, the
    baselines, the long-budget arms and the lm-eval metrics."""
    p = summary["protocol"]
    return {"arms": [a for a in p["arms"] if a in summary["arms"]],
            "ablations": [a for a in p["ablations"] if a in summary["arms"]],
            "baselines": p["baselines"], "long_arms": p["long_arms"],
            "lm_eval_metrics": p["lm_eval_metrics"]}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _table(header: list[str], rows: list[list[str]], right: int) -> str:
    """A markdown table; the columns from `right` on are right-aligned (numbers)."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, align, *rows])


def ci(entry: dict[str, Any] | None, digits: int = 4, signed: bool = False,
       fraction: bool = False) -> str:
    """`mean [low, high]` (with `*` where a paired interval excludes zero); `-` for nothing."""
    if not entry or entry.get("n", 0) == 0:
        return "-"
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    if entry["low"] is None:
        return f.format(entry["mean"]) + f" (n={entry['n']})"
    low, high = entry["low"], entry["high"]
    if fraction:
        low, high = max(low, 0.0), min(high, 1.0)
    star = " *" if entry.get("distinguishable_from_zero") else ""
    return f"{f.format(entry['mean'])} [{f.format(low)}, {f.format(high)}]{star}"


def _seeds(by_seed: dict[str, float], digits: int = 4) -> str:
    return " / ".join(f"{by_seed[s]:.{digits}f}" for s in sorted(by_seed, key=int)) or "-"


def _rate(lr: float | None) -> str:
    return "-" if lr is None else f"{lr:g}"  # None: the arm's grid is not settled yet


def _name(arm: str) -> str:
    return f"`{arm}`"


def lr_table(summary: dict[str, Any]) -> str:
    """Each arm's grid, seed 0; bold: the chosen rate."""
    arms, plan = summary["arms"], _plan(summary)
    rates = sorted({float(lr) for a in arms.values() for lr in a["lr_grid_val_loss"]})
    rows = []
    for arm in plan["arms"]:
        a = arms[arm]
        grid = {float(lr): loss for lr, loss in a["lr_grid_val_loss"].items()}
        cells = [("**{:.4f}**" if lr == a["lr"] else "{:.4f}").format(grid[lr]) if lr in grid
                 else "" for lr in rates]
        rows.append([_name(arm), *cells, _rate(a["lr"])])
    return _table(["arm", *(f"{lr:g}" for lr in rates), "chosen"], rows, 1)


def seeds_table(summary: dict[str, Any]) -> str:
    """Every arm at its rate, sorted by the mean loss, paired against the two baselines."""
    arms, plan = summary["arms"], _plan(summary)
    names = sorted((n for n in plan["arms"] if arms[n]["val_loss_by_seed"]),
                   key=lambda n: arms[n]["val_loss"]["mean"])
    rows = [[_name(n), _rate(arms[n]["lr"]), _seeds(arms[n]["val_loss_by_seed"]),
             ci(arms[n]["val_loss"]),
             *(ci(arms[n]["paired_differences"].get(b), signed=True) for b in plan["baselines"])]
            for n in names]
    return _table(["arm", "LR", "seed 0 / 1 / 2", "mean [95% CI]",
                   *(f"vs {_name(b)}" for b in plan["baselines"])], rows, 1)


def long_table(summary: dict[str, Any]) -> str:
    """The long runs (seed 0): their losses, the differences against the baselines' long runs,
    and, for comparison, the same seed's difference at the base budget."""
    arms, plan = summary["arms"], _plan(summary)
    long = {n: arms[n]["long"][0] for n in plan["long_arms"] if n in arms and arms[n]["long"]}
    if not long:
        return ""
    tokens = next(iter(long.values()))["tokens"]

    def diff(mine: float | None, theirs: float | None) -> str:
        return "-" if mine is None or theirs is None else f"{mine - theirs:+.4f}"

    base = {n: arms[n]["val_loss_by_seed"].get("0", arms[n]["val_loss_by_seed"].get(0))
            for n in long}
    baselines = plan["baselines"]
    rows = []
    for n in sorted(long, key=lambda n: long[n]["val_loss"]):
        rows.append([_name(n), _rate(arms[n]["lr"]), f"{long[n]['val_loss']:.4f}",
                     *(diff(long[n]["val_loss"], long[b]["val_loss"] if b in long else None)
                       if b != n else "-" for b in baselines),
                     diff(base[n], base.get(baselines[0])) if n != baselines[0] else "-"])
    return _table(["arm", "LR", f"val loss, {tokens / 1e6:.2f}M tokens",
                   *(f"vs {_name(b)}" for b in baselines),
                   f"vs {_name(baselines[0])} at the base budget (seed 0)"], rows, 1)


def ablations_table(summary: dict[str, Any]) -> str:
    """egmla_kv and its ablations, by d_e then layers per table, paired against egmla_kv and
    the first baseline."""
    arms, plan = summary["arms"], _plan(summary)
    names = [n for n in ("egmla_kv", *plan["ablations"]) if n in arms]
    if len(names) < 2:
        return ""
    names.sort(key=lambda n: (arms[n]["attention"].get("gate_group_size", 1), arms[n]["d_e"]))
    rows = [[_name(n), str(arms[n]["d_e"]), str(arms[n]["attention"].get("gate_group_size", 1)),
             f"{arms[n]['params']:,}", _seeds(arms[n]["val_loss_by_seed"]),
             ci(arms[n]["val_loss"]),
             *("-" if b == n else ci(arms[n]["paired_differences"].get(b), signed=True)
               for b in ("egmla_kv", plan["baselines"][0]))] for n in names]
    return _table(["arm", "d_e", "layers per table", "params (tables incl.)", "seed 0 / 1 / 2",
                   "mean [95% CI]", "vs `egmla_kv`", f"vs {_name(plan['baselines'][0])}"], rows, 1)


def mqar_table(summary: dict[str, Any]) -> str:
    """MQAR recall (the mean over the slices) by seed, over seeds, and paired; the MQAR
    model's KV bytes and parameters."""
    arms, plan = summary["arms"], _plan(summary)
    names = [n for n in plan["arms"] if arms[n]["mqar_mean_accuracy"]]
    if not names:
        return ""
    names.sort(key=lambda n: -arms[n]["mqar_mean_accuracy"]["mean"])
    rows = []
    for n in names:
        model = arms[n].get("mqar_model") or {}
        recall = {s: _mean(acc.values()) for s, acc in arms[n]["mqar_accuracy_by_seed"].items() if acc}
        rows.append([_name(n), f"{model.get('kv_bytes_per_token_bf16', '-')}",
                     f"{model['params']:,}" if "params" in model else "-", _seeds(recall, 3),
                     ci(arms[n]["mqar_mean_accuracy"], 3, fraction=True),
                     *("-" if b == n else ci(arms[n]["paired_differences_mqar"].get(b), 3,
                                             signed=True) for b in plan["baselines"])])
    return _table(["arm", "KV bytes/token", "params", "recall, seed 0 / 1 / 2", "mean [95% CI]",
                   *(f"vs {_name(b)}" for b in plan["baselines"])], rows, 1)


def _by_pairs(slices) -> list[str]:
    """MQAR slice names (kv4, kv8, kv16) in the order of their pairs, not of their spelling."""
    return sorted(slices, key=lambda k: (int(k[2:]) if k[2:].isdigit() else 0, k))


def _loss(value: float) -> str:
    """A validation loss to three decimals, or in scientific notation below 0.001 (4.6e-05, not
    0.000, for a run that all but memorized the task)."""
    return f"{value:.3f}" if value >= 1e-3 or value == 0 else f"{value:.1e}"


def mqar_fair_table(summary: dict[str, Any]) -> str:
    """The fair MQAR runs: each arm at its own rate from a grid on MQAR, recall by seed (the mean
    over the 4, 8 and 16-pair slices), its interval, how many seeds learned the lookup (recall
    past the record's `learned_recall`: the outcome is nearly two-valued), each slice's mean,
    the MQAR model's KV bytes, and the recall's paired differences against each baseline."""
    arms, plan = summary["arms"], _plan(summary)
    names = [n for n in plan["arms"] if arms[n].get("mqar_fair")]
    if not names:
        return ""
    rows = []
    for n in names:
        fair, model = arms[n]["mqar_fair"], arms[n].get("mqar_model") or {}
        slices = fair["by_slice"]
        rows.append([_name(n), " / ".join(f"{lr}: {_loss(loss)}" for lr, loss in sorted(
                         fair["lr_grid_val_loss"].items(), key=lambda kv: float(kv[0]))),
                     _rate(fair["lr"]),
                     _seeds({s: _mean(a.values()) for s, a in fair["accuracy_by_seed"].items()}, 3),
                     ci(fair["mean_accuracy"], 3, fraction=True),
                     f"{fair['learned_seeds']} of {len(fair['accuracy_by_seed'])}"
                     if fair["accuracy_by_seed"] else "-",
                     " / ".join(f"{slices[k]['mean']:.3f}" for k in _by_pairs(slices)) or "-",
                     str(model.get("kv_bytes_per_token_bf16", "-")),
                     *("-" if b == n else ci(fair.get("paired_differences", {}).get(b), 3,
                                             signed=True) for b in plan["baselines"])])
    return _table(["arm", "grid (LR: val loss, seed 0)", "LR", "recall by seed",
                   "mean [95% CI]", f"seeds past {arms[names[0]]['mqar_fair']['learned_recall']:g}",
                   "by slice (" + " / ".join(k.removeprefix("kv") for k in _by_pairs(
                       {k for n in names for k in arms[n]["mqar_fair"]["by_slice"]})) + " pairs)",
                   "KV bytes/token (bf16)",
                   *(f"vs {_name(b)}" for b in plan["baselines"])], rows, 2)


def _lm_digits(metric: str) -> int:
    return 1 if metric.endswith("word_perplexity") else 3 if metric.endswith("acc") or \
        metric.endswith("acc_norm") else 4


def lm_eval_table(summary: dict[str, Any]) -> str:
    """Each arm's lm-eval scores (mean and interval over its seeds), sorted as the seeds table."""
    arms, plan = summary["arms"], _plan(summary)
    names = [n for n in plan["arms"] if arms[n]["lm_eval"]]
    if not names:
        return ""
    names.sort(key=lambda n: arms[n]["val_loss"]["mean"])
    metrics = [m for m in plan["lm_eval_metrics"] if any(m in arms[n]["lm_eval"] for n in names)]
    rows = [[_name(n), str(max(e["n"] for e in arms[n]["lm_eval"].values())),
             *(ci(arms[n]["lm_eval"].get(m), _lm_digits(m), fraction=m.endswith(("acc", "acc_norm")))
               for m in metrics)] for n in names]
    return _table(["arm", "seeds", *(LM_EVAL_NAMES.get(m, m) for m in metrics)], rows, 1)


def lm_eval_paired_table(summary: dict[str, Any]) -> str:
    """The paired differences of the main lm-eval scores against the two baselines."""
    arms, plan = summary["arms"], _plan(summary)
    names = [n for n in plan["arms"] if arms[n]["lm_eval"]]
    if not names:
        return ""
    names.sort(key=lambda n: arms[n]["val_loss"]["mean"])
    header, rows = ["arm"], []
    for m in PAIRED_LM_EVAL:
        header += [f"{LM_EVAL_NAMES[m]} vs {_name(b)}" for b in plan["baselines"]]
    for n in names:
        pairs = arms[n]["paired_differences_lm_eval"]
        rows.append([_name(n), *("-" if b == n else ci(pairs.get(m, {}).get(b), _lm_digits(m),
                                                       signed=True)
                                 for m in PAIRED_LM_EVAL for b in plan["baselines"])])
    return _table(header, rows, 1)


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


MEASURE_NAMES = {"val_loss": "val loss", "mqar_recall": "MQAR recall"}


def comparisons_table(summary: dict[str, Any]) -> str:
    """The declared families of comparisons (validation loss; MQAR recall at each arm's MQAR
    rate; paired by seed): each difference with its interval, its paired t-test p and that p
    Holm-adjusted within its family."""
    rows = [[f"{c['family']} ({c['family_size']})", MEASURE_NAMES[c.get("measure", "val_loss")],
             _name(c["arm"]), _name(c["against"]), ci(c, signed=True, digits=3), _p(c["p"]),
             _p(c["p_holm"])]
            for c in summary.get("comparisons") or []]
    if not rows:
        return ""
    return _table(["family (size)", "measure", "arm", "against", "difference [95% CI]", "p",
                   "p, Holm"], rows, 4)


def remakes_table(summary: dict[str, Any], most: int = 3) -> str:
    """How far the runs trained again moved: the `most` that moved most, then the mean change
    over all of them (and the mean of its size)."""
    rows = summary.get("remakes") or []
    if not rows:
        return ""
    table = [[_name(r["run"]), f"{r['recorded_val_loss']:.4f}", f"{r['val_loss']:.4f}",
              f"{r['difference']:+.4f}"] for r in rows[:most]]
    table.append([f"all {len(rows)}: mean (mean size)", "", "",
                  f"{_mean(r['difference'] for r in rows):+.4f} "
                  f"({_mean(abs(r['difference']) for r in rows):.4f})"])
    return _table(["run trained again", "loss then", "loss now", "change"], table, 1)


SECTIONS = {  # name -> (heading, the table)
    "lr": ("Learning rate (seed 0; bold: the chosen rate)", lr_table),
    "seeds": ("Seeds (each arm at its rate)", seeds_table),
    "long": ("Longer budget (seed 0)", long_table),
    "ablations": ("Ablations of egmla_kv (egmla_kv's rate)", ablations_table),
    "mqar": ("MQAR recall (egmla_kv's rate; the MQAR model's KV bytes and parameters)",
             mqar_table),
    "mqar_fair": ("MQAR recall, each arm at its own rate (2,000 steps)", mqar_fair_table),
    "comparisons": ("Comparisons by family: paired p-values, raw and Holm-adjusted within the "
                    "family", comparisons_table),
    "lm_eval": ("lm-eval (each arm's seeds at its rate)", lm_eval_table),
    "lm_eval_paired": ("lm-eval, paired differences", lm_eval_paired_table),
    "remakes": ("Runs trained again: the largest changes of the loss (nats per token)",
                remakes_table),
}
MARKER = re.compile(r"^<!-- study table: (\w+) -->$")


def render(summary: dict[str, Any]) -> str:
    """Every table the summary has data for, under its heading."""
    parts = ["# The study's tables\n", "Written by `python -m studies.gating` from `summary.json`; "
             f"docs/study.md states the protocol and the reading. {LEGEND}\n"]
    for heading, table in SECTIONS.values():
        text = table(summary)
        if text:
            parts.append(f"## {heading}\n\n{text}\n")
    return "\n".join(parts)


def quote(document: str, summary: dict[str, Any]) -> str:
    """`document` with the table after each `<!-- study table: NAME -->` line replaced by the
    summary's (a table: the lines starting with `|` right after the marker)."""
    lines, out, i = document.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        match = MARKER.match(lines[i])
        i += 1
        if match:
            if match[1] not in SECTIONS:
                raise ValueError(f"unknown study table {match[1]!r}; tables: {', '.join(SECTIONS)}")
            out.extend(SECTIONS[match[1]][1](summary).split("\n"))
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m studies.gating.tables", description="Rewrite the study's tables quoted in "
        "a markdown file (after each `<!-- study table: NAME -->` line; names: "
        f"{', '.join(SECTIONS)}) from the record's summary.json.")
    parser.add_argument("documents", nargs="*", type=Path, default=[ROOT / "docs" / "study.md"],
                        help="the files to update (default: docs/study.md)")
    parser.add_argument("--summary", type=Path, default=RESULTS / "summary.json",
                        help="the record (default: benchmarks/results/study/summary.json)")
    args = parser.parse_args(argv)
    try:
        summary = json.loads(args.summary.read_text())
        for path in args.documents:
            text = path.read_text()
            quoted = quote(text, summary)
            if quoted != text:
                path.write_text(quoted)
                print(f"{path}: tables updated")
    except (OSError, ValueError, KeyError) as e:
        print(f"python -m studies.gating.tables: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
