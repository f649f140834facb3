"""egmla -> `--format hf` -> transformers, per variant: logits difference, greedy generation and
the cache's allocated bytes per token against egmla's analytic figure; plus SmolLM2-135M (MHA)
through both the hf and the native (Llama) format. With `--run`, a trained run is exported and
scored by lm-eval's own `hf` model and by `--model egmla` on the offline corpus_cloze task.

    python benchmarks/export_roundtrip.py --out benchmarks/results/export_roundtrip \
        --run runs/quickstart --limit 200

Writes OUT.md (a table) and OUT.json (the figures, the machine, git SHA and versions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in

from egmla.checkpoint import CheckpointError, is_export  # noqa: E402
from egmla.files import output_prefix, write_json, write_text  # noqa: E402
from egmla.config import ModelConfig  # noqa: E402
from egmla.export import save_native  # noqa: E402
from egmla.export.hf import save_hf, transformers_cache_spec  # noqa: E402
from egmla.generate import generate  # noqa: E402
from egmla.imports import load_pretrained  # noqa: E402
from egmla.models.transformer import Transformer  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

MLA = {"d_c": 64, "d_nope": 32, "d_rope": 16, "d_v": 32}
VARIANTS = {
    "MHA": {"type": "mha"},
    "GQA-2": {"type": "mha", "n_kv_heads": 2},
    "MLA": {"type": "mla", **MLA},
    "EG-MLA kv": {"type": "egmla", **MLA, "d_e": 64, "gate_group_size": 2},
    "EG-MLA latent": {"type": "egmla", **MLA, "d_e": 64, "gate_position": "latent"},
}
NEW_TOKENS = 32


def lm_eval_scores(module: str, model: str, model_args: str, limit: int, out: Path) -> dict:
    """One lm-eval command line on corpus_cloze: accuracy and every logged loglikelihood."""
    cmd = [sys.executable, "-m", module, "--model", model, "--model_args", model_args,
           "--tasks", "corpus_cloze", "--include_path", str(ROOT / "eval" / "tasks"),
           "--limit", str(limit), "--batch_size", "8", "--device", "cpu",
           "--output_path", str(out), "--log_samples"]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_corpus_cloze_*.jsonl")
    lines = sorted((json.loads(x) for x in samples.read_text().splitlines()),
                   key=lambda x: x["doc_id"])
    metrics = json.loads(results.read_text())["results"]["corpus_cloze"]
    return {"command": " ".join(cmd[1:]), "acc": metrics["acc,none"],
            "acc_norm": metrics["acc_norm,none"],
            "loglikelihoods": [float(r[0][0]) for x in lines for r in x["resps"]]}


def compare_lm_eval(run: Path, limit: int, tmp: Path) -> dict:
    from egmla.export import export

    hf_dir = export(run, tmp / "run-hf", format="hf")
    theirs = lm_eval_scores("lm_eval", "hf", f"pretrained={hf_dir},trust_remote_code=True,"
                            "dtype=float32", limit, tmp / "lm-eval-hf")
    ours = lm_eval_scores("eval.lm_eval", "egmla", f"pretrained={run}", limit,
                          tmp / "lm-eval-egmla")
    diffs = [abs(a - b) for a, b in zip(ours.pop("loglikelihoods"), theirs.pop("loglikelihoods"))]
    return {"run": str(run), "task": "corpus_cloze", "limit": limit, "hf": theirs,
            "egmla": ours, "requests": len(diffs), "max_abs_loglikelihood_diff": max(diffs)}


def cached_bytes(cache) -> int:
    """Storage of every tensor a transformers cache holds (EgmlaCache or Llama's DynamicCache)."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    tensors += [t for t in [getattr(cache, "token_ids", None)] if t is not None]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def measure(name: str, model: Transformer, directory: Path) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
        prompt = ids[:1, :16]
        out = hf.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        ours = generate(model, prompt, max_new_tokens=NEW_TOKENS)
    cache = getattr(out, "cache", None) or out.past_key_values
    dtype = next(model.parameters()).dtype
    return {
        "model": name,
        "format": "native" if type(hf).__name__ == "LlamaForCausalLM" else "hf",
        "class": type(hf).__name__,
        "params": model.num_params(),
        "max_abs_logit_diff": diff,
        "greedy_equal": out.sequences.tolist() == ours.tolist(),
        "cache_class": type(cache).__name__,
        "cache_bytes_per_token": cached_bytes(cache) / cache.get_seq_length(),
        "analytic_bytes_per_token": transformers_cache_spec(model.config).bytes_per_token(dtype),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=output_prefix, required=True, help="path prefix for .md and .json")
    p.add_argument("--no-smollm2", action="store_true", help="skip the 135M pretrained model")
    p.add_argument("--run", type=Path,
                   help="a trained run (with its export/) to score through lm-eval both ways")
    p.add_argument("--limit", type=positive_int, default=200, help="corpus_cloze items for --run")
    args = p.parse_args(argv)
    if args.run:
        if not is_export(args.run / "export"):
            p.error(f"--run {args.run}: not a training run with an export ({args.run / 'export'} "
                    "is not an egmla export)")
        args.run = args.run.resolve()  # lm-eval runs from the checkout's root
    rows, lm_eval = [], None
    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            try:
                lm_eval = compare_lm_eval(args.run, args.limit, Path(tmp))
            except CheckpointError as err:
                p.error(f"--run {args.run}: {err}")
            print(lm_eval, flush=True)
        for name, attention in VARIANTS.items():
            torch.manual_seed(0)
            config = ModelConfig.from_dict({"vocab_size": 4096, "d_model": 256, "n_layers": 4,
                                            "n_heads": 8, "attention": attention, "init_std": 0.1})
            model = Transformer(config).eval()
            safe = name.replace(" ", "_").replace("-", "")  # the directory names a Python module
            rows.append(measure(name, model, save_hf(model, Path(tmp) / safe)))
            print(rows[-1], flush=True)
        if not args.no_smollm2:
            model, _ = load_pretrained("SmolLM2-135M-Instruct")
            rows.append(measure("SmolLM2-135M", model, save_hf(model, Path(tmp) / "smol-hf")))
            print(rows[-1], flush=True)
            rows.append(measure("SmolLM2-135M", model, save_native(model, Path(tmp) / "smol-nat")))
            print(rows[-1], flush=True)
    header = ("| model | format | transformers class | params | max abs logit diff | greedy "
              f"{NEW_TOKENS} equal | cache | bytes/token measured | analytic |")
    lines = [header, "|---|---|---|---:|---:|---|---|---:|---:|"]
    for r in rows:
        measured = f"{r['cache_bytes_per_token']:,.0f}"
        lines.append(f"| {r['model']} | {r['format']} | {r['class']} | {r['params']:,} | "
                     f"{r['max_abs_logit_diff']:.2e} | {r['greedy_equal']} | {r['cache_class']} | "
                     f"{measured} | {r['analytic_bytes_per_token']:,} |")
    if lm_eval:
        h, e = lm_eval["hf"], lm_eval["egmla"]
        lines += ["", (f"lm-eval on `{lm_eval['run']}` exported with `--format hf`, corpus_cloze "
                  f"(limit {lm_eval['limit']}, {lm_eval['requests']} loglikelihood requests):"), "",
                  "| model | acc | acc_norm |", "|---|---:|---:|",
                  f"| `lm_eval --model hf` on the export | {h['acc']:.4f} | {h['acc_norm']:.4f} |",
                  f"| `--model egmla` on the run | {e['acc']:.4f} | {e['acc_norm']:.4f} |", "",
                  f"Largest loglikelihood difference: {lm_eval['max_abs_loglikelihood_diff']:.2e}"]
    info = provenance()
    write_json(args.out.with_suffix(".json"), {"rows": rows, "lm_eval": lm_eval, **info},
               indent=2, parents=True)
    machine = info["hardware"]
    write_text(
        args.out.with_suffix(".md"),
        "# Export round trip: egmla -> transformers\n\nfloat32, "
        f"{machine.get('cpu', 'CPU')}; git {info['git']['sha']}. Command: "
        f"`{' '.join(sys.argv)}`\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(r["greedy_equal"] and r["max_abs_logit_diff"] < 1e-4 for r in rows)
    return 0 if ok and (lm_eval is None or lm_eval["hf"]["acc"] == lm_eval["egmla"]["acc"]) else 1


if __name__ == "__main__":
    sys.exit(main())
