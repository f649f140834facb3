"""Issue 38's measurements end to end, resumable: `python -m studies.upcycling`.

SmolLM2-135M-Instruct (GQA: 30 layers, 9 query heads, 3 KV heads of 64) converted to MLA and
EG-MLA at MHA2MLA's three cache sizes (rope_dims 8 per KV head; d_c 96, 48, 24: 120, 72, 48
cached elements per token per layer against the original's 384), then recovered by
distillation from the original (`experiment=upcycle_smollm2`). Phases, each skipping what its
committed record already holds:

1. step0: the training-free table: held-out perplexity and KL to the original on the recovery
   domain and on the unseen embedded corpus, for MLA at the three sizes under the three rules
   (2norm, uniform, high; whitened SVD), plain SVD beside it, EG-MLA identity-start (both gate
   positions) at the two smaller sizes, and the paper's gate form at the smallest;
   -> <results>/step0.{json,md}
2. train: arm by arm (ARMS), convert (python -m egmla.upcycle) then recover to 1M tokens with
   exports at 0.1M and 0.3M; each export measured as in step0 right after; the runs of a seed
   in one precision (--precision; a run that needs bf16 waits for a CPU that has it);
   -> <results>/runs/<arm>.json
3. context: perplexity against context length up to 4,096 tokens, at 0 and at 1M tokens;
4. lm_eval: the offline lm-eval tasks (corpus cloze, corpus perplexity, MQAR in words) through
   the `egmla` model, at 0 and at 1M tokens;
   both for the original and for one run of each arm (its family's last seed), measured right
   after that run trains, since run directories do not outlive a machine (an arm whose
   exports are gone unmeasured is named, to be trained again);
5. summary: tables, paired differences over seeds, plots -> <results>/summary.{json,md}, *.png

    python -m studies.upcycling                          # everything (hours; resumable)
    python -m studies.upcycling --phases step0           # the training-free table only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from egmla.files import output_directory
from eval.local_tasks import group_tasks
from studies.pipeline import ROOT, PipelineError, read_record, run_logged, write_json
SOURCE = "SmolLM2-135M-Instruct"
ROPE_DIMS = 8
SIZES = (96, 48, 24)
RULE = "2norm"  # MHA2MLA's best, and this codebase's default (docs/upcycling.md: the step-0 table)
STEPS = 244  # experiment=upcycle_smollm2: 1.0M tokens (8 x 512 a step)
CURVE_STEPS = (24, 73)  # its export_steps: 0.1M and 0.3M tokens
PHASES = ("step0", "train", "context", "lm_eval", "summary")
LM_EVAL_TASKS = group_tasks("egmla_loglikelihood")  # eval/tasks/egmla_loglikelihood.yaml


@dataclass(frozen=True)
class Arm:
    """One recovery run: a conversion and a seed (the data order and the gate tables)."""

    to: str
    d_c: int
    gate_position: str | None = None  # EG-MLA only
    gate_form: str = "identity"
    seed: int = 0
    transfer_steps: int = 0

    @property
    def name(self) -> str:
        kind = "mla" if self.to == "mla" else (
            "egmla-paper" if self.gate_form == "paper" else f"egmla-{self.gate_position}")
        transfer = f"-transfer{self.transfer_steps}" if self.transfer_steps else ""
        return f"{kind}-dc{self.d_c}{transfer}-s{self.seed}"

    @property
    def family(self) -> str:
        """The arm without its seed (what seeds are paired over)."""
        return self.name.rsplit("-s", 1)[0]

    def convert_args(self) -> list[str]:
        args = ["--model", SOURCE, "--to", self.to, "--d-c", str(self.d_c),
                "--rope-dims", str(ROPE_DIMS), "--rule", RULE, "--seed", str(self.seed)]
        if self.to == "egmla":
            args += ["--gate-form", self.gate_form]
            if self.gate_form == "identity":
                args += ["--gate-position", self.gate_position]
        return args


def _arms() -> list[Arm]:
    small = [Arm("mla", 24), Arm("egmla", 24, "kv"), Arm("egmla", 24, "latent")]
    seeds = [Arm(a.to, a.d_c, a.gate_position, seed=s) for s in (1, 2) for a in small]
    rest = [Arm("mla", 48), Arm("egmla", 48, "kv"), Arm("egmla", 48, "latent"), Arm("mla", 96),
            Arm("egmla", 24, "kv", gate_form="paper"),
            Arm("mla", 24, transfer_steps=CURVE_STEPS[0])]
    return small + seeds + rest


# The smallest cache's three arms first (the headline, with their seeds), then the rest.
ARMS = _arms()


# --------------------------------------------------------------------------------------------
# Records


def _context() -> dict[str, Any]:
    from egmla.provenance import provenance

    info = provenance()
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:
        pass
    return info


class Measurer:
    """The original model, the held-out windows, and the measurements of an export."""

    def __init__(self) -> None:
        import torch

        from egmla.imports import load_pretrained
        from studies.upcycling.quality import eval_windows

        torch.manual_seed(0)
        self.original, self.tokenizer = load_pretrained(SOURCE, dtype=torch.float32)
        self.original.eval()
        self.windows = {d: eval_windows(self.tokenizer, d) for d in ("recovery", "corpus")}

    def measure(self, model) -> dict[str, Any]:
        from studies.upcycling.quality import quality

        model.eval()
        spec = model.cache_spec()
        import torch

        out = {d: quality(model, self.original, w) for d, w in self.windows.items()}
        out["kv_elements_per_token"] = spec.elements_per_token()
        out["kv_bytes_per_token_bf16"] = spec.bytes_per_token(torch.bfloat16)
        out["params"] = model.num_params()
        out["params_without_lookup_tables"] = model.num_params(include_gate_tables=False)
        return out


# --------------------------------------------------------------------------------------------
# Phase 1: the training-free table


def step0_plan() -> list[dict[str, Any]]:
    rows = [{"to": "mla", "d_c": d, "rule": r, "svd": "whitened"}
            for d in SIZES for r in ("2norm", "uniform", "high")]
    rows += [{"to": "mla", "d_c": d, "rule": RULE, "svd": "plain"} for d in SIZES]
    rows += [{"to": "mla", "d_c": 3 * (128 - ROPE_DIMS), "rule": r, "svd": "whitened"}
             for r in ("2norm", "uniform", "high")]  # full rank: partial RoPE's cost alone
    rows += [{"to": "egmla", "d_c": d, "rule": RULE, "svd": "whitened", "gate_position": p}
             for d in SIZES[1:] for p in ("kv", "latent")]
    rows += [{"to": "egmla", "d_c": SIZES[-1], "rule": RULE, "svd": "whitened",
              "gate_form": "paper"}]
    return rows


def _key(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True)


def step0(results: Path, log) -> None:
    path = results / "step0.json"
    record = read_record(path) or {"rows": []}
    done = {_key(r["conversion"]) for r in record["rows"]}
    todo = [r for r in step0_plan() if _key(r) not in done]
    if not todo:
        log("step0: done")
        return
    from egmla.upcycle import calibration_stats, upcycle
    from egmla.upcycle.__main__ import calibration_ids

    measurer = Measurer()
    if "original" not in record:
        record["original"] = measurer.measure(measurer.original)
    calibration = calibration_ids(measurer.tokenizer, 32768, 512)
    stats = calibration_stats(measurer.original, calibration)
    for row in todo:
        started = time.perf_counter()
        result = upcycle(measurer.original, rope_dims=ROPE_DIMS, calibration=calibration,
                         stats=stats, **row)
        entry = {"conversion": row, **measurer.measure(result.model),
                 "energy_kept_mean": sum(result.energy) / len(result.energy),
                 "energy_kept_min": min(result.energy),
                 **({"gate": result.gate} if result.gate else {}),
                 "seconds": round(time.perf_counter() - started, 1)}
        record["rows"].append(entry)
        record["context"] = _context()
        record["calibration_tokens"] = int(calibration.numel())
        write_json(path, record)
        log(f"step0: {row} ppl {entry['recovery']['ppl']:.1f} / {entry['corpus']['ppl']:.1f} "
            f"kl {entry['recovery']['kl']:.3f} / {entry['corpus']['kl']:.3f}")
    (results / "step0.md").write_text(step0_markdown(record))


def step0_markdown(record: dict[str, Any]) -> str:
    o = record["original"]
    lines = ["# Training-free conversion of SmolLM2-135M-Instruct (step 0)", "",
             f"Held-out perplexity and KL(original || converted) in nats per token; "
             f"{o['recovery']['tokens']:,} tokens per domain. Original: perplexity "
             f"{o['recovery']['ppl']:.2f} (recovery domain), {o['corpus']['ppl']:.2f} "
             f"(embedded corpus); {o['kv_elements_per_token']:,} cached elements per token.", "",
             "| target | d_c | rule | SVD | gate | KV elem./token | energy kept (mean, min) "
             "| ppl recovery | ppl corpus | KL recovery | KL corpus |",
             "|---|---:|---|---|---|---:|---|---:|---:|---:|---:|"]
    for r in record["rows"]:
        c = r["conversion"]
        gate = ("" if c["to"] == "mla" else
                "paper" if c.get("gate_form") == "paper" else f"identity, {c['gate_position']}")
        lines.append(
            f"| {c['to']} | {c['d_c']} | {c['rule']} | {c['svd']} | {gate} | "
            f"{r['kv_elements_per_token']:,} | {r['energy_kept_mean']:.3f}, "
            f"{r['energy_kept_min']:.3f} | {r['recovery']['ppl']:.1f} | {r['corpus']['ppl']:.1f} "
            f"| {r['recovery']['kl']:.3f} | {r['corpus']['kl']:.3f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Phase 2: recovery


def train_command(arm: Arm, run_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "experiment=upcycle_smollm2",
            f"init={run_dir / 'init'}", f"seed={arm.seed}", f"name=upcycle-{arm.name}",
            f"hydra.run.dir={run_dir}", f"distill.transfer_steps={arm.transfer_steps}",
            "wandb.mode=offline", *extra]


def points(run_dir: Path) -> dict[int, Path]:
    """The exports of a run by optimizer step, as its config.json says: 0 (the conversion),
    the curve's (export_steps), the final (trainer.max_steps)."""
    config = read_record(run_dir / "config.json") or {}
    last = config.get("trainer", {}).get("max_steps", STEPS)
    found = {0: run_dir / "init"}
    found.update({s: run_dir / "exports" / f"step{s}" for s in config.get("export_steps", [])
                  if s < last})
    found[last] = run_dir / "export"
    return found


