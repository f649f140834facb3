"""Compare training runs: a quality metric against KV-cache bytes per token, one row per run.

    python -m eval.compare runs/                       # every run under runs/, sweeps' too
    python -m eval.compare runs/mha-s0 runs/mla-s0 --metric corpus_perplexity/word_perplexity
    python -m eval.compare runs/study/seeds --x d_e    # against another axis; seeds aggregated
    python -m eval.compare runs/study/long --x tokens  # the periodic validations, as curves

A row holds the run's attention variant, seed, parameters, KV-cache elements and bytes per token,
validation loss, tokens trained, every metric found in the run: MQAR accuracy by slice
(`mqar_acc/kv16`) and lm-eval results (`task/metric`), and the config keys whose values differ
between the runs compared (`optim.lr=0.003` across a learning-rate sweep). KV sizes are
analytic, computed from the run's model config with `egmla.models.cache_spec_for`, as
`python -m eval.kv_bytes` does. Runs whose configs differ only in the seed form one group: the
plot shows its mean with a 95% Student-t interval over the seeds. Writes
comparison.{md,csv,png,json} into --out, all or none.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any

from egmla.config import ConfigError, ModelConfig
from egmla.dtypes import short_name
from egmla.files import check_writable, write_files
from egmla.models import cache_spec_for
from egmla.provenance import provenance
from eval.kv_bytes import UsageError, parse_dtype
from eval.stats import difference_interval, interval, paired  # noqa: F401 - re-exported

RUN_FILES = ("config.json", "run_info.json", "summary.json")
COLUMNS = ["run", "group", "variant", "seed", "differs", "params", "params_without_gate_tables",
           "kv_dtype", "kv_elements_per_token", "kv_bytes_per_token", "d_e", "steps", "tokens", "val_loss"]
# --x: the row field plotted along x, and its axis label
X_AXES = {"kv_bytes": ("kv_bytes_per_token", "KV-cache bytes per token ({dtype})"),
          "params": ("params", "parameters (lookup tables included)"),
          "d_e": ("d_e", "gate embedding width d_e"),
          "tokens": ("tokens", "training tokens")}
# Config keys that do not make two runs different arms: seeds of one arm form a group. Nor are
# they shown among the keys that differ (the seed has its own column; wandb.name, set per job of a
# sweep, names the run, as name does).
NOT_THE_ARM = ("name", "seed", "wandb", "export", "sample_prompt", "tokenizer_fingerprint")
VARIANTS = ["mha", "gqa", "mqa", "mla", "egmla-kv", "egmla-latent"]  # fixes each one's colour


class CompareError(ValueError):
    """Bad input; `main` prints it as one `error:` line and exits 2 without writing anything."""


# ---- reading runs ----------------------------------------------------------------------------


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories from paths that are runs or hold runs at any depth.

    A directory holding any of config.json, run_info.json and summary.json is a run and must
    hold all three; it is not searched further (its checkpoints/, export/ and wandb/ hold no
    runs). Any other directory is searched, hidden ones (.hydra/) left out, subdirectories in
    sorted order with Hydra's job numbers as numbers: a `train.py -m` sweep puts its jobs two
    levels below runs/, as runs/<name>-multirun/0/, 1/, ..., 10/ (configs/train.yaml).
    """
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise CompareError(f"{path}: {'not a directory' if path.exists() else 'no such path'}")
        candidates = _runs_under(path)
        if not candidates:
            raise CompareError(f"{path}: no run directory in it (a run holds {', '.join(RUN_FILES)})")
        for run in candidates:
            missing = [f for f in RUN_FILES if not (run / f).is_file()]
            if missing:
                raise CompareError(f"{run}: not a finished run, missing {', '.join(missing)}")
        found += [c.resolve() for c in candidates]
    return list(dict.fromkeys(found))


def _runs_under(path: Path) -> list[Path]:
    """The run directories at or below `path`, depth first; each directory is listed once."""
    runs = []
    for top, subdirs, files in os.walk(path):
        if any(f in files for f in RUN_FILES):
            runs.append(Path(top))
            subdirs.clear()  # not into a run's own folders
        else:
            subdirs[:] = sorted((d for d in subdirs if not d.startswith(".")),
                                key=lambda d: (not d.isdecimal(), int(d) if d.isdecimal() else 0, d))
    return runs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: cannot read: {e}") from None


