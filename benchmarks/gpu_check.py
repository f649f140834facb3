"""The GPU check (issue 20): one prepared run for a lent GPU machine, within about 7 minutes.

The lent machine has PyTorch, Lightning and transformers, and none of hydra-core, wandb,
datasets, lm-eval, fastapi, uvicorn or gguf, and no registry access; so everything here runs on
random-initialized weights of SmolLM2-135M's shape (the GGUF is too large to carry) and token
ids (no tokenizer), and needs only torch, numpy, safetensors, tqdm and Lightning. It measures:

1. checks: on the GPU, the engine's greedy tokens equal the CPU's (fp32, a small model), seeded
   sampling repeats, and prefill + decode logits equal a full forward (bf16, a tolerance);
2. decode: single-stream tok/s (prefill excluded) and batched output tok/s at 1, 16, 64 in
   bf16 through `serve.LLM`;
3. variants: decode tok/s at batch 1 and 64 and KV bytes per token for SmolLM2's GQA and the
   MLA and EG-MLA forms that issue 38 converts it to (d_c 24);
4. serving: a mixed workload (prompts 16-256 tokens, outputs 16-64) through `LLM.generate`;
5. training: tokens/s of the LightningModule in bf16-mixed, eager and with torch.compile;
6. the attention path: the backend `auto` picks and why (serve.attention), PyTorch's SDPA
   backends enabled, whether flash-attn is importable (it cannot be installed there; its path
   is tested here only against its documented interface). Decode is measured under `auto`,
   `sdpa` (gather + SDPA), `flex` (FlexAttention in place) and `auto` compiled
   (enforce_eager=False), and the checks run the engine under each.

    bash benchmarks/gpu_check.sh                  # on the GPU machine: everything
    python benchmarks/gpu_check.py --device cpu --quick   # a smoke test of the script here

Writes benchmarks/results/gpu/gpu_check.json (gpu_check_quick.json with --quick) with the
machine (GPU name, CUDA, torch), the git SHA if known, and every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from egmla.files import output_directory  # noqa: E402
OUT = ROOT / "benchmarks" / "results" / "gpu"
SMOLLM2 = {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "d_ff": 1536,
           "max_seq_len": 2048, "rope_theta": 100000.0, "tie_embeddings": True,
           "attention": {"type": "mha", "n_kv_heads": 3}}
TINY = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 176,
        "max_seq_len": 256, "attention": {"type": "mha", "n_kv_heads": 2}}


def failure(error: BaseException) -> dict[str, Any]:
    """A part's error for the record, with the end of its traceback (its causes too: the engine
    wraps a step's error), since the GPU machine is gone by the time anyone reads it."""
    import traceback

    lines = "".join(traceback.format_exception(error)).splitlines()
    return {"error": f"{type(error).__name__}: {error}", "traceback": lines[-40:]}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_of(shape: dict, dtype, device, seed: int = 0):
    import torch

    from egmla.config import ModelConfig
    from egmla.models import Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_dict(shape)).to(dtype=dtype, device=device).eval()