def tokens_per_step(run_dir: Path) -> int:
    data = (read_record(run_dir / "config.json") or {}).get("data", {})
    accumulate = (read_record(run_dir / "config.json") or {}).get("trainer", {}).get(
        "accumulate_grad_batches", 1)
    return data.get("batch_size", 8) * data.get("seq_len", 512) * accumulate


def table_rows_trained(init: Path, final: Path) -> dict[str, int] | None:
    """EG-MLA: how many of the gate tables' rows changed during recovery (a row changes only
    when its token was read, AdamW with no weight decay on tables), of how many."""
    from egmla.checkpoint import read_weights

    a, b = read_weights(init / "model.safetensors"), read_weights(final / "model.safetensors")
    names = [k for k in a if k.endswith("gate_table.weight")]
    if not names:
        return None
    changed = sum(int((a[k] != b[k]).any(-1).sum()) for k in names)
    rows = sum(a[k].shape[0] for k in names)
    per_table = sorted({int((a[k] != b[k]).any(-1).sum()) for k in names})
    return {"tables": len(names), "rows_per_table": a[names[0]].shape[0],
            "rows_changed_total": changed, "rows_total": rows,
            "rows_changed_per_table_min_max": [per_table[0], per_table[-1]]}


# One precision a seed: the runs of a seed are compared with one another (the smallest cache's
# three arms pair by seed; seed 0's arms also across sizes, and the transfer stage against KL
# alone), and bf16 autocast against fp32 is a difference of recipe that pairing by seed would
# otherwise leave inside each pair. The machines vary from session to session, some with native
# bf16 and some without, where bf16 runs at a twentieth of fp32's speed.
PRECISIONS = {
    "seed": "a started run keeps its first start's precision; a new run takes the one its seed's "
            "runs trained in (else this machine's, as auto); a run that needs bf16 on a CPU "
            "without native bf16 waits for one (default)",
    "machine": "every start in this machine's precision (trainer.precision=auto)",
    "32-true": "every run in float32",
    "bf16-mixed": "every run in bf16 autocast",
}