def _number(value: Any) -> float | None:
    """A finite number as float; None for NaN, strings ("N/A"), booleans and missing values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def variant(config: ModelConfig) -> str:
    """mha, gqa, mqa, mla, egmla-kv or egmla-latent: the label the attention config declares."""
    return config.attention.label(config)


def lm_eval_metrics(run_dir: Path) -> dict[str, float]:
    """{'task/metric': value} from lm-eval results saved under RUN_DIR/eval.

    `lm_eval --output_path RUN_DIR/eval` writes RUN_DIR/eval/<model>/results_<ISO time>.json
    holding results[task]["metric,filter"]. Per task the newest file wins (the names sort by
    time). The filter `none` is dropped from the name, any other kept: `acc,none` -> `task/acc`,
    `exact_match,strict-match` -> `task/exact_match,strict-match`.
    """
    latest: dict[str, dict[str, Any]] = {}
    for path in sorted((run_dir / "eval").glob("**/results_*.json"), key=lambda p: (p.name, str(p))):
        for task, values in (_read_json(path).get("results") or {}).items():
            latest[task] = values
    metrics = {}
    for task, values in latest.items():
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if filt and _number(value) is not None:
                metrics[f"{task}/{name}" + ("" if filt == "none" else f",{filt}")] = _number(value)
    return metrics


def tokens_trained(config: dict[str, Any], steps: int | None) -> int | None:
    """Optimizer steps x micro-batch x sequence x accumulation x processes; None if unknown."""
    data, trainer = config.get("data") or {}, config.get("trainer") or {}
    devices = trainer.get("devices", 1)
    world = len(devices) if isinstance(devices, list) else devices  # "auto", -1: unknown
    factors = [steps, data.get("batch_size"), data.get("seq_len"), world,
               trainer.get("accumulate_grad_batches", 1), trainer.get("num_nodes", 1)]
    if not all(isinstance(f, int) and not isinstance(f, bool) and f >= 1 for f in factors):
        return None
    return math.prod(factors)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys, lists kept as values: {"optim": {"lr": 0.003, "betas":
    [0.9, 0.95]}} -> {"optim.lr": 0.003, "optim.betas": [0.9, 0.95]}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_ABSENT = object()


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The dotted keys whose values are not the same in every config (a key one config lacks
    differs), in the order the configs hold them."""
    keys = dict.fromkeys(k for c in configs for k in c)
    first = configs[0] if configs else {}
    return [k for k in keys if any(c.get(k, _ABSENT) != first.get(k, _ABSENT) for c in configs)]


def _setting(key: str, value: Any) -> str:
    """`optim.lr=0.003`: a string as it is, any other value as JSON (1e-05, null, [4, 8])."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def load_row(run_dir: Path, dtype_name: str = "bf16") -> dict[str, Any]:
    """One run's row: description, sizes, validation loss and every metric found."""
    config, info, summary = (_read_json(run_dir / f) for f in RUN_FILES)
    try:
        model = ModelConfig.from_dict(config.get("model"))
    except (ConfigError, TypeError) as e:
        raise CompareError(f"{run_dir / 'config.json'}: {e}") from None
    spec = cache_spec_for(model)
    dtype = parse_dtype(dtype_name)
    arm = {k: v for k, v in config.items() if k not in NOT_THE_ARM}
    row = {
        "run": summary.get("name") or config.get("name") or run_dir.name,
        "group": json.dumps(arm, sort_keys=True),  # replaced by a readable label in load_rows
        "variant": variant(model),
        "seed": config.get("seed"),
        "differs": flatten(arm),  # replaced by the keys that differ between runs in load_rows
        "params": info.get("params"),
        "params_without_gate_tables": info.get("params_without_gate_tables"),
        "kv_dtype": short_name(dtype),
        "kv_elements_per_token": spec.elements_per_token(),
        "kv_bytes_per_token": spec.bytes_per_token(dtype),
        "d_e": getattr(model.attention, "d_e", None),  # the gate's (or value embedding's) width
        "steps": summary.get("global_step"),
        "tokens": tokens_trained(config, summary.get("global_step")),
        "val_loss": _number(summary.get("val_loss")),
    }
    for slice_name, acc in (summary.get("mqar_accuracy") or {}).items():
        row[f"mqar_acc/{slice_name}"] = _number(acc)
    return {**row, **lm_eval_metrics(run_dir), "run_dir": str(run_dir)}