def checks(device) -> dict[str, Any]:
    """Correctness on the device against the CPU and against a full forward."""
    import torch

    from serve import LLM, SamplingParams

    cpu = model_of(TINY, torch.float32, torch.device("cpu"))
    here = model_of(TINY, torch.float32, device)
    prompts = [[random.Random(i).randrange(256) for _ in range(8 + i)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in LLM(cpu).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(here)
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    by_backend = {}
    for name, args in ENGINES.items():
        other = LLM(model_of(TINY, torch.float32, device), **args)
        got = [o.outputs[0].token_ids for o in other.generate(prompts, greedy, use_tqdm=False)]
        by_backend[name] = got == a
    seeded = SamplingParams(max_tokens=16, seed=7)
    s1, s2 = ([o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
              for _ in range(2))
    bf16 = model_of(TINY, torch.bfloat16, device)
    ids = torch.tensor([prompts[3] + b[3]], device=device)
    with torch.no_grad():
        full = bf16(ids).float()
        cache = bf16.new_cache(1, ids.shape[1])
        steps = [bf16(ids[:, :8], cache=cache)]
        steps += [bf16(ids[:, t:t + 1], cache=cache) for t in range(8, ids.shape[1])]
        stepwise = torch.cat(steps, dim=1).float()
    err = (full - stepwise).abs().max().item()
    shared = {}
    if device.type == "cuda":  # vLLM's gpu_memory_utilization sizes the pool from the device
        pool = LLM(model_of(TINY, torch.float32, device), gpu_memory_utilization=0.3).engine
        shared = {"gpu_memory_utilization_0.3_kv_gib": round(pool.cache.nbytes() / 2**30, 2)}
    return {**shared, "greedy_equals_cpu": a == b, "greedy_equals_cpu_by_engine": by_backend,
            "seeded_repeats": s1 == s2,
            "bf16_prefill_decode_max_abs_err": err, "bf16_tolerance": 0.05,
            "passed": a == b and all(by_backend.values()) and s1 == s2 and err < 0.05}


# The engine settings measured side by side (besides the default, `auto`).
ENGINES = {"sdpa": {"attention_backend": "sdpa"}, "flex": {"attention_backend": "flex"},
           "auto_compiled": {"enforce_eager": False}}


def decode_by_engine(device, dtype, batches: list[int], new_tokens: int, repeats: int
                     ) -> dict[str, Any]:
    """`decode` under the default engine and, at the smallest and largest batch, half the
    tokens and one repeat fewer (the 5-minute budget), each of ENGINES."""
    out = {"auto": decode(device, dtype, batches, new_tokens, repeats)}
    for name, args in ENGINES.items():
        try:
            out[name] = decode(device, dtype, batches[:: max(1, len(batches) - 1)],
                               max(8, new_tokens // 2), max(1, repeats - 1), **args)
        except Exception as error:  # noqa: BLE001 - one engine failing must not lose the rest
            out[name] = failure(error)
    return out


def decode(device, dtype, batches: list[int], new_tokens: int, repeats: int, shape=None,
           **engine_args) -> dict[str, Any]:
    from serve import LLM, SamplingParams

    model = model_of(shape or SMOLLM2, dtype, device)
    llm = LLM(model, num_blocks=max(batches) * (64 + new_tokens) // 16 + 16, block_size=16,
              max_num_seqs=max(batches), enable_prefix_caching=False, **engine_args)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rows = {}
    for batch in batches:
        runs = []
        for r in range(repeats + 1):
            prompts = [[random.Random(r * 100 + i).randrange(SMOLLM2["vocab_size"])
                        for _ in range(32)] for i in range(batch)]
            ids = [engine.add_request(p, params) for p in prompts]
            sync(device)
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            sync(device)
            wall = time.perf_counter() - t0
            seqs = [engine.release(i)[0] for i in ids]
            start = max(s.first_token_time for s in seqs)
            end = max(s.finish_time for s in seqs)
            if r:  # the first is a warm-up
                runs.append({"decode_tok_s": batch * (new_tokens - 1) / (end - start),
                             "output_tok_s": batch * new_tokens / wall})
        rows[str(batch)] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    return {"dtype": str(dtype), "new_tokens": new_tokens, "attention": engine.attention_backend,
            "enforce_eager": engine.config.enforce_eager, "by_batch": rows}


def converted_forms(shape: dict) -> dict[str, dict]:
    """The shape's GQA attention and the forms that issue 38 converts it to at its smallest cache
    (d_c 24, 8 RoPE dims per KV head: python -m egmla.upcycle --d-c 24 --rope-dims 8;
    docs/upcycling.md)."""
    gqa = shape["attention"]
    head = shape["d_model"] // shape["n_heads"]
    rope = min(8, head // 2)
    converted = {"d_c": 24, "d_nope": head - rope, "d_rope": rope, "d_v": head,
                 "latent_norm": False, "n_kv_heads": gqa["n_kv_heads"],
                 "rope_heads": gqa["n_kv_heads"]}
    gate = {"d_e": 32, "gate_norm": "none", "gate_group_size": 2, "gate_init": "identity",
            "gate_residual": True}
    return {"original (GQA)": gqa, "mla d_c 24": {"type": "mla", **converted},
            "egmla-kv d_c 24": {"type": "egmla", **converted, **gate, "gate_position": "kv"},
            "egmla-latent d_c 24": {"type": "egmla", **converted, **gate,
                                    "gate_position": "latent"}}


def variants(device, dtype, batches: list[int], new_tokens: int, repeats: int
             ) -> dict[str, Any]:
    """Decode tok/s of SmolLM2's shape with each of its converted_forms (random weights: speed
    and cache size do not depend on them), the GQA layers attending by `sdpa` (MLA and EG-MLA
    gather their latent history under every backend), with the KV bytes per token."""
    from egmla.models.transformer import cache_spec_for
    from egmla.config import ModelConfig

    out = {}
    for name, attention in converted_forms(SMOLLM2).items():
        shape = {**SMOLLM2, "attention": attention}
        spec = cache_spec_for(ModelConfig.from_dict(shape))
        try:
            out[name] = {"kv_bytes_per_token": spec.bytes_per_token(dtype),
                         **decode(device, dtype, batches, new_tokens, repeats, shape=shape,
                                  attention_backend="sdpa")}
        except Exception as error:  # noqa: BLE001 - one variant failing must not lose the rest
            out[name] = failure(error)
    return out


def serving(device, dtype, requests: int, longest: int = 256) -> dict[str, Any]:
    from serve import LLM, SamplingParams

    rng = random.Random(0)
    vocab = SMOLLM2["vocab_size"]
    work = [([rng.randrange(vocab) for _ in range(rng.randint(16, longest))], rng.randint(16, 64))
            for _ in range(requests)]
    llm = LLM(model_of(SMOLLM2, dtype, device), max_num_seqs=64, max_num_batched_tokens=2048,
              num_blocks=requests * 24, block_size=16)
    llm.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work],
                        [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for _, k in work],
                        use_tqdm=False)
    sync(device)
    wall = time.perf_counter() - t0
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": requests, "output_tokens": made, "wall_s": wall, "output_tok_s": made / wall}


def training(device, steps: int, seq_len: int, batch: int, compiled: bool = True) -> dict[str, Any]:
    """The LightningModule on random tokens, bf16-mixed on a GPU, eager and (`compiled`) with
    torch.compile."""
    import lightning as L
    import torch

    from egmla.training.module import LanguageModel

    shape = {**SMOLLM2, "max_seq_len": seq_len} if device.type == "cuda" else TINY
    ids = torch.randint(0, shape["vocab_size"], (batch * (steps + 2), seq_len + 1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]),
                                       batch_size=batch)
    out = {}
    for compiled in (False, True) if compiled else (False,):
        module = LanguageModel(shape, {"lr": 1e-3, "warmup_steps": 2}, steps + 2, compile=compiled)
        trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                            precision="bf16-mixed" if device.type == "cuda" else "32-true",
                            max_steps=steps + 2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        times = []

        class Clock(L.Callback):
            def on_train_batch_start(self, *args):
                sync(device)
                times.append(time.perf_counter())

        trainer.callbacks.append(Clock())
        trainer.fit(module, train_dataloaders=data)
        sync(device)
        steady = times[2:]  # the first steps compile and warm up
        per_step = (steady[-1] - steady[0]) / max(1, len(steady) - 1)
        out["compiled" if compiled else "eager"] = {
            "tokens_per_s": batch * seq_len / per_step, "step_s": per_step}
    return {"precision": "bf16-mixed" if device.type == "cuda" else "32-true",
            "batch": batch, "seq_len": seq_len, **out}


def attention_path(device) -> dict[str, Any]:
    import torch

    from serve import attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head_dim = SMOLLM2["d_model"] // SMOLLM2["n_heads"]
    choice = attention.select("auto", device, dtype, 16, {head_dim})
    path = {"auto": choice.name, "auto_reason": choice.reason,
            "flash_attn_importable": importlib.util.find_spec("flash_attn") is not None,
            "note": "MHA/GQA layers attend through the chosen backend; MLA and EG-MLA layers "
                    "gather their latent history under every backend. flash-attn cannot be "
                    "installed on the lent machine, so its path is untested on a GPU"}
    if device.type == "cuda":
        path.update(sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
                    sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                    sdpa_math=torch.backends.cuda.math_sdp_enabled())
    return path


def machine(device) -> dict[str, Any]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "host": platform.node(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory
                                         / 2**30, 1))
    if os.environ.get("EGMLA_GIT_SHA"):  # a copied working tree whose .git is not its commit
        info["git"] = os.environ["EGMLA_GIT_SHA"]
        return info
    try:
        import subprocess

        info["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the script")
    p.add_argument("--out", type=output_directory, default=OUT)
    p.add_argument("--parts", default=None,
                   help="comma-separated parts to run (default all: checks, attention_path, "
                        "decode, variants, serving, training)")
    args = p.parse_args(argv)
    import torch

    from egmla.devices import parse_device

    try:
        device = parse_device(args.device)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    report: dict[str, Any] = {"machine": machine(device), "device": str(device), "quick": args.quick}
    started = time.perf_counter()
    parts = [
        ("checks", lambda: checks(device)),
        ("attention_path", lambda: attention_path(device)),
        ("decode", lambda: decode_by_engine(device, dtype, [1, 4] if args.quick else [1, 16, 64],
                                            8 if args.quick else 128, 1 if args.quick else 3)),
        ("variants", lambda: variants(device, dtype, [1, 4] if args.quick else [1, 64],
                                      8 if args.quick else 128, 1 if args.quick else 2)),
        ("serving", lambda: serving(device, dtype, 4 if args.quick else 64,
                                    96 if args.quick else 256)),
        ("training", lambda: training(device, 3 if args.quick else 20, 64 if args.quick else 512,
                                      2 if args.quick else 16, compiled=gpu or not args.quick)),
    ]
    if args.parts:
        chosen = args.parts.split(",")
        unknown = sorted(set(chosen) - {n for n, _ in parts})
        if unknown:
            print(f"error: unknown --parts {','.join(unknown)}; the parts are "
                  f"{', '.join(n for n, _ in parts)}", file=sys.stderr)
            return 2
        parts = [(n, run) for n, run in parts if n in chosen]
    if args.quick and not gpu:  # SmolLM2's shape is too slow for a CPU smoke test
        SMOLLM2.update(TINY)
    args.out.mkdir(parents=True, exist_ok=True)
    from egmla import files

    path = args.out / ("gpu_check_quick.json" if args.quick else "gpu_check.json")
    for name, run in parts:
        t0 = time.perf_counter()
        try:
            report[name] = {**run(), "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as error:  # noqa: BLE001 - one part failing must not lose the others
            report[name] = failure(error)
        print(f"{name}: {json.dumps(report[name])[:400]}", flush=True)
        report["seconds"] = round(time.perf_counter() - started, 1)
        # after every part: a run stopped by the time limit keeps what it measured
        files.write_text(path, json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    failed = [n for n, _ in parts if "error" in report[n]]
    return 1 if failed or not report.get("checks", {"passed": True}).get("passed") else 0


if __name__ == "__main__":
    sys.exit(main())