def started_precision(arm: Arm, runs_dir: Path, results: Path) -> str | None:
    """The precision `arm`'s run trained in at its first start (its record, else its run
    directory's run_info.json); None where it has not started."""
    for info in (read_record(results / "runs" / f"{arm.name}.json"),
                 read_record(runs_dir / arm.name / "run_info.json")):
        starts = (info or {}).get("starts") or []
        if starts and starts[0].get("precision"):
            return starts[0]["precision"]
    return None


def run_precision(arm: Arm, policy: str, runs_dir: Path, results: Path,
                  native_bf16: bool) -> str | None:
    """The `trainer.precision` `arm` trains in under `policy` (PRECISIONS), or None where it
    must wait for a CPU with native bf16."""
    if policy != "seed":
        return "auto" if policy == "machine" else policy
    precision = started_precision(arm, runs_dir, results) or next(
        (p for other in ARMS if other.seed == arm.seed
         and (p := started_precision(other, runs_dir, results))), "auto")
    return None if "bf16" in precision and not native_bf16 else precision


def is_complete(arm: Arm, results: Path) -> bool:
    return bool((read_record(results / "runs" / f"{arm.name}.json") or {}).get("complete"))


def train_arm(arm: Arm, runs_dir: Path, results: Path, extra: list[str], log,
              measurer_box: list, depth: tuple[str, ...] = ("context", "lm_eval"),
              lm_eval_limit: int | None = None) -> None:
    """Convert, recover, measure every point; an arm measured in depth also gets its context
    curve and lm-eval scores (`depth`: which of them) before its record is complete."""
    path = results / "runs" / f"{arm.name}.json"
    if is_complete(arm, results):
        return
    record = read_record(path)
    run_dir = runs_dir / arm.name
    from egmla.checkpoint import is_export

    if not is_export(run_dir / "init"):
        run_logged([sys.executable, "-m", "egmla.upcycle", *arm.convert_args(),
                    "--out", str(run_dir / "init"), "--overwrite"], run_dir / "convert.log", log)
    if not is_export(run_dir / "export"):  # a resumed run's log keeps its earlier starts
        run_logged(train_command(arm, run_dir, extra), run_dir / "train.log", log, append=True)
    if not measurer_box:
        measurer_box.append(Measurer())
    measurer = measurer_box[0]
    from egmla.checkpoint import load_export

    record = record or {"arm": asdict(arm), "name": arm.name, "family": arm.family,
                        "points": {}}
    for step, export in points(run_dir).items():
        if str(step) in record["points"]:
            continue
        if not is_export(export):
            raise PipelineError(f"{export}: missing (the run did not write it)")
        record["points"][str(step)] = {"tokens": step * tokens_per_step(run_dir),
                                       **measurer.measure(load_export(export))}
    info = read_record(run_dir / "run_info.json") or {}
    summary = read_record(run_dir / "summary.json") or {}
    conversion = read_record(run_dir / "init" / "config.json") or {}
    record.update({
        "conversion": conversion.get("extra", {}).get("upcycle"),
        "fit_seconds": summary.get("fit_seconds"),  # the last start's
        "fit_seconds_all_starts": summary.get("fit_seconds_all_starts"),
        "val_loss": summary.get("val_loss"),
        "starts": [{"time": s.get("time_utc"), **{k: s.get(k) for k in (
            "git", "hardware", "resumed_from", "precision")}} for s in info.get("starts", [])],
        "gate_rows": table_rows_trained(run_dir / "init", run_dir / "export"),
        "context": _context(), "complete": True,
    })
    if measured_in_depth(arm):  # while its exports exist; the record completes after them
        jobs = depth_jobs([arm], runs_dir)
        if "context" in depth:
            context(jobs, results, log)
        if "lm_eval" in depth:
            lm_eval(jobs, runs_dir, results, log, lm_eval_limit)
    write_json(path, record)
    final = record["points"][str(max(map(int, record["points"])))]
    log(f"{arm.name}: ppl {final['recovery']['ppl']:.2f} / {final['corpus']['ppl']:.2f}, "
        f"KL {final['recovery']['kl']:.3f} / {final['corpus']['kl']:.3f}")