def load_rows(paths: list[str | Path], dtype_name: str = "bf16") -> list[dict[str, Any]]:
    """Rows of every run found under `paths`; a name shared by runs gains its directory name.
    Each row's `group` names the runs that differ from it only in the seed; its `differs` lists,
    as `key=value, ...`, the config keys whose values are not the same in every run (the seed,
    the name and the other NOT_THE_ARM keys left out), each that the run's config holds."""
    rows = [load_row(run, dtype_name) for run in find_runs(paths)]
    keys = differing_keys([r["differs"] for r in rows])
    for row in rows:
        arm = row["differs"]
        row["differs"] = ", ".join(_setting(k, arm[k]) for k in keys if k in arm)
    names = [r["run"] for r in rows]
    for row in rows:
        if names.count(row["run"]) > 1:
            row["run"] = f"{row['run']}/{Path(row['run_dir']).name}"
    labels: dict[str, str] = {}
    for key in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == key]
        label = _common_name([r["run"] for r in members], [r["seed"] for r in members])
        if label in labels.values() or not label:
            label = f"{members[0]['variant']}#{len(labels) + 1}"
        labels[key] = label
    for row in rows:
        row["group"] = labels[row["group"]]
    return rows


def _common_name(names: list[str], seeds: list[Any]) -> str:
    """The run names with their seed taken out (`mla-lr0.002-s1-300` -> `mla-lr0.002-300`), if
    that makes them one name; a lone run keeps its name."""
    if len(names) == 1:
        return names[0]
    stripped = {re.sub(rf"([-_/.]?s(eed)?[-_=]?{seed})(?=$|[-_/.])", "", name)
                for name, seed in zip(names, seeds)}
    return stripped.pop() if len(stripped) == 1 else ""


def aggregate(rows: list[dict[str, Any]], x: str = "kv_bytes") -> list[dict[str, Any]]:
    """One entry per group with a value of the metric: its runs and seeds, the x value, and the
    metric's mean with its 95% interval over the seeds."""
    field = X_AXES[x][0]
    groups = []
    for label in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == label and r.get("metric_value") is not None]
        if not members:
            continue
        xs = {m.get(field) for m in members}
        groups.append({"group": label, "variant": members[0]["variant"],
                       "runs": [m["run"] for m in members], "seeds": [m["seed"] for m in members],
                       "x": members[0].get(field) if len(xs) == 1 else None,
                       "params": members[0]["params"],
                       "values": [m["metric_value"] for m in members],
                       **interval([m["metric_value"] for m in members])})
    return groups


FRACTIONS = ("acc", "recall", "exact_match", "pass@")  # metrics that are shares of [0, 1]


def bounds(metric: str) -> tuple[float, float] | None:
    """The range a metric cannot leave ([0, 1] for an accuracy, a recall, pass@k), or None."""
    return (0.0, 1.0) if any(f in metric.lower() for f in FRACTIONS) else None


def metric_names(rows: list[dict[str, Any]]) -> list[str]:
    """val_loss, then every `prefix/name` metric of any row, sorted."""
    return ["val_loss", *sorted({k for r in rows for k in r if "/" in k and k != "run_dir"})]


