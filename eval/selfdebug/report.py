"""Self-debugging report: hidden-test pass rate against tokens spent, from a JSONL trace.

    python -m eval.selfdebug.report runs/selfdebug/traces.jsonl --out runs/selfdebug/report

The trace holds one JSON object per (task_id, method, sample). Self-debug: pass@1 after each
repair round, a problem that stopped early (at a visible pass) keeping its last program and its
token total. Resampling: fresh samples until one passes the visible tests or the problem's token
budget (what self-debug spent on it) is used up; the program after j samples is the first
visible-passing one, else the latest. Equal budget: both methods on the problems both ran, with a
paired bootstrap CI on the difference. Sampling: unbiased pass@k (Chen et al. 2021, 2107.03374).
Several records of one method for one problem are averaged into that problem's value; every CI
is a 95% percentile bootstrap over problems.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from egmla import files
from eval.stats import bootstrap_ci  # noqa: F401 - re-exported: the report's CIs

METHODS = ("selfdebug", "resample", "sample")
PASSED = "passed"
CI_LEVEL = 0.95
FILES = {"json": "summary.json", "md": "summary.md", "png": "passrate_vs_tokens.png"}
ROUND_KEYS = ("prompt_tokens", "completion_tokens", "visible_status", "hidden_status")
TOTAL_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "model_calls", "sandbox_runs",
              "sandbox_s", "generate_s")

Records = dict[str, list[dict[str, Any]]]  # task_id -> that problem's records of one method


class ReportError(ValueError):
    """Bad input; `main` prints it as one `error:` line and exits 2 without writing anything."""


# ---- reading ---------------------------------------------------------------------------------


def load_traces(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL trace. A corrupt last line (a killed run) is dropped with a warning;
    a corrupt line before it raises ValueError; blank lines are skipped."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such trace file", str(path)) from None
    numbered = [(i + 1, line) for i, line in enumerate(raw.split(b"\n")) if line.strip()]
    records = []
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict):
                raise TypeError(f"a JSON {type(record).__name__}, not an object")
        except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError included
            if position == len(numbered) - 1:
                warnings.warn(f"{path}: line {number}: ignored a truncated or corrupt last line "
                              f"({e})", stacklevel=2)
                break
            raise ValueError(f"{path}: line {number}: not a JSON object: {e}") from None
        records.append(record)
    return records


def require_fields(path: str | Path, records: list[dict[str, Any]], fields: tuple[str, ...]) -> None:
    """ValueError naming `path` and the first record that lacks one of `fields`."""
    for i, record in enumerate(records, 1):
        missing = [k for k in fields if k not in record]
        if missing:
            raise ValueError(f"{path}: record {i} has no {', '.join(missing)}: not a self-debug "
                             "trace")


# ---- statistics ------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k), as a product."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _ks(n: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to n."""
    ks, scale = [], 1
    while scale <= n:
        ks += [k for k in (scale, 2 * scale, 5 * scale) if k <= n]
        scale *= 10
    return ks


# ---- summarizing -----------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(record: dict[str, Any], index: int) -> None:
    """ValueError naming the record if it lacks what the report reads."""
    where = f"record {index} ({record.get('task_id')!r}, {record.get('method')!r})"
    if not isinstance(record.get("task_id"), str) or not record["task_id"]:
        raise ValueError(f"{where}: task_id must be a non-empty string")
    if record.get("method") not in METHODS:
        raise ValueError(f"{where}: method must be one of {', '.join(METHODS)}")
    rounds = record.get("rounds")
    if not isinstance(rounds, list) or not rounds or not all(isinstance(r, dict) for r in rounds):
        raise ValueError(f"{where}: rounds must be a non-empty list of objects")
    for r, round_ in enumerate(rounds):
        missing = [key for key in ROUND_KEYS if key not in round_]
        if missing:
            raise ValueError(f"{where}: round {r} lacks {', '.join(missing)}")
        for key in (*TOTAL_KEYS, "prompt_tokens", "completion_tokens"):
            value = round_.get(key, 0)
            if not _is_number(value):
                raise ValueError(f"{where}: round {r}: {key} must be a number, got {value!r}")


def _group(records: list[dict[str, Any]]) -> dict[str, Records]:
    """method -> task_id -> records, checked; a repeated (task_id, method, sample) is an error."""
    groups: dict[str, Records] = defaultdict(lambda: defaultdict(list))
    seen = set()
    for index, record in enumerate(records):
        _check(record, index)
        key = (record["task_id"], record["method"], record.get("sample", 0))
        if key in seen:
            raise ValueError(f"record {index}: (task_id, method, sample) {key} appears twice")
        seen.add(key)
        groups[record["method"]][record["task_id"]].append(record)
    return groups


