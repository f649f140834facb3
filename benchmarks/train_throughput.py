"""Forward+backward throughput and peak memory: our backbones against transformers' Llama.

Each measurement runs in a fresh subprocess (so peak RSS belongs to one model), and the models
are measured in interleaved rounds (hf, mha, mla, ... then again) so machine noise hits them all
alike; the table reports the median over rounds and the ratio to transformers' Llama measured in
the same run. Our MHA gets the same config and the same weights as the Llama model.

    python benchmarks/train_throughput.py                 # both sizes, 3 rounds
    python benchmarks/train_throughput.py --sizes small --rounds 1 --steps 3

Writes benchmarks/results/train_throughput.{json,md} with the machine, versions and git SHA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))  # measure the checkout this script is in
from egmla.devices import thread_count  # noqa: E402
from egmla.files import output_directory, write_json, write_text  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

# Two sizes that fit a 2-core CPU. d_h = d_model / n_heads; latent widths follow d_h.
SIZES = {
    "small": {"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 8, "seq": 256, "batch": 8},
    "medium": {"vocab_size": 8192, "d_model": 512, "n_layers": 8, "n_heads": 8, "seq": 512, "batch": 4},
}
MODELS = ["hf-llama", "egmla-mha", "egmla-gqa", "egmla-mla", "egmla-egmla-kv", "egmla-egmla-latent"]


def model_config(size: str, model: str) -> dict:
    s = SIZES[size]
    hd = s["d_model"] // s["n_heads"]
    base = {k: s[k] for k in ("vocab_size", "d_model", "n_layers", "n_heads")}
    base["max_seq_len"] = s["seq"]
    latent = {"d_nope": hd, "d_rope": hd // 2, "d_v": hd}
    attention = {
        "hf-llama": {"type": "mha"},
        "egmla-mha": {"type": "mha"},
        "egmla-gqa": {"type": "mha", "n_kv_heads": s["n_heads"] // 4},
        "egmla-mla": {"type": "mla", "d_c": 4 * hd, **latent},
        "egmla-egmla-kv": {"type": "egmla", "d_c": hd, "d_e": 2 * hd, **latent},
        "egmla-egmla-latent": {"type": "egmla", "d_c": hd, "d_e": 2 * hd, "gate_position": "latent",
                               **latent},
    }[model]
    return {**base, "attention": attention}


# ---- one measurement (runs in a child process) ---------------------------------------------


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(size: str, model_name: str, steps: int, warmup: int) -> dict:
    import resource

    import torch

    from egmla.config import ModelConfig
    from egmla.models import Transformer

    torch.manual_seed(0)
    s = SIZES[size]
    cfg = ModelConfig.from_dict(model_config(size, model_name))
    ours, hf = Transformer(cfg), None
    if model_name in ("hf-llama", "egmla-mha"):
        # Same config and same weights: build transformers' Llama, map its weights into ours.
        # Both children import transformers, so their peak RSS is comparable.
        from transformers import LlamaConfig, LlamaForCausalLM

        from egmla.imports import state_dict_from_llama

        hf_cfg = LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
        hf = LlamaForCausalLM(hf_cfg)
        ours.load_state_dict(state_dict_from_llama(hf.state_dict(), cfg))
    model = hf if model_name == "hf-llama" else ours
    is_hf = model_name == "hf-llama"
    del hf, ours  # only the measured model stays alive

    model.train()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"] + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def train_step():
        logits = model(input_ids=inputs).logits if is_hf else model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(warmup):
        train_step()
    rss_before = _current_rss_bytes()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = s["batch"] * s["seq"]
    return {
        "size": size, "model": model_name, "params": params,
        "tokens_per_s": tokens / statistics.median(times),
        "step_s": statistics.median(times),
        "peak_rss_mib": peak / 2**20, "rss_after_warmup_mib": rss_before / 2**20,
    }


# ---- driver ---------------------------------------------------------------------------------


def run_child(size: str, model: str, steps: int, warmup: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--child", size, model, "--steps", str(steps),
           "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"measurement {size}/{model} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def metadata(args: argparse.Namespace) -> dict:
    from egmla.provenance import provenance

    p = provenance()
    return {
        **p, "git_sha": p["git"]["sha"], "cpu": p["hardware"]["cpu"],
        "torch": p["versions"]["torch"], "transformers": p["versions"]["transformers"],
        "threads": args.threads, "sizes": {k: SIZES[k] for k in args.sizes},
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
    }


def summarize(rows: list[dict], sizes: list[str]) -> list[dict]:
    table = []
    for size in sizes:
        by_model = {m: [r for r in rows if r["size"] == size and r["model"] == m] for m in MODELS}
        med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in by_model.items()}
        for m, rs in by_model.items():
            table.append({
                "size": size, "model": m, "params": rs[0]["params"],
                "tokens_per_s": round(med[m], 1),
                "tokens_per_s_all_rounds": [round(r["tokens_per_s"], 1) for r in rs],
                "vs_hf_llama": round(med[m] / med["hf-llama"], 3),
                "vs_egmla_mha": round(med[m] / med["egmla-mha"], 3),
                "peak_rss_mib": round(max(r["peak_rss_mib"] for r in rs), 1),
                "peak_minus_warm_rss_mib": round(
                    statistics.median(r["peak_rss_mib"] - r["rss_after_warmup_mib"] for r in rs), 1),
            })
    return table


def markdown(meta: dict, table: list[dict]) -> str:
    lines = [
        "# Training throughput (forward + backward), CPU",
        "",
        f"{meta['time_utc']}; {meta['cpu']}, {meta['threads']} threads; torch {meta['torch']}, "
        f"transformers {meta['transformers']}; git {meta['git_sha']}; "
        f"median of {meta['rounds']} interleaved rounds x {meta['steps']} steps.",
        "",
        "| size | model | params | tokens/s | vs HF Llama | vs our MHA | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(f"| {r['size']} | {r['model']} | {r['params']:,} | {r['tokens_per_s']:,.0f} | "
                     f"{r['vs_hf_llama']:.2f} | {r['vs_egmla_mha']:.2f} | {r['peak_rss_mib']:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, >= 0 (2)")
    parser.add_argument("--threads", type=thread_count, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")
    if args.child:
        print(json.dumps(measure(*args.child, steps=args.steps, warmup=args.warmup)))
        return
    rows = []
    for rnd in range(args.rounds):
        for size in args.sizes:
            for model in MODELS:
                row = run_child(size, model, args.steps, args.warmup, args.threads)
                print(f"round {rnd + 1}/{args.rounds} {size:>6} {model:<20} "
                      f"{row['tokens_per_s']:8.0f} tok/s  peak {row['peak_rss_mib']:7.0f} MiB",
                      flush=True)
                rows.append(row)
    meta = metadata(args)
    table = summarize(rows, args.sizes)
    write_json(args.out / "train_throughput.json",
               {"meta": meta, "summary": table, "measurements": rows}, indent=2, parents=True)
    md = markdown(meta, table)
    write_text(args.out / "train_throughput.md", md)
    print("\n" + md)


if __name__ == "__main__":
    main()