def select_metric(rows: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The rows with `metric` and `metric_value` columns (`,none` dropped from the name);
    CompareError, listing the metrics there are, if no run has a value for it."""
    name = metric.removesuffix(",none")
    if not any(r.get(name) is not None for r in rows):
        raise CompareError(f"metric {metric!r} is in no run; available: "
                           + ", ".join(m for m in metric_names(rows)
                                       if any(r.get(m) is not None for r in rows)))
    return [{**r, "metric": name, "metric_value": r.get(name)} for r in rows]


# ---- rendering -------------------------------------------------------------------------------


def columns(rows: list[dict[str, Any]]) -> list[str]:
    return [*COLUMNS, *metric_names(rows)[1:], "metric", "metric_value", "run_dir"]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.1f}"
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def render_table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per run; a metric with a standard error is shown as `value ± stderr`;
    a `differs` column (the config keys that differ between the runs) where any key does."""
    shown = [m for m in metric_names(rows) if not m.partition(",")[0].endswith("_stderr")]
    differs = any(r.get("differs") for r in rows)
    headers = ["run", "variant", "seed", *(["differs"] if differs else []),
               "params (w/o gate tables)", "KV elements/token",
               f"KV bytes/token ({rows[0]['kv_dtype']})", "tokens", *shown]
    body = []
    for r in rows:
        cells = [r["run"], r["variant"], _fmt(r["seed"]), *([r["differs"] or "-"] if differs else []),
                 f"{_fmt(r['params'])} ({_fmt(r['params_without_gate_tables'])})",
                 _fmt(r["kv_elements_per_token"]), _fmt(r["kv_bytes_per_token"]), _fmt(r["tokens"])]
        for m in shown:  # task/acc -> task/acc_stderr; task/em,flex -> task/em_stderr,flex
            err = r.get(m.replace(",", "_stderr,", 1) if "," in m else f"{m}_stderr")
            cells.append(_fmt(r.get(m)) + (f" ± {_fmt(err)}" if err is not None else ""))
        body.append([c.replace("|", "\\|") for c in cells])
    rule = ["---", "---", "---:", *(["---"] if differs else [])]
    rule += ["---:"] * (len(headers) - len(rule))
    return "\n".join("| " + " | ".join(c) + " |" for c in [headers, rule, *body])


def render_groups(rows: list[dict[str, Any]], x: str) -> str:
    """One markdown row per group: its seeds, x, and the metric's mean and 95% interval."""
    field, label = X_AXES[x]
    lines = [f"| group | variant | seeds | {label.format(dtype=rows[0]['kv_dtype'])} | "
             f"{rows[0]['metric']} mean | 95% interval |", "| --- | --- | --- | ---: | ---: | --- |"]
    for g in aggregate(rows, x):
        ci = "-" if g["low"] is None else f"[{_fmt(g['low'])}, {_fmt(g['high'])}]"
        seeds = ", ".join(_fmt(s) for s in g["seeds"])
        lines.append(f"| {g['group']} | {g['variant']} | {seeds} | {_fmt(g['x'])} | "
                     f"{_fmt(g['mean'])} | {ci} |")
    return "\n".join(lines)


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any], x: str = "kv_bytes") -> str:
    """A header line (date, git SHA, command), what the numbers are, the groups, the runs."""
    dtype, metric, git = rows[0]["kv_dtype"], rows[0]["metric"], meta["git"]
    missing = [r["run"] for r in rows if r.get(metric) is None]
    sha = f"{git['sha'] or 'unknown'}{' (dirty)' if git['dirty'] else ''}"
    not_plotted = f"\nNo value for {metric}, not plotted: {', '.join(missing)}.\n" if missing else ""
    return f"""# Run comparison

{meta['time_utc']} · git {sha} · `{shlex.join(meta['command'])}`

Plotted: **{metric}** against KV-cache bytes per token ({dtype}, analytic from each run's model
config: every cached tensor of every layer, plus per-sequence token ids where cached). Params: all
parameters (without the gate tables in parentheses). Tokens: optimizer steps x batch x sequence
length x accumulation x processes. lm-eval metrics: the newest results file per task, ± stderr.
Groups: runs whose configs differ only in the seed; mean and 95% Student-t interval over seeds.
Differs: the keys of the runs' config.json whose values are not the same in every run.
{not_plotted}
{render_groups(rows, x)}

{render_table(rows)}
"""


