"""Activation locality measured (issue 19): dense against sparse MLP decoding in our engine.

For each `--model` (an export directory of a trained model, or SmolLM2-135M-Instruct), the
modes of egmla.models.sparse_ffn that apply to it:

- `dense`: every neuron (the fused decode kernel, as served by default);
- `gate`: the deciding projection for every neuron, the rest of the MLP where it fires: exact
  for the ReLU family; for SwiGLU a magnitude threshold (TEAL/CATS-style), an approximation:
  the predictors' own (one, or one per layer) where the model has predictors, else one per
  layer calibrated for `--swiglu-sparsity` (CATS), else `--swiglu-threshold`;
- `oracle`: the firing set from a dense pass, then the sparse arithmetic (exact; a check that
  the sparse path is what it should be, slower than dense by design);
- `predicted`: the hot block and what the per-layer predictors mark, when the model has
  predictors (`python -m studies.locality predictors --model M` writes them where this script looks:
  M/locality/predictors.safetensors, or runs/locality/<name>/ for a known name; or `--predictors`).

What is measured, per model and mode:

1. decode tok/s at each `--batch-sizes` (1, 4, 16): B distinct prompts of `--prompt-len` tokens
   of held-out text (corpus-b), `--new-tokens` each, greedy; decode tok/s = B (N - 1) / (last
   finish - last first token), so prefill is excluded; the median over `--repeats`, interleaved
   (for repeat: for batch: for mode, the mode order rotating); `speedup` = tok/s over dense's
   (the ratio of the medians), and `paired_vs_dense` each repeat's ratio to dense's run beside
   it, their median and interval (the figure to quote: the machine is shared);
2. density: the share of MLP neurons computed per decode step (the kernels count them), and the
   weight bytes a decode step reads per generated token (every weight once per step, the MLP's
   at that density: gate mode reads its deciding matrix whole, predicted mode its predictors);
3. perplexity of held-out text (corpus-b) with each token's MLPs keeping only the neurons the
   mode computes for it, against dense;
4. the offline lm-eval tasks (corpus_cloze, corpus_perplexity, mqar_recall: loglikelihood
   tasks) under the same masks (oracle computes exactly dense, so it is not run again);
5. predicted mode: the hot block's share of the firings (its hit rate) and the predictors'
   recall and density on the held-out tokens.
Each model's entry records its predictors file's sha256 and, from the predictors.json beside it
(written with the file by `python -m studies.locality predictors`), the command, commit and
time that made them. For SmolLM2 also llama.cpp F32 through cyllama (the `bench` extra) at
batch 1, the dense peer, its runs taking their turn among our modes'; our trained models have
no llama.cpp architecture (their MLPs are not SwiGLU).

    python benchmarks/activation_locality.py --model runs/locality-drelu-s0/export ...
    python benchmarks/activation_locality.py --model SmolLM2-135M-Instruct --swiglu-sparsity 0.5
    python benchmarks/activation_locality.py --model M --quick    # a smoke test, a minute

Writes benchmarks/results/activation_locality.{json,md} (`*_quick.*` with --quick) with the
command, git SHA, versions, machine and load; the JSON names every speedup with a key that
contains `speedup`. After each model its results are kept in `<out>/<stem>.json.partial`: a
rerun with the same settings (after a stop: a session's end, a lost machine) keeps the models
that one finished and measures the rest (`--fresh`: all again); each model records when, at
which commit and under what load it was measured. `--add` adds the models to the record in
`--out` (same settings) instead of replacing it, as studies.locality.runs does model by model.
Compare modes within one model, measured side by side, not across models or runs: the machine
is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in
from egmla.devices import thread_count  # noqa: E402
from egmla.files import output_directory  # noqa: E402
from eval.local_tasks import group_tasks  # noqa: E402  (after the path: this checkout's eval)
from eval.stats import paired_ratios  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TASKS = group_tasks("egmla_loglikelihood")  # eval/tasks/egmla_loglikelihood.yaml
SMOLLM2 = "SmolLM2-135M-Instruct"
# arguments that are not settings shared by a record's models: each model's entry records the
# thresholds it was measured at
PER_MODEL = ("model", "predictors", "out", "fresh", "add", "swiglu_threshold", "swiglu_sparsity")


# ---- the model and its modes ------------------------------------------------------------------


class Subject:
    """One model, loaded once, its neurons in its predictors' order (if any), and the modes that
    apply to it; `use(mode)` attaches that mode's sparse decoding (None: dense)."""

    def __init__(self, name: str, predictors: Path | None, swiglu_threshold: float,
                 swiglu_sparsity: float | None, max_batch: int, max_tokens: int) -> None:
        import torch

        from egmla.checkpoint import CheckpointError, read_metadata, read_weights
        from egmla.imports import load_pretrained
        from egmla.models.sparse_ffn import (layer_thresholds, predictors_from_tensors,
                                             reorder_neurons)
        from studies.locality import default_out, sparsity_thresholds
        from serve import LLM

        self.name = name
        self.model, self.tokenizer = load_pretrained(name, dtype=torch.float32)
        if self.tokenizer is None:
            raise SystemExit(f"error: {name}: no tokenizer comes with it")
        cfg = self.model.config
        self.ffn = cfg.ffn
        found = predictors or default_out(name) / "predictors.safetensors"
        self.predictors, self.predictors_file, trained_at = None, None, None
        self.sparsity = None  # the target sparsity the thresholds were calibrated for
        if found.is_file():
            metadata, tensors = read_metadata(found), read_weights(found)  # CheckpointError
            try:
                self.predictors, trained_at = predictors_from_tensors(
                    tensors, metadata, cfg.n_layers, cfg.d_ff)
            except ValueError as err:
                raise CheckpointError(f"{found}: not predictors of {name} ({err})") from None
            if (metadata or {}).get("sparsity"):
                self.sparsity = float(metadata["sparsity"])
            reorder_neurons(self.model, self.predictors)  # the function is unchanged
            self.predictors_file = str(found)
        elif predictors is not None:
            raise SystemExit(f"error: --predictors {predictors}: no such file")
        swiglu = self.ffn == "swiglu"
        if trained_at is not None:
            self.threshold = trained_at
        elif swiglu and swiglu_sparsity is not None:
            self.threshold = sparsity_thresholds(self.model, self.tokenizer, swiglu_sparsity)
            self.sparsity = swiglu_sparsity
        else:
            self.threshold = swiglu_threshold if swiglu else 0.0
        self.thresholds = layer_thresholds(self.threshold, cfg.n_layers)
        if swiglu and not all(self.thresholds):
            raise SystemExit(f"error: {name} is SwiGLU: give --swiglu-threshold > 0 or "
                             "--swiglu-sparsity")
        self.modes = ["dense", "gate", *([] if swiglu else ["oracle"]),
                      *(["predicted"] if self.predictors else [])]
        block = 16
        self.llm = LLM(self.model, self.tokenizer, block_size=block,
                       num_blocks=max_batch * (max_tokens // block + 2) + 4,
                       max_num_seqs=max_batch, enable_prefix_caching=False)

    def use(self, mode: str) -> list:
        from egmla.models.sparse_ffn import sparsify

        if mode == "dense":
            return sparsify(self.model, None)
        return sparsify(self.model, mode, self.threshold,
                        self.predictors if mode == "predicted" else None, reorder=False)

    def keep(self, mode: str):
        """The mask of the neurons `mode` computes for each token (studies.locality.predictors.perplexity's
        `keep`), None for dense and oracle (exactly dense)."""
        from egmla.models.sparse_ffn import firing

        if mode in ("dense", "oracle"):
            return None
        if mode == "gate":
            return lambda i, mlp, x: firing(mlp, x, self.thresholds[i])

        def predicted(i, mlp, x):
            layer = self.predictors[i]
            mask = layer.predictor(x)
            mask[:, :layer.hot] = True
            return mask & firing(mlp, x, self.thresholds[i])
        return predicted


# ---- speed ------------------------------------------------------------------------------------


def decode_run(subject: Subject, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """One batch of prompts, all submitted at once; decode tok/s with prefill excluded."""
    from serve import SamplingParams

    engine = subject.llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    seqs = [engine.release(i)[0] for i in ids]
    start, end = max(s.first_token_time for s in seqs), max(s.finish_time for s in seqs)
    made = sum(len(s.output) - 1 for s in seqs)
    return {"tok_s": made / (end - start), "tokens": made}


def weight_bytes_per_token(model, density: float, mode: str, predictors, batch: int) -> float:
    """Weight bytes one decode step reads per generated token (the step's reads over its rows):
    every parameter once (the input embedding only where it is the tied output head), the
    MLPs' matrices at the computed share of their neurons; gate mode reads its deciding matrix
    whole, predicted mode its predictors."""
    emb, head = model.tok_emb.weight, model.lm_head.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if emb is not head:
        total -= emb.numel() * emb.element_size()
    for i, block in enumerate(model.layers):
        mlp = block.mlp
        mats = [w.weight for w in (mlp.w_gate, mlp.w_up, mlp.w_down) if w is not None]
        each = mats[0].numel() * mats[0].element_size()
        total -= len(mats) * each
        if mode in ("dense", "oracle"):
            total += len(mats) * each
        elif mode == "gate":
            total += each + (len(mats) - 1) * each * density
        else:
            p = predictors[i].predictor
            total += len(mats) * each * density + 4 * p.params()
    return total / batch


def measure_speed(subject: Subject, prompts: list[list[int]], batches: list[int], new_tokens: int,
                  repeats: int, log, peer=None) -> tuple[list[dict[str, Any]], list[float]]:
    """Each mode's decode runs at each batch size, the modes interleaved (their order rotates
    each repeat); with `peer` (a function (prompt, new_tokens) -> decode tok/s), a peer system's
    batch-1 run takes its turn among the modes. The rows, and the peer's tok/s per repeat."""
    runs: dict[tuple[str, int], list[dict]] = {}
    peer_tok_s: list[float] = []
    for r in range(repeats):
        for batch in batches:
            turns = subject.modes + (["peer"] if peer is not None and batch == 1 else [])
            for mode in turns[r % len(turns):] + turns[:r % len(turns)]:
                if mode == "peer":
                    peer_tok_s.append(peer(prompts[0], new_tokens))
                    log(f"{subject.name} {'llama.cpp':9s} batch  1 repeat {r}: "
                        f"{peer_tok_s[-1]:.1f} tok/s")
                    continue
                attached = subject.use(mode)
                decode_run(subject, prompts[:batch], 4)  # warm: kernels, caches, allocator
                for s in attached:
                    s.stats.update(steps=0, rows=0, active=0)
                run = decode_run(subject, prompts[:batch], new_tokens)
                run["density"] = (statistics.fmean(s.density() for s in attached)
                                  if attached else 1.0)
                runs.setdefault((mode, batch), []).append(run)
                log(f"{subject.name} {mode:9s} batch {batch:2d} repeat {r}: {run['tok_s']:.1f} tok/s, "
                    f"density {run['density']:.3f}")
    subject.use("dense")
    rows = []
    for (mode, batch), rs in runs.items():
        tok_s = [x["tok_s"] for x in rs]
        density = statistics.fmean(x["density"] for x in rs)
        rows.append({"mode": mode, "batch": batch, "tok_s": statistics.median(tok_s),
                     "tok_s_min": min(tok_s), "tok_s_max": max(tok_s), "runs": tok_s,
                     "density": density,
                     "weight_bytes_per_token": weight_bytes_per_token(
                         subject.model, density, mode, subject.predictors, batch)})
    dense = {r["batch"]: r for r in rows if r["mode"] == "dense"}
    for r in rows:
        r["speedup_vs_dense"] = r["tok_s"] / dense[r["batch"]]["tok_s"]
        r["paired_vs_dense"] = paired_ratios(r["runs"], dense[r["batch"]]["runs"])
    return sorted(rows, key=lambda r: (r["batch"], subject.modes.index(r["mode"]))), peer_tok_s


def predictors_provenance(path: str | None) -> dict[str, Any] | None:
    """The predictors file's sha256 and what made it: the command, commit and time in the
    predictors.json written beside it (None where there is none)."""
    if path is None:
        return None
    import hashlib

    made = Path(path).with_name("predictors.json")
    meta = json.loads(made.read_text()).get("meta", {}) if made.is_file() else {}
    return {"file": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
            "made_by": {k: meta[k] for k in ("command", "time_utc", "git", "config") if k in meta}
            or None}


def llamacpp_f32(context: int, threads: int):
    """llama.cpp F32 single-stream decode on SmolLM2 (benchmarks/decode_speed.py's runner), as
    a function (prompt, new_tokens) -> decode tok/s; None without the cyllama wheel."""
    import importlib.util

    if importlib.util.find_spec("cyllama") is None:
        return None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode_speed

    runner = decode_speed.LlamaCppRunner(decode_speed.SYSTEMS["llamacpp-f32"], threads,
                                         context, 0, 0)
    return lambda prompt, new_tokens: (new_tokens - 1) / runner.single(prompt, new_tokens)["decode_s"]


# ---- quality ----------------------------------------------------------------------------------


def quality(subject: Subject, held_out, lm_eval_limit: int | None, skip_lm_eval: bool,
            log) -> tuple[list[dict], dict]:
    from studies.locality import predictors as P

    subject.use("dense")
    batches = held_out.split(16)
    dense = P.perplexity(subject.model, batches)
    rows = []
    for mode in subject.modes:
        keep = subject.keep(mode)
        ppl = dense if keep is None else P.perplexity(subject.model, batches, keep)
        row = {"mode": mode, "perplexity": ppl, "perplexity_increase": ppl / dense - 1}
        if not skip_lm_eval and mode != "oracle":
            row["lm_eval"] = lm_eval_under(subject, keep, lm_eval_limit)
        elif not skip_lm_eval:
            row["lm_eval"] = "equal to dense (oracle computes exactly the dense MLP)"
        log(f"{subject.name} {mode:9s} perplexity {ppl:.3f} ({row['perplexity_increase']:+.2%})")
        rows.append(row)
    hot = {}
    if subject.predictors:
        x_fired = P.collect(subject.model, batches, subject.threshold)
        per_layer = []
        for (x, fired), layer in zip(x_fired, subject.predictors):
            m = P.measure(layer.predictor, x, fired, layer.hot, subject.model.config.ffn_matrices)
            hits = fired[:, :layer.hot].sum().item() / max(1, fired.sum().item())
            per_layer.append({"hot": layer.hot, "hot_hit_rate": hits, **m})
        hot = {"layers": per_layer,
               "hot_hit_rate": statistics.fmean(r["hot_hit_rate"] for r in per_layer),
               "recall": statistics.fmean(r["recall"] or 0 for r in per_layer),
               "density": statistics.fmean(r["density"] for r in per_layer)}
    return rows, hot


def lm_eval_under(subject: Subject, keep, limit: int | None) -> dict[str, float]:
    """The offline loglikelihood tasks with each token's MLPs masked as `keep` says."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from eval.adapter import EgmlaLM
    from eval.local_tasks import install

    install()
    hooks = []
    if keep is not None:
        for i, block in enumerate(subject.model.layers):
            def masked(mlp, args, output, i=i):
                x = args[0]
                h = mlp.hidden(x) * keep(i, mlp, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
                return mlp.w_down(h)
            hooks.append(block.mlp.register_forward_hook(masked))
    try:
        results = lm_eval.simple_evaluate(
            model=EgmlaLM(subject.llm, batch_size=8), tasks=list(TASKS), limit=limit,
            task_manager=TaskManager(include_path=str(ROOT / "eval" / "tasks"),
                                     include_defaults=False))
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if filt == "none" and isinstance(value, float) and not name.endswith("_stderr"):
                out[f"{task}/{name}"] = value
    return out


# ---- the run ----------------------------------------------------------------------------------


def held_out_tokens(tokenizer, tokens: int, seq_len: int):
    from studies.locality import source_texts, token_stream, windows

    ids = token_stream(tokenizer, source_texts("corpus-b"), tokens + seq_len)
    return ids, windows(ids, seq_len, tokens)


def render(report: dict[str, Any]) -> str:
    from studies.locality import describe_threshold

    p = report["provenance"]
    lines = ["# Activation locality: dense against sparse MLP decoding", "",
             f"{p['time_utc']} · {p['hardware'].get('cpu')} ({p['hardware'].get('cpu_count')} cores) · "
             f"load {report['load_before']} -> {report['load_after']} · git {p['git']['sha']}"
             f"{' (dirty)' if p['git']['dirty'] else ''} · `{' '.join(report['command'])}`", "",
             f"Decode tok/s: {report['settings']['new_tokens']} new tokens after "
             f"{report['settings']['prompt_len']}-token prompts, prefill excluded, median of "
             f"{report['settings']['repeats']} interleaved repeats (min..max). Density: the share of "
             "MLP neurons computed per step. Bytes: weight bytes a decode step reads per generated "
             "token. Perplexity: held-out corpus-b, each token's MLPs masked as the mode computes.", ""]
    for m in report["models"]:
        when = m.get("measured")
        lines += [f"## {m['model']} ({m['ffn']}, "
                  f"{describe_threshold(m['threshold'], m.get('sparsity'))})", ""]
        if when:
            lines += [f"Measured {when['time_utc']} at git {when['git']['sha']}, load "
                      f"{when['load'][0]} -> {when['load'][1]}.", ""]
        made = m.get("predictors_provenance")
        if made:
            by = made.get("made_by") or {}
            lines += [f"Predictors: `{made['file']}`, sha256 {made['sha256'][:16]}, made "
                      + (f"{by.get('time_utc')} at git {(by.get('git') or {}).get('sha', '?')[:10]} by "
                         f"`{' '.join(by.get('command') or [])}`." if by else
                         "by an unrecorded command (no predictors.json beside it)."), ""]
        lines += ["| mode | batch | tok/s | min..max | speedup vs dense | paired vs dense: median "
                  "(per repeat) | density | MB/token |", "|---|---:|---:|---|---:|---|---:|---:|"]
        for r in m["speed"]:
            pair = r.get("paired_vs_dense")
            paired = (f"{pair['median']:.2f}x ({' '.join(f'{x:.2f}' for x in pair['ratios'])})"
                      if pair else "-")
            lines.append(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.1f} | {r['tok_s_min']:.1f}.."
                         f"{r['tok_s_max']:.1f} | {r['speedup_vs_dense']:.2f}x | {paired} | "
                         f"{r['density']:.3f} | {r['weight_bytes_per_token'] / 1e6:.2f} |")
        if m.get("llamacpp"):
            ours = ", ".join(f"{r['mode']} {r['speedup_vs_llamacpp_f32']:.2f}x" for r in m["speed"]
                             if "speedup_vs_llamacpp_f32" in r)
            lines += ["", f"llama.cpp F32 at batch 1: {m['llamacpp']['tok_s']:.1f} tok/s"
                          + (", its runs interleaved with ours" if m["llamacpp"].get("interleaved")
                             else "") + f"; ours against it: {ours}."]
        tasks = sorted({k for r in m["quality"] if isinstance(r.get("lm_eval"), dict)
                        for k in r["lm_eval"]})
        lines += ["", "| mode | perplexity | vs dense |" + "".join(f" {t} |" for t in tasks),
                  "|---|---:|---:|" + "---:|" * len(tasks)]
        for r in m["quality"]:
            scores = r.get("lm_eval") if isinstance(r.get("lm_eval"), dict) else {}
            lines.append(f"| {r['mode']} | {r['perplexity']:.3f} | {r['perplexity_increase']:+.2%} |"
                         + "".join(f" {scores[t]:.4f} |" if t in scores else " = dense |"
                                   for t in tasks))
        if m.get("hot"):
            h = m["hot"]
            lines += ["", f"Predicted mode: hot-block hit rate {h['hot_hit_rate']:.3f} (share of "
                      f"firings in the hot block), predictor recall {h['recall']:.3f}, density "
                      f"{h['density']:.3f} (held-out tokens, mean over layers)."]
        lines.append("")
    return "\n".join(lines)


def absent_path(name: str) -> bool:
    """`--model name` names a directory that is not there (`/x/y`, `runs/x` where runs/ is): not
    a known name nor a hub id `org/name`, which load_pretrained would look up instead."""
    path = Path(name)
    return not path.exists() and (path.is_absolute() or path.parent != Path(".")
                                  and path.parent.is_dir())


def kept_models(partial: Path, settings: dict[str, Any], fresh: bool, log) -> dict[str, Any]:
    """The models an interrupted run with these settings had finished, by name ({} with --fresh,
    without such a run, or when its settings differ)."""
    if fresh or not partial.is_file():
        return {}
    try:
        kept = json.loads(partial.read_text())
    except (OSError, ValueError) as error:
        log(f"{partial}: unreadable ({error}); measuring every model")
        return {}
    models = kept.get("models", []) if isinstance(kept, dict) else None
    if not (isinstance(models, list) and all(isinstance(m, dict) and "model" in m for m in models)):
        log(f"{partial}: unreadable (not a record of models); measuring every model")
        return {}
    if kept.get("settings") != settings:
        log(f"{partial}: made with other settings; measuring every model")
        return {}
    return {m["model"]: m for m in models}


def recorded_models(record: Path, settings: dict[str, Any], measuring: list[str]
                    ) -> tuple[list[dict[str, Any]], list[Any]]:
    """For --add: the models of an earlier record that are not being measured again, and the
    commands that made it ([], [] without one); ValueError when it cannot be added to."""
    if not record.is_file():
        return [], []
    try:
        old = json.loads(record.read_text())
        models, old_settings = old["models"], old["settings"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--add: {record} is not a benchmark record ({error}); move it away or "
                         "run without --add") from None
    if old_settings != settings:
        differ = sorted(k for k in set(settings) | set(old_settings)
                        if settings.get(k) != old_settings.get(k))
        raise ValueError(f"--add: {record} was measured with other settings ({', '.join(differ)}"
                         "); run without --add to measure anew")
    commands = [*old.get("earlier_commands", []), old.get("command")]
    return [m for m in models if m.get("model") not in measuring], commands


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring for the method.")
    p.add_argument("--model", action="append", required=True,
                   help="an export directory or a known name; repeat for several models")
    p.add_argument("--predictors", action="append", type=Path,
                   help="predictors.safetensors for the --model at the same position (default: "
                        "where `python -m studies.locality predictors` writes them)")
    p.add_argument("--swiglu-threshold", type=float, default=0.05,
                   help="gate mode's threshold for a SwiGLU model without predictors or "
                        "--swiglu-sparsity (0.05)")
    p.add_argument("--swiglu-sparsity", type=float, default=None,
                   help="for a SwiGLU model without predictors: a threshold per layer, "
                        "calibrated so that this share of its neurons is skipped (CATS; 0.5)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--held-out-tokens", type=int, default=16384,
                   help="corpus-b tokens for perplexity and the predictors' hit rate")
    p.add_argument("--lm-eval-limit", type=int, help="documents per lm-eval task (default: all)")
    p.add_argument("--skip-lm-eval", action="store_true")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--out", type=output_directory, default=RESULTS,
                   help="where the JSON and markdown go (default benchmarks/results)")
    p.add_argument("--add", action="store_true",
                   help="add the models to the record already in --out (made with the same "
                        "settings; a model it holds is measured again and replaced) instead of "
                        "writing it anew: a pipeline measures its models as each is ready")
    p.add_argument("--fresh", action="store_true",
                   help="measure every model again, ignoring what an interrupted run kept "
                        "(by default a re-run with the same settings keeps the models it had "
                        "finished: each model's speedups are its own modes side by side)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: batch 1 and 4, 16 new tokens, one repeat, 3 documents a "
                        "task; writes *_quick.*")
    args = p.parse_args(argv)
    if len(set(args.model)) != len(args.model):
        p.error(f"--model: each model once (given {args.model})")
    if args.predictors and len(args.predictors) != len(args.model):
        p.error("--predictors: give one per --model, in the same order")
    for name in ("prompt_len", "new_tokens", "repeats", "held_out_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.lm_eval_limit is not None and args.lm_eval_limit < 1:
        p.error(f"--lm-eval-limit {args.lm_eval_limit}: must be >= 1")
    if any(b < 1 or b > 16 for b in args.batch_sizes):
        p.error(f"--batch-sizes {args.batch_sizes}: each must be in [1, 16] (sparse decoding "
                "takes at most 16 rows)")
    if not 0 <= args.swiglu_threshold < float("inf"):
        p.error(f"--swiglu-threshold {args.swiglu_threshold}: must be a finite number >= 0")
    if args.swiglu_sparsity is not None and not 0 < args.swiglu_sparsity < 1:
        p.error(f"--swiglu-sparsity {args.swiglu_sparsity}: must be in (0, 1)")
    if args.quick:
        args.batch_sizes, args.new_tokens, args.repeats = [1, 4], 16, 1
        args.held_out_tokens, args.lm_eval_limit = 1024, 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from egmla.provenance import provenance

    torch.set_num_threads(args.threads)
    log = lambda message: print(time.strftime("%H:%M:%S"), message, flush=True)  # noqa: E731
    report: dict[str, Any] = {
        "command": ["python", "benchmarks/activation_locality.py", *(argv or sys.argv[1:])],
        "provenance": provenance(), "load_before": round(os.getloadavg()[0], 2),
        "settings": json.loads(json.dumps({k: v for k, v in vars(args).items()
                                           if k not in PER_MODEL})),
        "models": []}
    from egmla.checkpoint import CheckpointError
    from egmla.files import write_bytes

    stem = "activation_locality_quick" if args.quick else "activation_locality"
    earlier: list[dict[str, Any]] = []  # with --add: the record's models not measured now
    if args.add:
        try:
            earlier, commands = recorded_models(args.out / f"{stem}.json", report["settings"],
                                                args.model)
        except ValueError as error:
            print(f"activation_locality: error: {error}", file=sys.stderr)
            return 2
        report["earlier_commands"] = commands
    if missing := next((m for m in args.model if absent_path(m)), None):
        print(f"activation_locality: error: --model {missing}: no such directory", file=sys.stderr)
        return 2
    # checked here, not when the arguments are read: studies.locality parses a benchmark's
    # command to plan it before the predictors it names are made
    from egmla.checkpoint import read_metadata

    for given in args.predictors or []:
        try:
            if not given.is_file():
                raise CheckpointError(f"{given}: no such file")
            read_metadata(given)  # the header only: a file that is not safetensors fails here
        except CheckpointError as error:
            print(f"activation_locality: error: --predictors {error}", file=sys.stderr)
            return 2
    partial = args.out / f"{stem}.json.partial"  # the models an interrupted run had finished
    kept = kept_models(partial, report["settings"], args.fresh, log)
    for i, name in enumerate(args.model):
        if name in kept:
            log(f"{name}: kept from an interrupted run ({partial}; --fresh measures it again)")
            report["models"].append(kept[name])
            continue
        load_before = round(os.getloadavg()[0], 2)
        given = args.predictors[i] if args.predictors else None
        try:
            subject = Subject(name, given, args.swiglu_threshold, args.swiglu_sparsity,
                              max(args.batch_sizes), args.prompt_len + args.new_tokens + 8)
        except CheckpointError as error:  # a model or predictors file that does not load
            print(f"activation_locality: error: {error}", file=sys.stderr)
            return 2
        ids, held_out = held_out_tokens(subject.tokenizer, args.held_out_tokens, 128)
        prompts = [ids[j * args.prompt_len:(j + 1) * args.prompt_len]
                   for j in range(max(args.batch_sizes))]
        log(f"{name}: {subject.ffn}, modes {', '.join(subject.modes)}")
        # llama.cpp beside SmolLM2 (the one model it has the architecture of), at batch 1, its
        # runs interleaved with ours
        peer = (llamacpp_f32(args.prompt_len + args.new_tokens + 8, args.threads)
                if name == SMOLLM2 and 1 in args.batch_sizes else None)
        if name == SMOLLM2 and 1 in args.batch_sizes and peer is None:
            log("llama.cpp not measured: no cyllama here (pip install -e '.[bench]')")
        speed, peer_tok_s = measure_speed(subject, prompts, args.batch_sizes, args.new_tokens,
                                          args.repeats, log, peer)
        rows, hot = quality(subject, held_out, args.lm_eval_limit, args.skip_lm_eval, log)
        entry = {"model": name, "ffn": subject.ffn, "threshold": subject.threshold,
                 "sparsity": subject.sparsity,
                 "predictors": subject.predictors_file,
                 "predictors_provenance": predictors_provenance(subject.predictors_file),
                 "params": subject.model.num_params(),
                 "speed": speed, "quality": rows, "hot": hot}
        if peer_tok_s:
            entry["llamacpp"] = {"system": "llama.cpp F32 (cyllama)", "interleaved": True,
                                 "tok_s": statistics.median(peer_tok_s), "runs": peer_tok_s}
            for r in speed:
                if r["batch"] == 1:
                    r["speedup_vs_llamacpp_f32"] = r["tok_s"] / entry["llamacpp"]["tok_s"]
        entry["measured"] = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "git": report["provenance"]["git"],
                             "load": [load_before, round(os.getloadavg()[0], 2)]}
        report["models"].append(entry)
        write_bytes(partial, json.dumps({"settings": report["settings"],
                                         "models": report["models"]}, default=str).encode(),
                    mode=0o644, parents=True)
    report["models"] = earlier + report["models"]
    report["load_after"] = round(os.getloadavg()[0], 2)
    write_bytes(args.out / f"{stem}.json", (json.dumps(report, indent=2, default=str) + "\n").encode(),
                mode=0o644, parents=True)
    write_bytes(args.out / f"{stem}.md", render(report).encode(), mode=0o644)
    partial.unlink(missing_ok=True)
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
