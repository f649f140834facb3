"""The upcycling record summarized (studies.upcycling's last phase): the recovery curve of every
arm, EG-MLA against MLA paired by seed at the smallest cache, attention transfer against KL
alone, the gate rows trained, and two plots (quality against KV bytes per token; quality
against recovery tokens). Reads <results>/runs/*.json, step0.json, context.json,
lm_eval.json; writes summary.json, summary.md, quality_vs_kv.png, recovery_curve.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from egmla import files
from eval.compare import png_bytes
from eval.stats import holm, interval, log_interval, paired, paired_p
from studies.pipeline import read_record

# The headline family: EG-MLA (each gate position) against MLA at the same cache size,
# recovered the same way; Holm-adjusted over these two.
FAMILY = (("egmla-kv-dc24", "mla-dc24"), ("egmla-latent-dc24", "mla-dc24"))
METRICS = (("corpus", "kl"), ("recovery", "kl"), ("corpus", "loss"), ("recovery", "loss"))


def _runs(results: Path) -> list[dict[str, Any]]:
    return [read_record(p) for p in sorted((results / "runs").glob("*.json"))]


def _final(run: dict[str, Any]) -> dict[str, Any] | None:
    pts = run["points"]
    return pts[max(pts, key=int)] if pts else None


def by_family(runs: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["family"], {})[r["arm"]["seed"]] = r
    return out


def comparisons(families: dict[str, dict[int, dict[str, Any]]], step: str) -> list[dict]:
    rows = []
    for arm, base in FAMILY:
        if arm not in families or base not in families:
            continue
        for domain, metric in METRICS:
            def value(r):
                p = r["points"].get(step)
                return None if p is None else p[domain][metric]
            mine = {s: v for s, r in families[arm].items() if (v := value(r)) is not None}
            theirs = {s: v for s, r in families[base].items() if (v := value(r)) is not None}
            mixed = sorted(s for s in set(mine) & set(theirs)  # a pair in one recipe only
                           if precisions([families[arm][s]]) != precisions([families[base][s]]))
            for s in mixed:
                del mine[s], theirs[s]
            seeds = sorted(set(mine) & set(theirs))
            diff = paired(mine, theirs)
            rows.append({"arm": arm, "against": base, "domain": domain, "metric": metric,
                         "seeds": seeds, "left_out_mixed_precision": mixed, **diff,
                         "p": paired_p([mine[s] - theirs[s] for s in seeds])})
    for domain, metric in METRICS:  # Holm over the family, per metric
        group = [r for r in rows if (r["domain"], r["metric"]) == (domain, metric)
                 and r["p"] is not None]
        for r, adj in zip(group, holm([r["p"] for r in group])):
            r["p_holm"] = adj
    return rows


def precisions(runs) -> list[str]:
    """The precisions the runs trained in, over every start (the machine decides under
    `trainer.precision: auto`; "unrecorded" for a start without the field)."""
    return sorted({start.get("precision") or "unrecorded" for r in runs
                   for start in r.get("starts", [])})


def arm_table(families: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for family, seeds in sorted(families.items()):
        steps = sorted({int(s) for r in seeds.values() for s in r["points"]})
        for step in steps:
            pts = [r["points"][str(step)] for r in seeds.values() if str(step) in r["points"]]
            row = {"arm": family, "step": step, "tokens": pts[0]["tokens"], "seeds": len(pts),
                   "kv_elements_per_token": pts[0]["kv_elements_per_token"],
                   "kv_bytes_per_token_bf16": pts[0]["kv_bytes_per_token_bf16"],
                   "params": pts[0]["params"],
                   "params_without_lookup_tables": pts[0]["params_without_lookup_tables"],
                   "precision": precisions(seeds.values())}
            for domain, metric in METRICS:
                row[f"{domain}_{metric}"] = interval([p[domain][metric] for p in pts])
            for domain in ("corpus", "recovery"):  # perplexity: geometric mean, log-scale interval
                row[f"{domain}_ppl"] = log_interval([p[domain]["ppl"] for p in pts])
            rows.append(row)
    return rows


def training_seconds(run: dict[str, Any]) -> float | None:
    """A run's training time over all its starts: recorded as such since the training clock
    (egmla.training.callbacks.FitClock); before it, a run's `fit_seconds` was its last start's,
    the whole only for a run trained in one start; None where it is not known."""
    if run.get("fit_seconds_all_starts") is not None:
        return run["fit_seconds_all_starts"]
    return run.get("fit_seconds") if len(run.get("starts", [])) == 1 else None


def transfer_comparison(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The MLA d_c 24 seed-0 run with a layer-wise attention-transfer stage first, beside the
    one with KL alone: final KL and the wall time each took (compute, on one machine)."""
    out = {}
    for r in runs:
        if r["family"].startswith("mla-dc24") and r["arm"]["seed"] == 0:
            final = _final(r)
            label = ("transfer, then KL" if r["arm"].get("transfer_steps") else "KL alone")
            out[f"{label} ({r['name']})"] = {"fit_seconds": training_seconds(r),
                                             "starts": len(r.get("starts", [])),
                                             "corpus_kl": final["corpus"]["kl"],
                                             "recovery_kl": final["recovery"]["kl"]}
    return out if len(out) == 2 else {}