def curves(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group, the metric at every periodic validation (the runs' metrics.csv, or a row's own
    `curve`: {column: {step: value}}) against training tokens: mean and 95% interval over the
    seeds at each step all of them logged."""
    metric = rows[0]["metric"]
    column = "val/loss" if metric == "val_loss" else f"val/{metric}"
    out = []
    for label in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == label]
        series = [m["curve"].get(column, {}) if "curve" in m  # a row that carries its curve
                  else _logged(Path(m["run_dir"]) / "metrics.csv", column) for m in members]
        # The final validation (the whole split, logged at the last step) is another measure
        # than the periodic ones (a fixed number of batches): it is the run's point, not the curve's.
        series = [{step: v for step, v in s.items() if not m.get("steps") or step < m["steps"]}
                  for s, m in zip(series, members)]
        steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
        per_step = [(m["tokens"] or 0) / m["steps"] if m.get("steps") else None for m in members]
        if not steps or None in per_step:
            continue
        out.append({"group": label, "variant": members[0]["variant"], "n": len(members),
                    # Lightning logs a validation during fit at the step count before the
                    # step that triggered it: step s has s + 1 optimizer steps behind it
                    "tokens": [(step + 1) * per_step[0] for step in steps],
                    "points": [interval([s[step] for s in series]) for step in steps]})
    if not out:
        raise CompareError(f"no run logged {metric!r} at its periodic validations (metrics.csv "
                           f"column {column!r}); curves exist for val_loss and mqar_acc/SLICE")
    return out


def _logged(path: Path, column: str) -> dict[int, float]:
    if not path.is_file():
        return {}
    with path.open() as f:
        return {int(float(r["step"])): float(r[column]) for r in csv.DictReader(f)
                if r.get(column) not in (None, "") and r.get("step") not in (None, "")}


def _limits(values: list[float], log: bool, pad: float = 0.08) -> tuple[float, float]:
    """Axis limits that hold every value with a margin (in log space on a log axis)."""
    lo, hi = min(values), max(values)
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    span = (hi - lo) or abs(hi) or 1.0
    lo, hi = lo - pad * span, hi + pad * span
    return (10**lo, 10**hi) if log else (lo, hi)


def _place_labels(ax, points: list[tuple[float, float, str]]) -> None:
    """Annotate each point, moving a label down (in steps of its height) while it would overlap
    one already placed, so that labels of close points do not collide."""
    to_axes = ax.transData + ax.transAxes.inverted()
    placed: list[tuple[float, float, float]] = []  # x, y, width in axes fractions
    for x, y, text in sorted(points, key=lambda p: -p[1]):
        ax_x, ax_y = to_axes.transform((x, y))
        width, height, offset = 0.012 * len(text), 0.04, 0.0
        while any(abs(ax_x - px) < max(width, pw) and abs(ax_y + offset - py) < height
                  for px, py, pw in placed):
            offset -= height
        placed.append((ax_x, ax_y + offset, width))
        ax.annotate(text, (x, y), xytext=(6, 4 + offset * ax.bbox.height), fontsize=8,
                    textcoords="offset points", arrowprops=(
                        {"arrowstyle": "-", "lw": 0.5, "color": "grey"} if offset else None))


MARKERS = "osD^vP*X"  # the groups of one variant: one colour, a marker each


def _styles(groups: list[dict[str, Any]], variants: list[str]) -> dict[str, tuple[Any, str]]:
    """Each group's (colour, marker): the colour is its variant's (the same in every plot), the
    marker tells apart groups of one variant (MLA at two widths, say). The first ten variants
    take tab10's colours; the next ten the light shade of each (tab20), with markers from the
    other end of the list, so that twenty variants' groups still differ in colour or marker."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"]  # dark (tab10's) and light shades of ten hues
    names = list(dict.fromkeys([*VARIANTS, *variants]))
    styles, seen = {}, {}
    for g in groups:
        n = seen[g["variant"]] = seen.get(g["variant"], -1) + 1
        index = names.index(g["variant"]) % 20
        shade, hue = divmod(index, 10)
        marker = MARKERS[n % len(MARKERS)] if not shade else MARKERS[::-1][n % len(MARKERS)]
        styles[g["group"]] = (colours(2 * hue + shade), marker)
    return styles


