"""Compare two self-debug runs of the same command, e.g. in-process against `--base-url` to a
local `python -m serve`: which attempts are identical (replies' token counts, programs, verdicts
of every round), and where the first difference lies for the rest.

    python benchmarks/selfdebug_parity.py benchmarks/results/selfdebug_humaneval \\
        benchmarks/results/selfdebug_humaneval_server --out benchmarks/results/selfdebug_parity

Timing fields and prefix-cache hits are left out: they depend on the machine and the batch, not
on what the model said. Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from egmla.files import output_prefix, write_json, write_text
from eval.selfdebug.report import load_traces, require_fields, summarize

VOLATILE = {"wall_s", "sandbox_s", "generate_s", "cached_tokens", "visible_reason"}
COMPARED = ("task_id", "method", "sample", "rounds", "hidden_passed")  # what every record needs


def attempts(run: Path) -> dict[tuple, dict]:
    """The records of `run`'s traces.jsonl by (task_id, method, sample); ValueError naming the
    file and the record when one lacks what is compared."""
    path = run / "traces.jsonl"
    records = load_traces(path)
    require_fields(path, records, COMPARED)
    found = {}
    for i, record in enumerate(records, 1):
        key = (record["task_id"], record["method"], record["sample"])
        rounds = record["rounds"]
        if not (all(isinstance(x, (str, int)) for x in key) and isinstance(rounds, list)
                and all(isinstance(r, dict) for r in rounds)):
            raise ValueError(f"{path}: record {i}: task_id, method and sample must be strings or "
                             "integers and rounds a list of objects")
        found[key] = record
    return found


def run_config(run: Path) -> dict:
    """`run`'s config.json; ValueError naming it when it is not a self-debug run's."""
    path = run / "config.json"
    config = json.loads(path.read_text())
    if not (isinstance(config, dict) and "backend" in config):
        raise ValueError(f"{path}: no 'backend': not a self-debug run's config")
    return config


def comparable(record: dict) -> dict:
    out = {k: v for k, v in record.items() if k not in VOLATILE}
    out["rounds"] = [{k: v for k, v in r.items() if k not in VOLATILE} for r in record["rounds"]]
    return out


def first_difference(a: dict, b: dict) -> str:
    for i, (ra, rb) in enumerate(zip(a["rounds"], b["rounds"])):
        keys = [k for k in ra if ra.get(k) != rb.get(k)]
        if keys:
            return f"round {i}: {', '.join(keys)}"
    if len(a["rounds"]) != len(b["rounds"]):
        return f"rounds: {len(a['rounds'])} vs {len(b['rounds'])}"
    return ", ".join(k for k in a if a.get(k) != b.get(k))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--out", type=output_prefix, required=True, help="path prefix for .md and .json")
    args = p.parse_args(argv)
    try:
        runs = [attempts(d) for d in (args.run_a, args.run_b)]
        configs = [run_config(d) for d in (args.run_a, args.run_b)]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summaries = []
    for run, directory in zip(runs, (args.run_a, args.run_b)):
        try:
            summaries.append(summarize(list(run.values())))
        except (KeyError, TypeError, ValueError) as e:  # a record the report cannot read
            print(f"error: {directory / 'traces.jsonl'}: not a self-debug trace the report reads "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    shared = sorted(set(runs[0]) & set(runs[1]))
    rows = []
    for key in shared:
        a, b = (comparable(run[key]) for run in runs)
        common = set(a) & set(b)  # a field added to the traces since one of the runs is skipped
        a, b = ({k: v for k, v in x.items() if k in common} for x in (a, b))
        for x, y in zip(a["rounds"], b["rounds"]):
            for k in set(x) ^ set(y):
                x.pop(k, None), y.pop(k, None)
        rows.append({"task_id": key[0], "method": key[1], "sample": key[2],
                     "identical": a == b, "difference": None if a == b else first_difference(a, b),
                     "hidden_passed": [run[key]["hidden_passed"] for run in runs]})
    by_method: dict[str, dict] = {}
    for row in rows:
        m = by_method.setdefault(row["method"], {"attempts": 0, "identical": 0,
                                                 "hidden_passed": [0, 0]})
        m["attempts"] += 1
        m["identical"] += row["identical"]
        m["hidden_passed"] = [x + y for x, y in zip(m["hidden_passed"], row["hidden_passed"])]
    result = {"runs": [str(args.run_a), str(args.run_b)], "configs": configs,
              "shared_attempts": len(shared), "only_in_a": len(set(runs[0]) - set(runs[1])),
              "only_in_b": len(set(runs[1]) - set(runs[0])), "by_method": by_method,
              "differences": [r for r in rows if not r["identical"]],
              "final_pass_rate": [s.get("selfdebug", {}).get("final_pass_rate")
                                  for s in summaries]}
    lines = [f"# Self-debug parity: {args.run_a} vs {args.run_b}", "",
             f"Backends: {configs[0]['backend']} vs {configs[1]['backend']}; "
             f"{len(shared)} attempts in both, {result['only_in_a']} only in the first, "
             f"{result['only_in_b']} only in the second.", "",
             "| method | attempts | identical | hidden passes (a / b) |", "|---|---:|---:|---|"]
    for method, m in by_method.items():
        lines.append(f"| {method} | {m['attempts']} | {m['identical']} | "
                     f"{m['hidden_passed'][0]} / {m['hidden_passed'][1]} |")
    if result["differences"]:
        lines += ["", "Differences (first differing field):", ""]
        lines += [f"- {d['task_id']} {d['method']} #{d['sample']}: {d['difference']}"
                  for d in result["differences"][:50]]
    write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n", parents=True)
    write_json(args.out.with_suffix(".json"), result)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