# --------------------------------------------------------------------------------------------
# Phases 3 and 4: long context and lm-eval, at 0 and at the final budget: the original once,
# and one run of each arm, measured right after it trains (run directories, and so the
# exports, do not outlive the machine a session ran on)


def measured_in_depth(arm: Arm) -> bool:
    """Whether the context curve and lm-eval measure this run: its family's last seed (seed 2
    of the smallest cache's three arms, seed 0 of the others). The step-0 model does not
    depend on the seed (an identity-start gate multiplies its tables by zero)."""
    return arm.seed == max(a.seed for a in ARMS if a.family == arm.family)


def depth_jobs(arms: list[Arm], runs_dir: Path) -> list[tuple[str, str, Path | None]]:
    """(name, step, export) for the original (export None) and, per arm measured in depth
    whose run directory is here, its conversion and its final export."""
    jobs: list[tuple[str, str, Path | None]] = [("original", "0", None)]
    for arm in arms:
        run_dir = runs_dir / arm.name
        if measured_in_depth(arm) and (run_dir / "config.json").is_file():
            found = points(run_dir)
            jobs += [(arm.name, "0", found[0]), (arm.name, str(max(found)), found[max(found)])]
    return jobs


def context(jobs: list[tuple[str, str, Path | None]], results: Path, log) -> None:
    from egmla.checkpoint import is_export, load_export
    from studies.upcycling.quality import LONG_WINDOW, LONG_WINDOWS, context_curve, eval_windows

    path = results / "context.json"
    record = read_record(path) or {"curves": {}}
    windows = original = None
    for name, step, export in jobs:
        key = f"{name}@{step}"
        if key in record["curves"] or (export is not None and not is_export(export)):
            continue
        if windows is None:
            from egmla.imports import load_pretrained

            original, tokenizer = load_pretrained(SOURCE)
            windows = eval_windows(tokenizer, "corpus", LONG_WINDOWS, LONG_WINDOW)
        model = original if export is None else load_export(export)
        started = time.perf_counter()
        record["curves"][key] = context_curve(model.eval(), windows)
        record["context"] = _context()
        write_json(path, record)
        log(f"context {key}: {time.perf_counter() - started:.0f} s")