def _fmt(ci: dict[str, Any], digits: int = 3) -> str:
    if ci["low"] is None:
        return f"{ci['mean']:.{digits}f}"
    return f"{ci['mean']:.{digits}f} [{ci['low']:.{digits}f}, {ci['high']:.{digits}f}]"


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# Upcycling SmolLM2-135M-Instruct: recovery by distillation", "",
             "Held-out perplexity and KL(original || model) in nats per token, on the recovery "
             "domain (unseen documents of the mixture recovered on) and the embedded corpus "
             "(a domain the recovery never sees). Mean [95% interval] over seeds where there "
             "are several (for perplexity, the geometric mean and the interval of the mean "
             "loss, exponentiated). KV: cached elements per token (30 layers). Precision: what the "
             "arm's runs trained in (`trainer.precision: auto` takes bf16 autocast where the "
             "machine has native bf16, else fp32).", "",
             "| arm | tokens | seeds | KV elem. | KL corpus | KL recovery | ppl corpus "
             "| ppl recovery | precision |", "|---|---:|---:|---:|---|---|---|---|---|"]
    for r in summary["arms"]:
        lines.append(f"| {r['arm']} | {r['tokens']:,} | {r['seeds']} | "
                     f"{r['kv_elements_per_token']:,} | {_fmt(r['corpus_kl'])} | "
                     f"{_fmt(r['recovery_kl'])} | {_fmt(r['corpus_ppl'], 1)} | "
                     f"{_fmt(r['recovery_ppl'], 1)} | {', '.join(r['precision'])} |")
    lines += ["", "## EG-MLA against MLA at the smallest cache, paired by seed", "",
              "Differences (arm minus MLA) at the final budget; Holm-adjusted over the two "
              "gate positions per metric. A seed pairs only where both runs trained in one "
              "precision.", "",
              "| arm | metric | seeds | difference [95%] | p | p (Holm) |",
              "|---|---|---:|---|---:|---:|"]
    for c in summary["comparisons"]:
        ci = {"mean": c["mean"], "low": c["low"], "high": c["high"]}
        p = "" if c["p"] is None else f"{c['p']:.3f}"
        ph = "" if c.get("p_holm") is None else f"{c['p_holm']:.3f}"
        seeds = str(len(c["seeds"])) + "".join(  # a pair in two precisions is not a pair
            f" (seed {s} left out: trained in two precisions)"
            for s in c.get("left_out_mixed_precision", []))
        difference = _fmt(ci, 4) if c["seeds"] else "-"
        lines.append(f"| {c['arm']} | {c['domain']} {c['metric']} | {seeds} | "
                     f"{difference} | {p} | {ph} |")
    transfer = summary.get("transfer")
    if transfer:
        lines += ["", "## Attention transfer first, against KL alone (mla-dc24, seed 0)", "",
                  "Both at the same steps and tokens (the transfer steps count in them). Fit "
                  "seconds: the training time over all starts (each earlier start up to its "
                  "last checkpoint; `-` where unknown), comparable where the starts ran on "
                  "one kind of machine (`starts` in each record).", "",
                  "| recipe | fit seconds | starts | KL corpus | KL recovery |",
                  "|---|---:|---:|---:|---:|"]
        for name, t in transfer.items():
            seconds = "-" if t["fit_seconds"] is None else t["fit_seconds"]
            lines.append(f"| {name} | {seconds} | {t['starts']} | {t['corpus_kl']:.3f} | "
                         f"{t['recovery_kl']:.3f} |")
    lines += _depth_tables(summary)
    if summary.get("gate_rows"):
        lines += ["", "## Gate table rows trained", ""]
        for arm, rows in summary["gate_rows"].items():
            low, high = rows["rows_changed_per_table_min_max"]
            changed = f"{low:,}" if low == high else f"{low:,} to {high:,}"
            lines.append(f"- {arm}: {changed} of {rows['rows_per_table']:,} rows changed in each "
                         f"of its {rows['tables']} tables")
    return "\n".join(lines) + "\n"


def _run_label(key: str, precision: dict[str, list[str]]) -> str:
    """`name@step` as a table's first cells: the run, its tokens' step, what it trained in."""
    name, _, step = key.partition("@")
    return f"{name} | {step} | {', '.join(precision.get(name, ['-']))}"


