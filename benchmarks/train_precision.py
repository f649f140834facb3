"""Training throughput by precision on this CPU: Lightning's `32-true` against `bf16-mixed`.

A CPU with native bf16 (AVX512-BF16 or AMX) runs autocast's bf16 matmuls much faster than
fp32; this measures by how much for the shapes the project trains here, through the real
Trainer and LightningModule (random tokens), in interleaved rounds so machine noise hits both
alike, and reports tokens/s per precision, their ratio, and the loss after the same steps from
the same init (a sanity check that bf16-mixed trains, not a quality claim).

    python benchmarks/train_precision.py                      # every shape, 3 rounds
    python benchmarks/train_precision.py --shapes locality --rounds 1 --steps 4
    python benchmarks/train_precision.py --shapes quickstart --batch 4 --seq-len 64   # other sizes

Writes benchmarks/results/train_precision.{json,md} with the machine, load, versions and git SHA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))
from egmla.files import output_directory  # noqa: E402

# (model, batch, sequence length): the shapes trained on this machine
SHAPES = {
    "locality": ({"vocab_size": 4096, "d_model": 384, "n_layers": 6, "n_heads": 6, "d_ff": 1536,
                  "max_seq_len": 256, "attention": {"type": "mha"}}, 16, 256),
    "quickstart": ({"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 8,
                    "max_seq_len": 128, "attention": {"type": "egmla", "d_c": 32, "d_e": 64,
                                                      "d_nope": 32, "d_rope": 16, "d_v": 32}},
                   16, 128),  # the study's size
}
PRECISIONS = ("32-true", "bf16-mixed")


def measure(shape: str, precision: str, steps: int, batch: int, seq: int) -> dict:
    """Seconds per optimizer step (after two warm-up steps) and the final loss."""
    import lightning as L
    import torch

    from egmla.training.module import LanguageModel

    model = SHAPES[shape][0]
    torch.manual_seed(0)
    ids = torch.randint(0, model["vocab_size"], (batch * (steps + 2), seq + 1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]),
                                       batch_size=batch)
    module = LanguageModel(model, {"lr": 1e-3, "warmup_steps": 2}, steps + 2)
    times, losses = [], []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):
            times.append(time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, *args):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=steps + 2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(module, train_dataloaders=data)
    times.append(time.perf_counter())
    per_step = (times[-1] - times[2]) / steps
    return {"shape": shape, "precision": precision, "step_s": per_step,
            "tokens_per_s": batch * seq / per_step, "final_loss": losses[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
    p.add_argument("--batch", type=int, help="sequences per step (default: each shape's own)")
    p.add_argument("--seq-len", type=int,
                   help="tokens per sequence, up to the shape's model length (quickstart 128, locality 256; "
                        "default: each shape's own)")
    p.add_argument("--out", type=output_directory, default=RESULTS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        print("error: --rounds and --steps must be >= 1", file=sys.stderr)
        return 2
    sizes = {}
    for shape in args.shapes:
        model, batch, seq = SHAPES[shape]
        batch = batch if args.batch is None else args.batch
        seq = seq if args.seq_len is None else args.seq_len
        if batch < 1 or not 1 <= seq <= model["max_seq_len"]:
            print(f"error: --batch {batch} --seq-len {seq} for {shape}: the batch must be >= 1 "
                  f"and the length in [1, {model['max_seq_len']}]", file=sys.stderr)
            return 2
        sizes[shape] = batch, seq
    import logging

    import torch

    from egmla.devices import native_bf16
    from egmla.provenance import provenance

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rows = []
    for r in range(args.rounds):
        for shape in args.shapes:
            for precision in PRECISIONS:
                row = {**measure(shape, precision, args.steps, *sizes[shape]), "round": r}
                rows.append(row)
                print(f"round {r} {shape} {precision}: {row['tokens_per_s']:,.0f} tok/s, "
                      f"loss {row['final_loss']:.4f}", flush=True)
    table = []
    for shape in args.shapes:
        med = {pr: statistics.median(x["tokens_per_s"] for x in rows
                                     if x["shape"] == shape and x["precision"] == pr)
               for pr in PRECISIONS}
        loss = {pr: next(x["final_loss"] for x in rows
                         if x["shape"] == shape and x["precision"] == pr) for pr in PRECISIONS}
        table.append({"shape": shape, "model": SHAPES[shape][0], "batch": sizes[shape][0],
                      "seq_len": sizes[shape][1],
                      **{f"tokens_per_s_{pr}": round(v, 1) for pr, v in med.items()},
                      "bf16_mixed_speedup": round(med["bf16-mixed"] / med["32-true"], 3),
                      **{f"final_loss_{pr}": round(v, 4) for pr, v in loss.items()}})
    meta = {**provenance(), "native_bf16": native_bf16(), "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "rounds": args.rounds, "steps": args.steps}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_precision.json").write_text(
        json.dumps({"meta": meta, "table": table, "rows": rows}, indent=1) + "\n")
    lines = ["# Training throughput by precision (CPU, Lightning Trainer)", "",
             f"{meta['time_utc']}; {meta['hardware']['cpu']}, native bf16: {meta['native_bf16']}, "
             f"{meta['threads']} threads, load {meta['load_average'][0]:.2f}; git "
             f"{meta['git']['sha'][:10]}; median of {args.rounds} interleaved rounds x "
             f"{args.steps} steps; random tokens, the same init for both precisions.", "",
             "| shape | batch x seq | 32-true tok/s | bf16-mixed tok/s | speedup | loss 32-true | "
             "loss bf16-mixed |", "|---|---|---:|---:|---:|---:|---:|"]
    for t in table:
        lines.append(f"| {t['shape']} | {t['batch']} x {t['seq_len']} | "
                     f"{t['tokens_per_s_32-true']:,.0f} | {t['tokens_per_s_bf16-mixed']:,.0f} | "
                     f"{t['bf16_mixed_speedup']:.2f}x | {t['final_loss_32-true']:.4f} | "
                     f"{t['final_loss_bf16-mixed']:.4f} |")
    (args.out / "train_precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