def lm_eval(jobs: list[tuple[str, str, Path | None]], runs_dir: Path, results: Path, log,
            limit: int | None = None) -> None:
    from egmla.checkpoint import is_export
    from eval.compare import lm_eval_metrics

    path = results / "lm_eval.json"
    record = read_record(path) or {"scores": {}}
    for name, step, export in jobs:
        key = f"{name}@{step}"
        if key in record["scores"] or (export is not None and not is_export(export)):
            continue
        out = runs_dir / "lm_eval" / key.replace("@", "-")
        cmd = [sys.executable, "-m", "eval.lm_eval", "--model", "egmla", "--model_args",
               f"pretrained={SOURCE if export is None else export}", "--tasks",
               ",".join(LM_EVAL_TASKS), "--include_path", str(ROOT / "eval" / "tasks"),
               "--output_path", str(out / "eval"), "--batch_size", "8",
               *(["--limit", str(limit)] if limit else [])]
        run_logged(cmd, out / "lm_eval.log", log)
        record["scores"][key] = lm_eval_metrics(out)
        record["tasks"], record["limit"] = list(LM_EVAL_TASKS), limit
        record["context"] = _context()
        write_json(path, record)


def unmeasured(arms: list[Arm], results: Path) -> list[str]:
    """The arms measured in depth whose record is complete but whose context curve or lm-eval
    scores are missing (their exports went with an earlier machine: train them again)."""
    curves = (read_record(results / "context.json") or {}).get("curves", {})
    scores = (read_record(results / "lm_eval.json") or {}).get("scores", {})
    missing = []
    for arm in arms:
        record = read_record(results / "runs" / f"{arm.name}.json") or {}
        if measured_in_depth(arm) and record.get("complete"):
            final = f"{arm.name}@{max(map(int, record['points']))}"
            if final not in curves or final not in scores:
                missing.append(arm.name)
    return missing