def _round_tokens(round_: dict[str, Any]) -> float:
    return round_["prompt_tokens"] + round_["completion_tokens"]


def _costs(rounds: list[dict[str, Any]], steps: int) -> np.ndarray:
    """(steps, 3): cumulative tokens, model calls and sandbox runs; totals kept after a stop."""
    per_round = np.array([[_round_tokens(r), r.get("model_calls", 0), r.get("sandbox_runs", 0)]
                          for r in rounds], dtype=float)
    return np.cumsum(per_round, axis=0)[np.minimum(np.arange(steps), len(rounds) - 1)]


def selfdebug_passes(rounds: list[dict[str, Any]], steps: int) -> np.ndarray:
    """1.0 where round min(r, last)'s program passes the hidden tests, for r in range(steps)."""
    return np.array([rounds[min(r, len(rounds) - 1)]["hidden_status"] == PASSED
                     for r in range(steps)], dtype=float)


def resample_passes(rounds: list[dict[str, Any]], steps: int) -> np.ndarray:
    """1.0 where the program kept after j + 1 samples passes the hidden tests: the first sample
    that passed the visible tests, else the latest (the last one after sampling stopped)."""
    chosen, passes = None, []
    for j in range(steps):
        if chosen is None and j < len(rounds) and rounds[j]["visible_status"] == PASSED:
            chosen = rounds[j]
        final = chosen if chosen is not None else rounds[min(j, len(rounds) - 1)]
        passes.append(final["hidden_status"] == PASSED)
    return np.array(passes, dtype=float)


def _no_code(round_: dict[str, Any]) -> bool:
    return round_.get("code_found") is False or round_["visible_status"] == "no_code"


def _final_pass(record: dict[str, Any]) -> bool:
    passes = resample_passes if record["method"] == "resample" else selfdebug_passes
    return bool(passes(record["rounds"], len(record["rounds"]))[-1])


def _totals(by_task: Records) -> dict[str, Any]:
    records = [r for recs in by_task.values() for r in recs]
    rounds = [round_ for r in records for round_ in r["rounds"]]
    totals: dict[str, Any] = {key: sum(r.get(key, 0) for r in rounds) for key in TOTAL_KEYS}
    totals["tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
    totals["rounds"] = len(rounds)
    totals["wall_s"] = sum(r.get("wall_s", 0) or 0 for r in records)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}


def _curve(by_task: Records, passes: Callable[[list, int], np.ndarray], step_key: str,
           rate_key: str, first_step: int, boot: Callable) -> tuple[list[str], np.ndarray, dict]:
    """Per-problem curves (P, steps, 4: pass, tokens, model calls, sandbox runs) and the section."""
    steps = max(len(r["rounds"]) for recs in by_task.values() for r in recs)
    tasks = sorted(by_task)
    per_problem = np.stack([
        np.mean([np.column_stack([passes(r["rounds"], steps), _costs(r["rounds"], steps)])
                 for r in by_task[t]], axis=0) for t in tasks])
    low, high = boot(per_problem[:, :, 0])
    mean = per_problem.mean(axis=0)
    records = [r for recs in by_task.values() for r in recs]
    rows = [{step_key: s + first_step, rate_key: float(mean[s, 0]),
             "ci": [float(low[s]), float(high[s])], "tokens": float(mean[s, 1]),
             "model_calls": float(mean[s, 2]), "sandbox_runs": float(mean[s, 3]),
             "running": sum(len(r["rounds"]) > s for r in records)} for s in range(steps)]
    section = {"problems": len(tasks), "records": len(records), "steps": rows,
               "final_pass_rate": rows[-1][rate_key], "final_ci": rows[-1]["ci"],
               "mean_tokens": rows[-1]["tokens"], "totals": _totals(by_task)}
    return tasks, per_problem, section


