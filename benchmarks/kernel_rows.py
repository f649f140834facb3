"""Up to how many rows our CPU matmul kernel beats PyTorch's: the measurement behind
`egmla.kernels.MAX_ROWS`.

`egmla.kernels.linear` sends x @ W.T to `torch.ops.egmla.gemv` when x has at most
`MAX_ROWS[dtype]` rows (a decode step of that many sequences) and to PyTorch otherwise. This
script times both over one decode step's linears of SmolLM2-135M (the model decode_speed.py
runs): 30 layers of Q/K/V (576 -> 576/192/192, one `gemv_many` pass), O (576 -> 576), gate/up
(576 -> 1536 x 2, one pass) and down (1536 -> 576), random weights, at each row count:

- `kernel`: the calls `egmla.kernels` makes below MAX_ROWS (`gemv_many` / `gemv`);
- `pytorch`: what it falls back to above (`egmla.kernels._matmul`: `F.linear`, with bf16
  widened to fp32 on a CPU without native bf16 arithmetic, as the engine does).

For a noisy shared machine the two are interleaved, `for round: for rows: for path`, the path
order alternating from one round to the next, and each cell reports the median (and min..max)
of `--rounds` passes over all 30 layers. `speedup` = pytorch / kernel time; `break_even` is the
largest row count up to which every measured count has speedup >= 1. Effective GB/s = the
weights' bytes / time (each pass reads every weight once).

    python benchmarks/kernel_rows.py            # both dtypes, ~3 minutes on 2 quiet cores
    python benchmarks/kernel_rows.py --quick    # a smoke test, seconds

Writes benchmarks/results/kernel_rows.{json,md} (kernel_rows_quick.* with --quick) with the
machine, load average, git SHA and versions.
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
sys.path.insert(0, str(RESULTS.parents[1]))  # measure the checkout this script is in
from egmla import files  # noqa: E402  (after the path: this checkout's egmla)
from egmla.devices import thread_count  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402  (after the path: this checkout's serve)

# SmolLM2-135M: hidden 576, 3 KV heads of 64, SwiGLU 1536, 30 layers.
HIDDEN, KV, FFN, LAYERS = 576, 192, 1536, 30
ROWS = {"float32": [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96],
        "bfloat16": [1, 4, 8, 12, 16, 32, 48, 64, 96, 128]}
QUICK_ROWS = {"float32": [1, 16], "bfloat16": [1, 64]}
PATHS = ("kernel", "pytorch")


def make_layers(dtype, layers: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)

    def w(out: int, inp: int):
        return (torch.randn(out, inp, generator=g) / inp ** 0.5).to(dtype)

    return [{"q": w(HIDDEN, HIDDEN), "k": w(KV, HIDDEN), "v": w(KV, HIDDEN), "o": w(HIDDEN, HIDDEN),
             "gate": w(FFN, HIDDEN), "up": w(FFN, HIDDEN), "down": w(HIDDEN, FFN)}
            for _ in range(layers)]


def step(path: str, layers: list[dict], x, h) -> None:
    """One decode step's linears, as the kernel path or the PyTorch path runs them."""
    import torch

    from egmla import kernels

    if path == "kernel":
        gemv, many = torch.ops.egmla.gemv, torch.ops.egmla.gemv_many
        for L in layers:
            many(x, [L["q"], L["k"], L["v"]])
            gemv(x, L["o"])
            many(x, [L["gate"], L["up"]])
            gemv(h, L["down"])
    else:
        mm = kernels._matmul
        for L in layers:
            for name in ("q", "k", "v", "o", "gate", "up"):
                mm(x, L[name])
            mm(h, L["down"])


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(dtype_name: str, rows: list[int], rounds: int, layers: int) -> list[dict]:
    import torch

    dtype = getattr(torch, dtype_name)
    weights = make_layers(dtype, layers)
    nbytes = sum(t.numel() * t.element_size() for L in weights for t in L.values())
    g = torch.Generator().manual_seed(1)
    inputs = {m: (torch.randn(m, HIDDEN, generator=g).to(dtype),
                  torch.randn(m, FFN, generator=g).to(dtype)) for m in rows}
    times = {(m, p): [] for m in rows for p in PATHS}
    with torch.inference_mode():
        for m in rows:  # warm up: first touches, thread pools, allocations
            for p in PATHS:
                step(p, weights, *inputs[m])
        for r in range(rounds):
            for m in rows:
                for p in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    times[m, p].append(timed(step, p, weights, *inputs[m]))
            print(f"  {dtype_name}: round {r + 1}/{rounds}", flush=True)
    out = []
    for m in rows:
        cell = {"dtype": dtype_name, "rows": m}
        for p in PATHS:
            t = times[m, p]
            med = statistics.median(t)
            cell[p] = {"ms": {"median": med * 1e3, "min": min(t) * 1e3, "max": max(t) * 1e3},
                       "gb_s": nbytes / med / 1e9}
        cell["speedup"] = cell["pytorch"]["ms"]["median"] / cell["kernel"]["ms"]["median"]
        out.append(cell)
    return out