# --------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    from serve.__main__ import positive_int

    p = argparse.ArgumentParser(prog="python -m studies.upcycling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="arms: " + ", ".join(a.name for a in ARMS))
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                   help="which phases, in their order (default: all)")
    p.add_argument("--runs-dir", type=output_directory, default=ROOT / "runs" / "upcycle",
                   help="run directories (default runs/upcycle)")
    p.add_argument("--results", type=output_directory, default=ROOT / "benchmarks" / "results" / "upcycle",
                   help="the record (default benchmarks/results/upcycle)")
    p.add_argument("--arms", nargs="+", default=None, help="only these arms (by name)")
    p.add_argument("--lm-eval-limit", type=positive_int, default=None,
                   help="score only the first documents of each task (a rehearsal)")
    p.add_argument("--precision", choices=PRECISIONS, default="seed",
                   help="what each recovery run trains in: " + "; ".join(
                       f"{k}: {v}" for k, v in PRECISIONS.items()))
    p.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="more train.py overrides (a rehearsal: trainer.max_steps=...)")
    args = p.parse_args(argv)

    def log(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    unknown = sorted(set(args.arms or ()) - {a.name for a in ARMS})
    if unknown:
        p.error(f"--arms {', '.join(unknown)}: unknown; the arms are listed by --help")
    arms = [a for a in ARMS if args.arms is None or a.name in args.arms]
    try:
        if "step0" in args.phases:
            step0(args.results, log)
        if "train" in args.phases:
            box: list = []
            depth = tuple(p for p in ("context", "lm_eval") if p in args.phases)
            from egmla.devices import native_bf16

            waiting = []
            for arm in (a for a in arms if not is_complete(a, args.results)):
                precision = run_precision(arm, args.precision, args.runs_dir, args.results,
                                          native_bf16())
                if precision is None:
                    waiting.append(arm.name)
                    continue
                train_arm(arm, args.runs_dir, args.results,
                          [f"trainer.precision={precision}", *args.train_args], log, box, depth,
                          args.lm_eval_limit)
            if waiting:
                log(f"waiting for a CPU with native bf16 (AVX512-BF16 or AMX), where their "
                    f"seeds' runs trained in bf16-mixed: {', '.join(waiting)} "
                    f"(--precision machine trains them here in this machine's precision)")
        if "context" in args.phases:
            context(depth_jobs(arms, args.runs_dir), args.results, log)
        if "lm_eval" in args.phases:
            lm_eval(depth_jobs(arms, args.runs_dir), args.runs_dir, args.results, log,
                    args.lm_eval_limit)
        if {"context", "lm_eval"} & set(args.phases):
            for name in unmeasured(arms, args.results):
                log(f"{name}: no context curve or lm-eval scores, and its exports are gone: "
                    f"delete {args.results / 'runs' / (name + '.json')} to train it again")
        if "summary" in args.phases:
            from studies.upcycling.summary import write_summary

            write_summary(args.results, log)
    except PipelineError as err:
        print(f"python -m studies.upcycling: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
