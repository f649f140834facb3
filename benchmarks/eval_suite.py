"""SmolLM2-135M-Instruct on the offline suite, and the adapter's wall time against lm-eval's `hf`.

(a) accuracy: `--model egmla` on every task of `egmla_offline` (eval/tasks). Every task runs in
    full except GSM8K, which generates up to 256 tokens per problem and is capped at
    `--gsm8k-limit` problems (the first ones, lm-eval's `--limit`).
(b) wall time: the same weights through `--model egmla` and through lm-eval's own `hf` model
    (transformers loading the GGUF file, float32, batch size 8, CPU) on the same tasks with
    `--limit` documents each: loglikelihood tasks (MQAR recall, cloze, held-out perplexity) and
    a generative one (rg_chain_sum). Reported per task: seconds for each, the ratio, whether the
    metrics are identical, and the largest loglikelihood difference.

(c) precision: the loglikelihood tasks (`PRECISION_TASKS`) through `--model egmla` in float32
    and in bfloat16 (weights and KV cache), whole: each metric in both and the difference, and
    for per-document metrics (accuracy) the paired difference's mean with a 95% interval over
    documents and how many documents changed.
(d) quantization (`--quantization q8_0 gguf ...`): the same comparison for block-quantized
    weights (`quantization=` of the adapter, serve.LLM's), against the same float32 run; the
    methods run replace their rows, the other methods' recorded rows stay (each with its run).

    python benchmarks/eval_suite.py                    # all parts (~55 min on 2 CPU cores)
    python benchmarks/eval_suite.py --quick            # smoke test: a few documents per task
    python benchmarks/eval_suite.py --skip-accuracy --skip-timing   # only (c), ~25 min
    python benchmarks/eval_suite.py --skip-accuracy --skip-timing --skip-precision \
        --quantization q8_0 gguf                     # only (d)

Writes benchmarks/results/eval_suite.{json,md} (eval_suite_quick.* with --quick) with the
command, git SHA, versions and machine. Single runs on a shared CPU: compare the two models
within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in
from egmla.files import write_json, write_text  # noqa: E402  (after the path: this checkout's)
from egmla.quant import QUANTIZATIONS  # noqa: E402
from eval.local_tasks import group_tasks  # noqa: E402  (after the path: this checkout's eval)
from eval.stats import interval  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TASKS = ROOT / "eval" / "tasks"
TIMED = ["mqar_recall", "corpus_cloze", "corpus_perplexity", "rg_chain_sum"]
PRECISION_TASKS = list(group_tasks("egmla_loglikelihood"))  # eval/tasks/egmla_loglikelihood.yaml


def headline(task: str, results: dict[str, Any]) -> dict[str, float]:
    """Every numeric metric of a task, stderr left out: {'acc,none': 0.9, ...}."""
    return {k: v for k, v in results[task].items()
            if "," in k and "_stderr" not in k and isinstance(v, (int, float))}


def loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], float]:
    out = {}
    for sample in samples:
        for r, resp in enumerate(sample["resps"]):
            value = resp[0]
            if isinstance(value, (list, tuple)):
                value = value[0]
            if isinstance(value, (int, float)):
                out[sample["doc_id"], r] = float(value)
    return out


def evaluate(model, task: str, manager, limit: int | None) -> tuple[dict, float]:
    import lm_eval

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, limit=limit,
                                  log_samples=True)
    return out, time.perf_counter() - start


def accuracy(model, manager, tasks: list[str], gsm8k_limit: int | None, quick: bool) -> list[dict]:
    rows = []
    for task in tasks:
        limit = 3 if quick else gsm8k_limit if task == "gsm8k_offline" else None
        out, seconds = evaluate(model, task, manager, limit)
        rows.append({"task": task, "documents": out["results"][task]["sample_len"],
                     "limit": limit, "metrics": headline(task, out["results"]),
                     "seconds": round(seconds, 1)})
        print(f"{task}: {rows[-1]['metrics']} ({rows[-1]['documents']} docs, {seconds:.0f} s)",
              flush=True)
    return rows


def timing(ours, hf, manager, limit: int) -> list[dict]:
    rows = []
    for task in TIMED:
        (a, ta), (b, tb) = evaluate(ours, task, manager, limit), evaluate(hf, task, manager, limit)
        la, lb = loglikelihoods(a["samples"][task]), loglikelihoods(b["samples"][task])
        worst = max((abs(la[k] - lb[k]) for k in la.keys() & lb.keys()), default=None)
        rows.append({"task": task, "documents": a["results"][task]["sample_len"],
                     "egmla_s": round(ta, 1), "hf_s": round(tb, 1), "speedup": round(tb / ta, 2),
                     "egmla": headline(task, a["results"]), "hf": headline(task, b["results"]),
                     "identical": headline(task, a["results"]) == headline(task, b["results"]),
                     "max_abs_loglikelihood_diff": worst})
        print(f"{task}: egmla {ta:.1f} s, hf {tb:.1f} s, identical={rows[-1]['identical']}, "
              f"max |dLL|={worst}", flush=True)
    return rows


def per_document(samples: list[dict], metric: str) -> dict[int, float]:
    """{doc_id: value} of a metric lm-eval logs per sample ("acc"), empty where it logs none."""
    key = metric.split(",")[0]
    return {s["doc_id"]: float(s[key]) for s in samples if isinstance(s.get(key), (int, float))}


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """Mean of b - a over the documents both scored, its 95% Student-t interval (None below two
    documents), and how many documents differ; None unless both scored the same documents."""
    if not a or a.keys() != b.keys():
        return None
    diffs = [b[d] - a[d] for d in sorted(a)]
    ci = interval(diffs)  # Student-t over the documents
    return {"mean": ci["mean"], "ci95": [ci["low"], ci["high"]], "documents": len(diffs),
            "documents_differing": sum(x != 0 for x in diffs)}


def compare(model_class, manager, tasks: list[str], quick: bool,
            variants: dict[str, dict[str, str]]) -> dict[str, list[dict]]:
    """The tasks in float32 and in each variant (EgmlaLM keyword arguments by name), whole (3
    documents with --quick): per variant, a row per task comparing it with float32."""
    runs: dict[str, dict[str, dict]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for name, kwargs in {"float32": {"dtype": "float32"}, **variants}.items():
        model = model_class("SmolLM2-135M-Instruct", batch_size=8, **kwargs)
        runs[name], seconds[name] = {}, {}
        for task in tasks:
            runs[name][task], seconds[name][task] = evaluate(model, task, manager, 3 if quick else None)
            print(f"{task} {name}: {headline(task, runs[name][task]['results'])} "
                  f"({seconds[name][task]:.0f} s)", flush=True)
        del model
    out = {}
    for name in variants:
        out[name] = []
        for task in tasks:
            a, b = runs["float32"][task], runs[name][task]
            metrics_a, metrics_b = headline(task, a["results"]), headline(task, b["results"])
            out[name].append({
                "task": task, "documents": a["results"][task]["sample_len"],
                "float32": metrics_a, name: metrics_b,
                "seconds": {"float32": round(seconds["float32"][task], 1),
                            name: round(seconds[name][task], 1)},
                "paired": {m: paired(per_document(a["samples"][task], m),
                                     per_document(b["samples"][task], m)) for m in metrics_a}})
    return out


def _made_by(part: dict[str, Any], dtype: str = "float32") -> list[str]:
    p = part["provenance"]
    return [f"{p['time_utc']}; {p['hardware'].get('cpu')} ({p['hardware'].get('cpu_count')} "
            f"cores); git {p['git']['sha']}{' (dirty)' if p['git']['dirty'] else ''}; "
            f"lm-eval {p['versions'].get('lm-eval')}; torch {p['versions'].get('torch')}; "
            f"{dtype}. Command: `{' '.join(part['command'])}`", ""]


def _comparison(rows: list[dict], name: str, short: str) -> list[str]:
    """A comparison's table: each task's metrics in float32 and in `name`, their difference,
    the paired interval over documents and the documents changed."""
    lines = [(f"Paired: the mean over documents of ({short} - fp32) with its 95% Student-t "
              "interval, and the documents whose score changed."), "",
             (f"| task | documents | metric | float32 | {name} | {short} - fp32 | paired 95% CI "
              f"| documents changed | seconds fp32 / {short} |"),
             "|---|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        for i, (metric, a) in enumerate(r["float32"].items()):
            b, p = r[name][metric], r["paired"].get(metric)
            ci = ("-" if not p or p["ci95"][0] is None
                  else f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}]")
            changed = f"{p['documents_differing']}" if p else "-"
            secs = f"{r['seconds']['float32']} / {r['seconds'][name]}" if i == 0 else ""
            lines.append(f"| {r['task'] if i == 0 else ''} | {r['documents'] if i == 0 else ''} "
                         f"| {metric} | {a:.4f} | {b:.4f} | {b - a:+.4f} | {ci} | {changed} "
                         f"| {secs} |")
    return lines


def render(report: dict[str, Any]) -> str:
    lines = ["# SmolLM2-135M-Instruct on the offline suite; adapter vs lm-eval's hf model", ""]
    if report["accuracy"]:
        lines += ["## Accuracy (`--model egmla`, zero-shot)", "", *_made_by(report["accuracy"]),
                  "| task | documents | metric | value | seconds |", "|---|---:|---|---:|---:|"]
        for r in report["accuracy"]["rows"]:
            docs = f"{r['documents']}" + (f" (limit {r['limit']})" if r["limit"] else "")
            for i, (name, value) in enumerate(r["metrics"].items()):
                lines.append(f"| {r['task'] if i == 0 else ''} | {docs if i == 0 else ''} | "
                             f"{name} | {value:.4f} | {r['seconds'] if i == 0 else ''} |")
        lines.append("")
    if report["timing"]:
        lines += [f"## Wall time, same tasks, {report['timing']['limit']} documents each", "",
                  *_made_by(report["timing"]),
                  "| task | egmla s | hf s | hf / egmla | metrics identical | max rel metric diff "
                  "| max abs LL diff |", "|---|---:|---:|---:|---|---:|---:|"]
        for r in report["timing"]["rows"]:
            diff = r["max_abs_loglikelihood_diff"]
            rel = max(abs(r["egmla"][k] - v) / max(abs(v), 1e-12) for k, v in r["hf"].items())
            lines.append(f"| {r['task']} | {r['egmla_s']} | {r['hf_s']} | {r['speedup']}x | "
                         f"{'yes' if r['identical'] else 'no'} | {rel:.1e} | "
                         f"{'-' if diff is None else f'{diff:.1e}'} |")
        lines.append("")
    if report.get("precision"):
        lines += ["## bfloat16 against float32 (`--model egmla`, weights and KV cache in the dtype)",
                  "", *_made_by(report["precision"], "float32 and bfloat16"),
                  *_comparison(report["precision"]["rows"], "bfloat16", "bf16")]
        native = report["precision"].get("native_bf16")
        if native is not None:
            lines += ["", f"The CPU {'has' if native else 'lacks'} native bf16 arithmetic "
                      "(AVX512-BF16 or AMX; `python -m egmla.kernels status`)."]
    if report.get("quantization"):
        part = report["quantization"]
        lines += ["", "## Quantized weights against float32 (`--model egmla`, "
                  "`quantization=...` in `--model_args`)", ""]
        runs = part.get("runs") or {m: part for m in part["rows"]}
        for method, rows in part["rows"].items():
            lines += [f"### {method}", "", *_made_by(runs[method], "float32 activations"),
                      *_comparison(rows, method, method), ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k-limit", type=positive_int, default=200,
                        help="GSM8K problems to generate for (default 200 of 1,319)")
    parser.add_argument("--limit", type=positive_int, default=50,
                        help="documents per task in the wall-time comparison (default 50)")
    parser.add_argument("--skip-accuracy", action="store_true",
                        help="run only the wall-time part; keep the recorded accuracy part")
    parser.add_argument("--skip-timing", action="store_true",
                        help="run only the accuracy part; keep the recorded wall-time part")
    parser.add_argument("--skip-precision", action="store_true",
                        help="skip the bfloat16-against-float32 part; keep what is recorded")
    parser.add_argument("--quantization", nargs="+", choices=QUANTIZATIONS, default=[],
                        help="(d): the loglikelihood tasks with these quantized weights against "
                             "float32 (default: none, keep what is recorded)")
    parser.add_argument("--quick", action="store_true", help="a few documents per task")
    args = parser.parse_args()
    name = "eval_suite_quick" if args.quick else "eval_suite"
    # A skipped part keeps what the results file already holds (each part says what made it).
    previous = RESULTS / f"{name}.json"
    try:
        report: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    except (OSError, ValueError) as err:
        parser.error(f"{previous}: unreadable ({err}); move it away to start a new record")
    if not isinstance(report, dict):
        parser.error(f"{previous}: not a record of this benchmark (a JSON "
                     f"{type(report).__name__}); move it away to start a new record")

    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from egmla.imports import KNOWN_MODELS
    from egmla.provenance import provenance
    from eval.adapter import EgmlaLM
    from eval.local_tasks import install

    install()
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    suite = sorted(manager.load("egmla_offline")["tasks"])
    ours = (EgmlaLM("SmolLM2-135M-Instruct", dtype="float32", batch_size=8)
            if not (args.skip_accuracy and args.skip_timing) else None)
    report.setdefault("accuracy", None)
    report.setdefault("timing", None)
    report.setdefault("precision", None)
    report.setdefault("quantization", None)
    made_by = {"command": ["python", "benchmarks/eval_suite.py", *sys.argv[1:]],
               "provenance": provenance()}
    if not args.skip_accuracy:
        report["accuracy"] = {**made_by, "rows": accuracy(ours, manager, suite, args.gsm8k_limit,
                                                         args.quick)}
    if not args.skip_timing:
        gguf = KNOWN_MODELS["SmolLM2-135M-Instruct"].path()
        hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32",
                  device="cpu", batch_size=8)
        limit = 3 if args.quick else args.limit
        report["timing"] = {**made_by, "limit": limit, "rows": timing(ours, hf, manager, limit)}
    if not args.skip_precision:
        from egmla import kernels

        rows = compare(EgmlaLM, manager, PRECISION_TASKS, args.quick,
                       {"bfloat16": {"dtype": "bfloat16"}})["bfloat16"]
        report["precision"] = {**made_by, "native_bf16": kernels.native_bf16(), "rows": rows}
    if args.quantization:
        # the methods run now replace their rows; the others recorded stay, each method with
        # the run that made it (its own float32 pair)
        variants = {m: {"dtype": "float32", "quantization": m} for m in args.quantization}
        kept = report["quantization"] or {"rows": {}}
        runs = kept.get("runs") or {m: {k: kept[k] for k in made_by} for m in kept["rows"]}
        rows = compare(EgmlaLM, manager, PRECISION_TASKS, args.quick, variants)
        report["quantization"] = {**made_by, "rows": {**kept["rows"], **rows},
                                  "runs": {**runs, **{m: made_by for m in rows}}}
    write_json(RESULTS / f"{name}.json", report, indent=2, parents=True)
    write_text(RESULTS / f"{name}.md", render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