def break_even(cells: list[dict]) -> int:
    """The largest row count up to which every measured count has speedup >= 1 (0 if none)."""
    best = 0
    for c in sorted(cells, key=lambda c: c["rows"]):
        if c["speedup"] < 1:
            break
        best = c["rows"]
    return best


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Kernel rows: our gemv against PyTorch's matmul, one SmolLM2-135M decode step's linears",
        "",
        (f"CPU: {meta['cpu']}, {meta['torch_threads']} threads, native bf16: "
         f"{meta['native_bf16']}; load average before/after: {meta['load_average_before_after']}; "
         f"git {meta['git'].get('sha', '?')[:10]}; {report['rounds']} interleaved rounds, "
         f"median (min..max) of {report['shapes']['layers']} layers' Q/K/V, O, gate/up, down."),
        "",
        "| dtype | rows | kernel ms | pytorch ms | speedup | kernel GB/s | pytorch GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["cells"]:
        k, p = c["kernel"], c["pytorch"]
        lines.append(
            f"| {c['dtype']} | {c['rows']} | {k['ms']['median']:.1f} ({k['ms']['min']:.1f}.."
            f"{k['ms']['max']:.1f}) | {p['ms']['median']:.1f} ({p['ms']['min']:.1f}.."
            f"{p['ms']['max']:.1f}) | {c['speedup']:.2f}x | {k['gb_s']:.1f} | {p['gb_s']:.1f} |")
    lines += ["", "| dtype | measured break-even rows | `MAX_ROWS` in force |", "|---|---:|---:|"]
    for d, b in report["break_even"].items():
        lines.append(f"| {d} | {b} | {report['max_rows'][d]} |")
    lines += ["", ("`pytorch` is `egmla.kernels._matmul`: F.linear, bf16 widened to fp32 where the "
                   "CPU has no native bf16. Break-even: the largest measured row count up to which "
                   "the kernel is never slower."), ""]
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    """A reader sees the previous file or the whole new one, never a part."""
    files.write_text(path, text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time our CPU gemv kernel against PyTorch's matmul over one SmolLM2-135M decode "
                    "step's linears at several row counts (the measurement behind "
                    "egmla.kernels.MAX_ROWS).")
    parser.add_argument("--dtypes", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="weight and activation dtypes to measure (default: both)")
    parser.add_argument("--rounds", type=positive_int, default=7,
                        help="interleaved timing rounds per cell (default 7; the median is reported)")
    parser.add_argument("--threads", type=thread_count, default=2,
                        help="torch threads, which the kernel also uses (default 2)")
    parser.add_argument("--out", "--output-dir", dest="out", type=files.output_directory, default=RESULTS,
                        help=f"where to write kernel_rows.json and .md (default {RESULTS})")
    parser.add_argument("--quick", action="store_true",
                        help="two row counts per dtype, 2 rounds, 4 layers; writes kernel_rows_quick.*")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from egmla import kernels
    from egmla.provenance import provenance

    if not kernels.load():
        raise SystemExit(f"the kernels are not available here: {kernels.status()}")
    torch.set_num_threads(args.threads)
    rows = QUICK_ROWS if args.quick else ROWS
    rounds, layers = (2, 4) if args.quick else (args.rounds, LAYERS)
    load_before = os.getloadavg()
    cells = []
    for d in args.dtypes:
        cells += measure(d, rows[d], rounds, layers)
    load_after = os.getloadavg()
    p = provenance()
    report = {
        "meta": {**p, "cpu": p["hardware"]["cpu"], "torch_threads": torch.get_num_threads(),
                 "native_bf16": kernels.native_bf16(),
                 "load_average_before_after": [[round(x, 2) for x in load_before],
                                               [round(x, 2) for x in load_after]],
                 "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}},
        "shapes": {"hidden": HIDDEN, "kv": KV, "ffn": FFN, "layers": layers},
        "rounds": rounds,
        "cells": cells,
        "break_even": {d: break_even([c for c in cells if c["dtype"] == d]) for d in args.dtypes},
        "max_rows": {str(d).removeprefix("torch."): n for d, n in kernels.MAX_ROWS.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "kernel_rows_quick" if args.quick else "kernel_rows"
    write_atomic(args.out / f"{name}.json", json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    write_atomic(args.out / f"{name}.md", md)
    print("\n" + md)
    print(f"wrote {args.out / name}.json and .md", flush=True)


if __name__ == "__main__":
    main()