def plot(rows: list[dict[str, Any]], x: str = "kv_bytes"):
    """The chosen metric against `x`, a point per group (the mean over its seeds, with a 95%
    interval and a tick per seed where it has several; an accuracy's interval is cut at 0 and
    1, the ends of its range): colour = variant (the same colour for a variant in every
    plot), marker = group where a variant has several, area ∝ parameters (lookup tables
    included). The legend names the variants, or the groups where a variant has several (then
    the points carry no labels). `x="tokens"`: the groups' curves over their periodic
    validations (the final, whole-split validation is left out: another measure)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric = rows[0]["metric"]
    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    ax = fig.add_subplot()
    variants = [r["variant"] for r in rows]
    ylabel = "validation loss (nats/token)" if metric == "val_loss" else metric
    if x == "tokens":
        lines = curves(rows)
        style = _styles(lines, variants)
        for c in lines:
            colour, marker = style[c["group"]]
            means = [p["mean"] for p in c["points"]]
            ax.plot(c["tokens"], means, marker=marker, ms=3, color=colour,
                    label=f"{c['group']} (n={c['n']})")
            if c["n"] > 1:
                ax.fill_between(c["tokens"], [p["low"] for p in c["points"]],
                                [p["high"] for p in c["points"]], color=colour,
                                alpha=0.15, linewidth=0)
        ax.set_xlabel("training tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{metric} at the periodic validations" + (
            "; bands: 95% interval over seeds" if any(c["n"] > 1 for c in lines) else
            "; one seed each"), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        return fig
    groups = [g for g in aggregate(rows, x) if g["x"] is not None]
    if not groups:
        raise CompareError(f"--x {x}: no run has a value for it ({X_AXES[x][0]})")
    style = _styles(groups, variants)
    by_group = len({g["variant"] for g in groups}) < len(groups)
    biggest = max(g["params"] or 0 for g in groups) or 1
    labelled: set[str] = set()
    floor, ceiling = bounds(metric) or (-math.inf, math.inf)
    for g in groups:
        colour, marker = style[g["group"]]
        name = g["group"] + (f" (n={g['n']})" if g["n"] > 1 else "")
        label = name if by_group else None if g["variant"] in labelled else g["variant"]
        labelled.add(g["variant"])
        ax.scatter([g["x"]], [g["mean"]], s=max(10.0, 300 * (g["params"] or 0) / biggest),
                   color=colour, marker=marker, alpha=0.8, edgecolors="black", linewidths=0.5,
                   label=label, zorder=3)
        if g["low"] is not None:  # a t-interval may pass a fraction's range: cut at its ends
            low, high = max(g["low"], floor), min(g["high"], ceiling)
            ax.errorbar([g["x"]], [g["mean"]], yerr=[[g["mean"] - low], [high - g["mean"]]],
                        fmt="none", ecolor=colour, capsize=3, zorder=2)
            ax.scatter([g["x"]] * g["n"], g["values"], s=12, marker="_", color="black",
                       linewidths=1.2, zorder=4)  # each seed's value on the bar
    xs = [g["x"] for g in groups]
    ys = [min(max(v, floor), ceiling)
          for g in groups for v in (g["low"], g["mean"], g["high"]) if v is not None]
    log = min(xs) > 0 and max(xs) > 10 * min(xs)
    if log:
        ax.set_xscale("log")
    ax.set_xlim(*_limits(xs, log))
    ax.set_ylim(*_limits(ys, False))
    if not by_group:
        _place_labels(ax, [(g["x"], g["mean"], g["group"] + (f" (n={g['n']})" if g["n"] > 1
                                                                else "")) for g in groups])
    ax.set_xlabel(X_AXES[x][1].format(dtype=rows[0]["kv_dtype"]))
    ax.set_ylabel(ylabel)
    several = any(g["n"] > 1 for g in groups)
    title = (f"{metric} against {X_AXES[x][1].split(' (')[0]}; marker area ∝ parameters"
             + ("; bars: 95% interval over seeds, ticks: the seeds" if several else ""))
    ax.set_title("\n".join(textwrap.wrap(title, 95)), fontsize=10)  # a long metric name wraps
    ax.grid(alpha=0.3)
    beside = len(groups) > 6  # many groups: the legend beside the axes, not over the points
    legend = ax.legend(title="run group" if by_group else "attention", fontsize=8,
                       **({"loc": "upper left", "bbox_to_anchor": (1.01, 1)} if beside else
                          {"loc": "best"}))
    if beside:
        fig.set_size_inches(10, 5)
    for handle in legend.legend_handles:
        handle.set_sizes([50])
    return fig


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


# ---- writing ---------------------------------------------------------------------------------


def build_outputs(rows: list[dict[str, Any]], meta: dict[str, Any],
                  x: str = "kv_bytes") -> dict[str, bytes]:
    """Every output file's bytes, built in memory before anything is written."""
    report = {"schema": "egmla.compare/2", "metric": rows[0]["metric"],
              "kv_dtype": rows[0]["kv_dtype"], "x": x, "columns": columns(rows), "rows": rows,
              "groups": aggregate(rows, x), "provenance": meta}
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=columns(rows), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return {
        "comparison.md": render_markdown(rows, meta, x).encode(),
        "comparison.csv": table.getvalue().encode(),
        "comparison.png": png_bytes(plot(rows, x)),
        "comparison.json": (json.dumps(report, indent=2) + "\n").encode(),
    }