def summarize(records: list[dict[str, Any]], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Self-debug per round, resampling per sample count, equal-budget comparison, pass@k and
    counts, for the methods present (see the module docstring); ValueError on no records."""
    if not records:
        raise ValueError("no trace records")
    groups = _group(records)

    def boot(values: np.ndarray) -> tuple[Any, Any]:
        return bootstrap_ci(values, n_boot=n_boot, seed=seed, level=CI_LEVEL)

    rounds = {m: [round_ for recs in groups[m].values() for r in recs for round_ in r["rounds"]]
              for m in groups}
    summary: dict[str, Any] = {
        "schema": "egmla.selfdebug.report/1",
        "counts": {
            "problems": len({t for m in groups for t in groups[m]}),
            "records": {m: sum(map(len, groups[m].values())) for m in METHODS if m in groups},
            "problems_by_method": {m: len(groups[m]) for m in METHODS if m in groups},
            "rounds": {m: len(rounds[m]) for m in METHODS if m in groups},
            "no_code_rounds": {m: sum(_no_code(r) for r in rounds[m])
                               for m in METHODS if m in groups},
        },
        "bootstrap": {"n_boot": n_boot, "seed": seed, "level": CI_LEVEL},
    }
    mismatched = [r["task_id"] for m in ("selfdebug", "resample")
                  for recs in groups.get(m, {}).values() for r in recs
                  if "hidden_passed" in r and bool(r["hidden_passed"]) != _final_pass(r)]
    if mismatched:
        warnings.warn(f"{len(mismatched)} record(s) whose hidden_passed disagrees with their "
                      f"rounds (e.g. {mismatched[0]!r}); the report uses the rounds", stacklevel=2)

    finals: dict[str, dict[str, tuple[float, float]]] = {}  # method -> task -> (pass, tokens)
    for method, passes, step_key, rate_key, first in (
            ("selfdebug", selfdebug_passes, "round", "pass_at_1", 0),
            ("resample", resample_passes, "samples", "pass_rate", 1)):
        if method in groups:
            tasks, per_problem, section = _curve(groups[method], passes, step_key, rate_key, first,
                                                 boot)
            section["rounds" if method == "selfdebug" else "samples"] = section.pop("steps")
            summary[method] = section
            finals[method] = {t: (per_problem[i, -1, 0], per_problem[i, -1, 1])
                              for i, t in enumerate(tasks)}

    both = sorted(set(finals.get("selfdebug", {})) & set(finals.get("resample", {})))
    if both:
        sd = np.array([finals["selfdebug"][t] for t in both])
        rs = np.array([finals["resample"][t] for t in both])
        values = np.column_stack([sd[:, 0], rs[:, 0], sd[:, 0] - rs[:, 0]])
        low, high = boot(values)
        mean = values.mean(axis=0)
        summary["equal_budget"] = {
            "problems": len(both),
            "selfdebug_pass_rate": float(mean[0]), "selfdebug_ci": [float(low[0]), float(high[0])],
            "resample_pass_rate": float(mean[1]), "resample_ci": [float(low[1]), float(high[1])],
            "difference": float(mean[2]), "difference_ci": [float(low[2]), float(high[2])],
            "selfdebug_mean_tokens": float(sd[:, 1].mean()),
            "resample_mean_tokens": float(rs[:, 1].mean()),
        }

    if "sample" in groups:
        by_task = groups["sample"]
        tasks = sorted(by_task)
        n = {t: len(by_task[t]) for t in tasks}
        c = {t: sum(r["rounds"][-1]["hidden_status"] == PASSED for r in by_task[t]) for t in tasks}
        ks = _ks(min(n.values()))
        values = np.array([[pass_at_k(n[t], c[t], k) for k in ks] for t in tasks])
        low, high = boot(values)
        summary["sampling"] = {
            "problems": len(tasks), "n_min": min(n.values()), "n_max": max(n.values()),
            "correct": sum(c.values()), "mean_correct": sum(c.values()) / len(tasks),
            "pass_at_k": [{"k": k, "value": float(values[:, i].mean()),
                           "ci": [float(low[i]), float(high[i])]} for i, k in enumerate(ks)],
        }
    return summary


# ---- rendering -------------------------------------------------------------------------------


def _rate(x: float) -> str:
    return f"{x:.3f}"


def _ci(ci: list[float]) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    rule = ["---", *["---:"] * (len(headers) - 1)]
    return "\n".join("| " + " | ".join(r) + " |" for r in [headers, rule, *rows])


def render_markdown(summary: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
    """The summary as markdown: provenance line, counts, then one table per section."""
    meta = meta or {}
    out = ["# Self-debugging evaluation", ""]
    prov = meta.get("provenance") or {}
    if prov:
        git = prov.get("git") or {}
        sha = f"{git.get('sha') or 'unknown'}{' (dirty)' if git.get('dirty') else ''}"
        command = " ".join(map(str, prov.get("command") or []))
        out += [f"{prov.get('time_utc', '')} · git {sha} · `{command}`", ""]
    if meta.get("traces"):
        out += [f"Traces: `{meta['traces']}`", ""]
    counts, boot = summary["counts"], summary["bootstrap"]
    per_method = ", ".join(f"{m} {n}" for m, n in counts["records"].items())
    no_code = ", ".join(f"{m} {n}" for m, n in counts["no_code_rounds"].items())
    out += [f"{counts['problems']} problems; records: {per_method}; rounds without code: "
            + f"{no_code}.", "",
            (f"CIs: {boot['level']:.0%} percentile bootstrap over problems ({boot['n_boot']} "
             f"resamples, seed {boot['seed']}). Tokens: prompt + completion, mean per problem, "
             "cumulative; a problem that stopped keeps its last program and its total."),
            ""]
    if "selfdebug" in summary:
        s = summary["selfdebug"]
        out += ["## Self-debug: pass@1 after each repair round", "",
                _table(["round", "pass@1", "95% CI", "still running", "tokens", "model calls",
                        "sandbox runs"],
                       [[str(r["round"]), _rate(r["pass_at_1"]), _ci(r["ci"]), str(r["running"]),
                         _num(r["tokens"]), f"{r['model_calls']:.2f}", f"{r['sandbox_runs']:.2f}"]
                        for r in s["rounds"]]), ""]
    if "resample" in summary:
        s = summary["resample"]
        out += ["## Resampling: pass rate after each sample count (first visible pass kept)", "",
                _table(["samples", "pass rate", "95% CI", "still sampling", "tokens", "model calls",
                        "sandbox runs"],
                       [[str(r["samples"]), _rate(r["pass_rate"]), _ci(r["ci"]), str(r["running"]),
                         _num(r["tokens"]), f"{r['model_calls']:.2f}", f"{r['sandbox_runs']:.2f}"]
                        for r in s["samples"]]), ""]
    if "equal_budget" in summary:
        e = summary["equal_budget"]
        out += [f"## Equal budget: the {e['problems']} problems both methods ran", "",
                _table(["method", "pass rate", "95% CI", "mean tokens"],
                       [["self-debug", _rate(e["selfdebug_pass_rate"]), _ci(e["selfdebug_ci"]),
                         _num(e["selfdebug_mean_tokens"])],
                        ["resampling", _rate(e["resample_pass_rate"]), _ci(e["resample_ci"]),
                         _num(e["resample_mean_tokens"])],
                        ["self-debug − resampling", f"{e['difference']:+.3f}",
                         _ci(e["difference_ci"]) + " (paired)", ""]]), ""]
    if "sampling" in summary:
        s = summary["sampling"]
        out += [f"## Sampling: pass@k ({s['problems']} problems, n = {s['n_min']}"
                + (f"..{s['n_max']}" if s["n_max"] != s["n_min"] else "")
                + f" per problem, {s['correct']} correct samples)", "",
                _table(["k", "pass@k", "95% CI"],
                       [[str(r["k"]), _rate(r["value"]), _ci(r["ci"])] for r in s["pass_at_k"]]),
                ""]
    totals = [(m, summary[m]["totals"]) for m in ("selfdebug", "resample") if m in summary]
    if totals:
        out += ["## Totals", "",
                _table(["method", "rounds", "prompt tokens", "completion tokens", "cached tokens",
                        "model calls", "sandbox runs", "sandbox s", "generate s"],
                       [[m, *(_num(t[k]) for k in ("rounds", "prompt_tokens",
                                                    "completion_tokens", "cached_tokens",
                                                    "model_calls", "sandbox_runs")),
                         f"{t['sandbox_s']:.1f}", f"{t['generate_s']:.1f}"]
                        for m, t in totals]), ""]
    return "\n".join(out)


def _figure(summary: dict[str, Any]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    ax = fig.add_subplot()
    lines = [("selfdebug", "rounds", "pass_at_1", "round", "r", "self-debug (per repair round)",
              "C0"),
             ("resample", "samples", "pass_rate", "samples", "s", "resampling (per sample count)",
              "C1")]
    drawn = False
    for method, steps_key, rate_key, step_key, prefix, label, colour in lines:
        if method not in summary:
            continue
        steps = summary[method][steps_key]
        x = [s["tokens"] for s in steps]
        y = [s[rate_key] for s in steps]
        err = [[s[rate_key] - s["ci"][0] for s in steps], [s["ci"][1] - s[rate_key] for s in steps]]
        ax.errorbar(x, y, yerr=np.clip(err, 0, None), marker="o", color=colour, capsize=3,
                    label=f"{label}, {summary[method]['problems']} problems, {CI_LEVEL:.0%} CI")
        for s, xi, yi in zip(steps, x, y):
            ax.annotate(f"{prefix}{s[step_key]}", (xi, yi), xytext=(5, -12),
                        textcoords="offset points", fontsize=8, color=colour)
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no self-debug or resampling records", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("mean tokens spent per problem (prompt + completion, cumulative)")
    ax.set_ylabel("hidden-test pass rate")
    ax.set_title("Self-debugging vs resampling: pass rate against tokens", fontsize=10)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="upper right")
    return fig


def plot_png(summary: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _figure(summary).savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


# ---- writing ---------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Write into a temporary file beside `path` (mode 0644), then rename it into place."""
    files.write_bytes(path, data, mode=0o644, parents=True)


def plot(summary: dict[str, Any], path: str | Path) -> Path:
    """PNG of pass rate against mean tokens per problem: self-debug rounds, resampling counts."""
    path = Path(path)
    write_atomic(path, plot_png(summary))
    return path


def build_files(summary: dict[str, Any], meta: dict[str, Any] | None = None) -> dict[str, bytes]:
    """Every output file's bytes, keyed by file name, built before anything is written."""
    meta = dict(meta or {})
    if "provenance" not in meta:
        from egmla.provenance import provenance

        meta["provenance"] = provenance()
    report = {**summary, "meta": meta}
    return {
        FILES["json"]: (json.dumps(report, indent=2, default=str) + "\n").encode(),
        FILES["md"]: render_markdown(summary, meta).encode(),
        FILES["png"]: plot_png(summary),
    }


def write_report(records: list[dict[str, Any]], out_dir: str | Path,
                 meta: dict[str, Any] | None = None, *, n_boot: int = 2000,
                 seed: int = 0) -> dict[str, Path]:
    """Write summary.json (summary + meta, provenance added if absent), summary.md and
    passrate_vs_tokens.png into out_dir, each atomically; {"json", "md", "png"} -> path."""
    files = build_files(summarize(records, n_boot=n_boot, seed=seed), meta)
    out = Path(out_dir)
    for name, data in files.items():
        write_atomic(out / name, data)
    return {key: out / name for key, name in FILES.items()}


# ---- command line ----------------------------------------------------------------------------


EPILOG = """\
examples:
  python -m eval.selfdebug.report runs/selfdebug/traces.jsonl
  python -m eval.selfdebug.report traces.jsonl --out report/ --bootstrap 10000 --seed 1

outputs (into --out, default: the trace file's directory): summary.md (also printed),
summary.json (the numbers, the trace path and provenance: command, git SHA, versions, hardware,
time) and passrate_vs_tokens.png (pass rate against mean tokens per problem, both methods).
A truncated last trace line (a killed run) is skipped with a warning.
exit status: 0 ok, 2 bad input (missing or corrupt trace, no records; nothing written)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise ReportError(message)


def build_parser() -> argparse.ArgumentParser:
    title, _, text = __doc__.split("\n\n")[:3]
    p = _Parser(prog="python -m eval.selfdebug.report", description=f"{title}\n\n{text}",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", metavar="TRACES.jsonl",
                   help="the evaluation's trace: one JSON object per (task_id, method, sample)")
    p.add_argument("--out", metavar="DIR",
                   help="where summary.{md,json} and passrate_vs_tokens.png go "
                        "(default: the trace file's directory)")
    p.add_argument("--bootstrap", type=int, default=2000, metavar="N",
                   help="bootstrap resamples for the confidence intervals (default: 2000)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the bootstrap resampling (default: 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        if args.bootstrap < 1:
            raise ReportError(f"--bootstrap must be at least 1, got {args.bootstrap}")
        traces = Path(args.traces)
        out = Path(args.out) if args.out else traces.parent
        if out.exists() and not out.is_dir():
            raise ReportError(f"--out {out}: exists and is not a directory")
        try:  # before the traces are read
            files.check_writable(out)
        except OSError as err:
            raise ReportError(f"--out {out}: cannot be written ({err.strerror or err})") from None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = load_traces(traces)
            if not records:
                raise ReportError(f"{traces}: no trace records")
            summary = summarize(records, n_boot=args.bootstrap, seed=args.seed)
        for warning in caught:
            print(f"warning: {warning.message}", file=sys.stderr)
    except OSError as e:
        message = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        print(f"error: {message}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from egmla.provenance import provenance

    meta = {"traces": str(traces.resolve()),
            "provenance": provenance(["python", "-m", "eval.selfdebug.report", *argv])}
    outputs = build_files(summary, meta)
    for name, data in outputs.items():
        write_atomic(out / name, data)
    print(outputs[FILES["md"]].decode())
    print(f"wrote {', '.join(str(out / name) for name in outputs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