def _depth_tables(summary: dict[str, Any]) -> list[str]:
    """The measures taken of one run per arm (the original and step 0 besides): perplexity by
    position on long windows of the embedded corpus, and the offline lm-eval tasks."""
    lines: list[str] = []
    precision = summary.get("run_precision", {})
    curves = (summary.get("context") or {}).get("curves") or {}
    if curves:
        buckets = max(curves.values(), key=len)
        lines += ["", "## Perplexity by position (embedded corpus, long windows)", "",
                  "Perplexity of the tokens at each range of positions, one run per arm "
                  "(`original` is the model converted from; step 0 is the conversion alone).", "",
                  "| run | step | precision | " + " | ".join(
                      f"{b['from']:,}-{b['to']:,}" for b in buckets) + " |",
                  "|---|---:|---|" + "---:|" * len(buckets)]
        for key, curve in sorted(curves.items()):
            ppl = [f"{b['ppl']:.1f}" for b in curve] + ["-"] * (len(buckets) - len(curve))
            lines.append(f"| {_run_label(key, precision)} | {' | '.join(ppl)} |")
    record = summary.get("lm_eval") or {}
    scores = record.get("scores") or {}
    if scores:
        names = sorted({m for v in scores.values() for m in v if not m.endswith("_stderr")})
        limit = record.get("limit")
        lines += ["", "## Offline lm-eval tasks", "",
                  "Each metric with its standard error (lm-eval's)"
                  + (f"; the first {limit} documents of each task only (a rehearsal)"
                     if limit else "") + ".", "",
                  "| run | step | precision | " + " | ".join(names) + " |",
                  "|---|---:|---|" + "---:|" * len(names)]
        for key, metrics in sorted(scores.items()):
            cells = []
            for m in names:
                task, _, metric = m.partition("/")
                err = metrics.get(f"{task}/{metric}_stderr")
                value = metrics.get(m)
                cells.append("-" if value is None else f"{value:.3f}"
                             + ("" if err is None else f" ± {err:.3f}"))
            lines.append(f"| {_run_label(key, precision)} | {' | '.join(cells)} |")
    return lines


KL_LABEL = "KL to the original, nats/token (embedded corpus)"


def _png(draw, xlabel: str, title: str) -> bytes:
    """A 7 x 4.5 in figure drawn by draw(ax), labelled, with a legend, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(KL_LABEL)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    data = png_bytes(fig)
    plt.close(fig)
    return data


def plots(summary: dict[str, Any]) -> dict[str, bytes]:
    finals = {}
    for r in summary["arms"]:
        if r["arm"] not in finals or r["step"] > finals[r["arm"]]["step"]:
            finals[r["arm"]] = r

    def yerr(ci: dict[str, Any]) -> list[list[float]] | None:  # 95% interval over seeds
        return None if ci["low"] is None else [[ci["mean"] - ci["low"]], [ci["high"] - ci["mean"]]]

    def quality_vs_kv(ax) -> None:
        for arm, r in sorted(finals.items()):
            ax.errorbar(r["kv_bytes_per_token_bf16"] / 1024, r["corpus_kl"]["mean"],
                        yerr=yerr(r["corpus_kl"]), fmt="o", capsize=3,
                        label=f"{arm} ({r['seeds']} seed{'s' * (r['seeds'] > 1)})")

    def recovery_curve(ax) -> None:
        for arm in sorted(finals):
            rows = sorted((r for r in summary["arms"] if r["arm"] == arm), key=lambda r: r["step"])
            line = ax.plot([max(r["tokens"], 1e4) for r in rows],
                           [r["corpus_kl"]["mean"] for r in rows], marker="o", label=arm)[0]
            for r in rows:  # the points with several seeds: their interval
                if (err := yerr(r["corpus_kl"])) is not None:
                    ax.errorbar(max(r["tokens"], 1e4), r["corpus_kl"]["mean"], yerr=err,
                                capsize=3, color=line.get_color())
        ax.set_xscale("log")

    return {
        "quality_vs_kv.png": _png(quality_vs_kv, "KV cache per token, KiB (bf16, 30 layers)",
                                  "After recovery: quality against cache size (95% intervals "
                                  "over seeds)"),
        "recovery_curve.png": _png(recovery_curve, "recovery tokens (0 drawn at 10^4)",
                                   "Recovery curve (seed means; 95% intervals where several seeds)"),
    }


def write_summary(results: Path, log) -> dict[str, Any]:
    runs = _runs(results)
    families = by_family(runs)
    final_step = str(max((int(s) for r in runs for s in r["points"]), default=0))
    summary = {"arms": arm_table(families), "comparisons": comparisons(families, final_step),
               "gate_rows": {r["name"]: r["gate_rows"] for r in runs if r.get("gate_rows")},
               "fit_seconds": {r["name"]: r.get("fit_seconds") for r in runs},
               "run_precision": {r["name"]: precisions([r]) for r in runs}}
    summary["transfer"] = transfer_comparison(runs)
    for name in ("step0", "context", "lm_eval"):
        record = read_record(results / f"{name}.json")
        if record is not None:
            summary[name] = record
    results.mkdir(parents=True, exist_ok=True)
    files.write_text(results / "summary.json", json.dumps(summary, indent=1, default=str) + "\n")
    files.write_text(results / "summary.md", markdown(summary))
    if runs:
        for name, data in plots(summary).items():
            files.write_bytes(results / name, data)
    log(f"summary: {len(runs)} runs -> {results / 'summary.md'}")
    return summary