def write_all(out: Path, files: dict[str, bytes]) -> None:
    """Write the files into a temporary folder beside `out`, then rename each into place, so an
    interrupted write leaves no half-written file."""
    write_files(out, files)


def log_to_wandb(project: str, rows: list[dict[str, Any]], png: Path, meta: dict[str, Any]) -> str:
    """A new wandb run (mode from the environment, as wandb decides) with the table and the plot."""
    import wandb

    cols = columns(rows)
    run = wandb.init(project=project, job_type="compare", name=f"compare-{len(rows)}-runs",
                     config={"metric": meta["metric"], "kv_dtype": meta["kv_dtype"],
                             "runs": [r["run"] for r in rows], "git_sha": meta["git"]["sha"]})
    try:
        table = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
        run.log({"comparison": table, "comparison_plot": wandb.Image(str(png))})
        return run.dir if run.offline else run.url
    finally:
        run.finish()


# ---- command line ----------------------------------------------------------------------------


EPILOG = """\
examples:
  python -m eval.compare runs/                              # every run under runs/, val_loss
  python -m eval.compare runs/mqar-multirun                 # one sweep's jobs
  python -m eval.compare runs/a runs/b --out cmp/ --dtype fp8
  python -m eval.compare runs/ --metric corpus_perplexity/word_perplexity
  python -m eval.compare runs/ --wandb-project egmla        # also log table + plot to wandb

metrics: val_loss (summary.json), mqar_acc/SLICE (summary.json of MQAR runs), TASK/METRIC from
lm-eval results in RUN_DIR/eval (python -m eval.lm_eval ... --output_path RUN_DIR/eval);
the filter suffix ,none may be given or left out. An unknown metric lists the available ones.
outputs: comparison.md (header: date, git SHA, command; then the table), comparison.csv,
comparison.png (metric against --x; colour = variant, marker area = parameters, bars = 95%
interval over seeds; --x tokens: curves) and
comparison.json (rows and provenance: command, git SHA, versions, hardware, time).
exit status: 0 ok, 1 wandb logging failed (files written), 2 bad input (nothing written)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise CompareError(message)


def build_parser() -> argparse.ArgumentParser:
    title, _, row = __doc__.split("\n\n")[:3]
    p = _Parser(prog="python -m eval.compare", description=f"{title}\n\n{row}", epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="RUN_DIR",
                   help="a run directory (summary.json, config.json, run_info.json) or a "
                        "directory holding runs at any depth (a -m sweep's "
                        "runs/NAME-multirun/JOB/)")
    p.add_argument("--out", default="comparison", metavar="DIR",
                   help="where comparison.{md,csv,png,json} go (default: comparison/)")
    p.add_argument("--metric", default="val_loss",
                   help="the y axis: val_loss (default), mqar_acc/SLICE or TASK/METRIC from lm-eval")
    p.add_argument("--dtype", default="bf16", help="KV-cache dtype: bf16 (default), fp32, fp16, fp8")
    p.add_argument("--x", choices=list(X_AXES), default="kv_bytes",
                   help="the x axis: kv_bytes (default), params, d_e, or tokens (curves over the "
                        "periodic validations of val_loss or mqar_acc/SLICE)")
    p.add_argument("--wandb-project", metavar="NAME",
                   help="also log the table and the plot to a new wandb run in this project "
                        "(online or offline as WANDB_MODE and your login say)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        dtype = short_name(parse_dtype(args.dtype))
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise CompareError(f"--out {out}: exists and is not a directory")
        try:  # before the runs are read and the figures drawn
            check_writable(out)
        except OSError as err:
            raise CompareError(f"--out {out}: cannot be written ({err.strerror or err})") from None
        rows = select_metric(load_rows(args.paths, dtype), args.metric)
    except (CompareError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {**provenance(["python", "-m", "eval.compare", *argv]), "metric": rows[0]["metric"],
            "kv_dtype": dtype, "x": args.x}
    try:
        files = build_outputs(rows, meta, args.x)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_all(out, files)
    print(files["comparison.md"].decode())
    print(f"wrote {', '.join(str(out / name) for name in files)}")
    if args.wandb_project:
        try:
            where = log_to_wandb(args.wandb_project, rows, out / "comparison.png", meta)
        except Exception as e:  # noqa: BLE001 - any wandb failure: one line; the files stand
            print(f"error: wandb: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"wandb: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
