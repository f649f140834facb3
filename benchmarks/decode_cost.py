"""Decode-step cost of each attention variant against context length: time, MACs, bytes, memory.

For each variant at the paper's 12-layer d=768 shapes (`paper-*` presets) and at the small CPU
presets, one decode step (one new token per sequence) over a cache already holding S - 1 tokens,
at batch 1 and 16 and S from 256 to 8,192:

- per layer: the attention layer alone, timed on a 1-layer model of the same shapes;
- per model: the whole model's step (embedding, every block, LM head), on the full model, for
  caches under --max-cache-gib (a cell over it is recorded as skipped, with its size);
- beside each time: the analytic multiply-accumulates per key and per query of one layer, the
  cache bytes a step reads per key and layer, the gate-table bytes an EG-MLA `kv` step also reads
  per key (its keys' rows of E, which the KV-bytes report does not count), and the peak transient
  memory of the step (peak RSS during the step minus RSS before it; the process runs with
  MALLOC_MMAP_THRESHOLD_=65536 so freed transients go back to the OS and the peak is visible).

Decode time does not depend on the cache's contents, so caches are filled with random values
directly (no prefill). Variants are interleaved within each (batch, context) cell, `--rounds`
rounds each (a step over --slow-ms is timed once); the median is reported. Whole-model cells
whose caches would not fit in memory together (--max-group-gib) are timed one variant after
another instead (`interleaved: false` in their rows). float32 weights
and cache; torch's default threads.

    python benchmarks/decode_cost.py                 # the full grid: about 30 min on 2 quiet cores
    python benchmarks/decode_cost.py --shapes paper --batches 1   # about 10 minutes
    python benchmarks/decode_cost.py --quick         # small presets, 2 contexts, batch 1: a minute

Writes benchmarks/results/decode_cost.{json,md} (decode_cost_quick.* with --quick) at the end.
After each (shapes, scope, batch, context) group the rows so far go to decode_cost.partial.json;
run the same command again after an interruption and it resumes from there (--fresh starts over;
other settings start over too). Each run segment's git SHA and load average are recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # before torch allocates anything: re-exec
    os.execve(sys.executable, [sys.executable, *sys.argv],
              {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from egmla import files  # noqa: E402
from egmla.config import ModelConfig  # noqa: E402
from egmla.models import Transformer, cache_spec_for  # noqa: E402
from egmla.presets import preset  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

# (label, preset, attention.impl or None)
PAPER = [
    ("MHA", "paper-mha", None), ("GQA-4", "paper-gqa4", None), ("MLA d_c 256", "paper-mla", "absorbed"),
    ("EG-MLA latent d_c 64", "paper-egmla-latent64", "absorbed"),
    *[(f"EG-MLA kv d_c {d} {how}", f"paper-egmla-kv{d}", impl)
      for d in (256, 64, 16) for how, impl in (("rebuilt", "naive"), ("absorbed", "absorbed"))],
]
SMALL = [
    ("MHA", "small-mha", None), ("GQA-2", "small-gqa2", None), ("MLA d_c 128", "small-mla", "absorbed"),
    ("EG-MLA latent d_c 32", "small-egmla-latent", "absorbed"),
    ("EG-MLA kv d_c 32 rebuilt", "small-egmla", "naive"),
    ("EG-MLA kv d_c 32 absorbed", "small-egmla", "absorbed"),
]
FLOAT = torch.float32


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def config_of(name: str, impl: str | None, max_len: int, n_layers: int | None = None) -> ModelConfig:
    overrides = {"max_seq_len": max_len, **({"n_layers": n_layers} if n_layers else {})}
    cfg = preset(name, **overrides)
    if impl is not None:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, impl=impl))
    return cfg


def analytic(model: Transformer, context: int) -> dict:
    """One layer's decode step (T = 1), as the layer declares it: MACs per key and per query,
    cache bytes read per key, lookup-table (gate) bytes read per key."""
    cost = model.layers[0].attn.decode_cost(context, FLOAT)
    return {"macs_per_key": cost["macs_per_key"], "macs_per_query": cost["macs_per_query"],
            "cache_bytes_per_key": cost["cache_bytes_per_key"],
            "gate_bytes_per_key": cost["lookup_bytes_per_key"]}


def filled_cache(model: Transformer, batch: int, context: int):
    """A contiguous cache holding context - 1 random tokens, ready for one decode step."""
    cache = model.new_cache(batch, context)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for name, t in layer.items():
            if name == "norm_stats":  # (mu, 1/sigma) or (1/rms): a plausible positive scale
                t[..., -1].uniform_(0.5, 2.0, generator=g)
                if t.shape[-1] == 2:
                    t[..., 0].normal_(0, 0.01, generator=g)
            else:
                t.normal_(generator=g)
    for t in cache.sequence.values():
        t.random_(0, model.config.vocab_size, generator=g)
    cache.length = context - 1
    return cache


class Cell:
    """One (variant, batch, context) measurement: a step function and its timings."""

    def __init__(self, label, name, impl, batch, context, whole_model, max_cache_bytes):
        self.label, self.name, self.impl = label, name, impl
        self.batch, self.context, self.whole_model = batch, context, whole_model
        cfg = config_of(name, impl, context + 16, None if whole_model else 1)
        self.cfg, self.times, self.peak_mib, self.skipped = cfg, [], None, None
        self.cache_bytes = model_cache_bytes(cfg, batch, context)
        if whole_model and self.cache_bytes > max_cache_bytes:
            self.skipped = f"cache {self.cache_bytes / 2**30:.1f} GiB > --max-cache-gib"
            return
        torch.manual_seed(0)
        self.model = Transformer(cfg).eval()
        self.cache = filled_cache(self.model, batch, context)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
        self.x = torch.randn(batch, 1, cfg.d_model, generator=g)
        self.positions = torch.full((1, 1), context - 1)
        self.analytic = analytic(self.model, context)
        self.auto_absorbed = self._auto_picks_absorbed()

    def _auto_picks_absorbed(self) -> bool | None:
        """Whether `impl: auto` would run the absorbed computation for this step (None: the
        variant has no choice of computation)."""
        a = self.cfg.attention
        if "impl" not in {f.name for f in dataclasses.fields(a)}:
            return None
        with torch.device("meta"):
            auto = Transformer(dataclasses.replace(
                self.cfg, attention=dataclasses.replace(a, impl="auto"))).layers[0].attn
        return auto._use_absorbed(1, self.context, cached=True)

    def step(self) -> None:
        if self.whole_model:
            self.model(self.ids, cache=self.cache)
            self.cache.length -= 1  # the next step rewrites the same position
        else:
            self.cache.begin({"token_ids": self.ids}, self.positions)
            self.model.layers[0].attn(self.x, self.positions, self.cache.layer(0), self.ids)

    def measure(self, with_memory: bool) -> float:
        if with_memory:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS
            before = rss_kib("VmRSS")
        start = time.perf_counter()
        with torch.inference_mode():
            self.step()
        elapsed = time.perf_counter() - start
        if with_memory:
            self.peak_mib = max(0, rss_kib("VmHWM") - before) / 1024
        self.times.append(elapsed)
        return elapsed

    def release(self) -> None:
        for name in ("model", "cache"):
            self.__dict__.pop(name, None)

    def row(self) -> dict:
        out = {"variant": self.label, "preset": self.name, "impl": self.impl or "-",
               "batch": self.batch, "context": self.context,
               "scope": "model" if self.whole_model else "layer",
               "cache_bytes": self.cache_bytes}
        if self.skipped:
            return {**out, "skipped": self.skipped}
        ms = statistics.median(self.times) * 1e3
        return {**out, "ms": ms, "times_ms": [t * 1e3 for t in self.times],
                "tokens_per_s": self.batch / (ms / 1e3), "peak_transient_mib": self.peak_mib,
                "auto_picks_absorbed": self.auto_absorbed, **self.analytic}


def model_cache_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    return cache_spec_for(cfg).bytes_per_token(FLOAT) * batch * context


def run_grid(shapes: dict, contexts, batches, rounds, slow_ms, max_cache_bytes, max_group_bytes,
             rows: list[dict], checkpoint) -> list[dict]:
    """Measure every (shapes, scope, batch, context) group not already in `rows`.

    After each group the rows so far go to `checkpoint(rows)`, so a run cut short resumes from
    the last finished group.
    """
    done, warm_up = {group_key(r) for r in rows}, True
    for family, variants in shapes.items():
        for scope in ("layer", "model"):
            for batch in batches:
                for context in contexts:
                    if (family, scope, batch, context) in done:
                        continue
                    whole = scope == "model"
                    group_bytes = sum(model_cache_bytes(config_of(v[1], v[2], context), batch, context)
                                      for v in variants) if whole else 0
                    # Interleave the variants' rounds when their caches fit in memory together;
                    # else build, time and free one variant at a time.
                    together = group_bytes <= max_group_bytes
                    batches_of_cells = [variants] if together else [[v] for v in variants]
                    for chunk in batches_of_cells:
                        cells = [Cell(*v, batch, context, whole, max_cache_bytes) for v in chunk]
                        live = [c for c in cells if not c.skipped]
                        if warm_up:  # the process's first steps pay one-time costs (threads, allocator)
                            for c in live:
                                c.measure(with_memory=False)
                                c.times.clear()
                            warm_up = False
                        for r in range(rounds):
                            for c in live:
                                if r == 0 or c.times[0] * 1e3 < slow_ms:
                                    c.measure(with_memory=r == 0)
                        for c in cells:
                            rows.append({"shapes": family, **c.row(), "interleaved": together})
                            c.release()
                            print(format_row(rows[-1]), flush=True)
                    checkpoint(rows)
    return rows


def group_key(row: dict) -> tuple:
    return row["shapes"], row["scope"], row["batch"], row["context"]


def oversized_layer(families: dict, args: argparse.Namespace) -> str | None:
    """Why the grid cannot be measured (None: it can): a one-layer cache of the largest
    context and batch over --max-cache-gib (a layer cell, unlike a whole-model one, is never
    skipped: --contexts 10**12 would exhaust the memory)."""
    context, batch = max(args.contexts), max(args.batches)
    for family in args.shapes:
        for _, name, impl in families[family]:
            size = model_cache_bytes(config_of(name, impl, context, n_layers=1), batch, context)
            if size > args.max_cache_gib * 2**30:
                return (f"--contexts {context} at --batches {batch}: one layer's float32 cache "
                        f"of {name} would take {size / 2**30:,.1f} GiB, over --max-cache-gib "
                        f"{args.max_cache_gib:g}")
    return None


def read_partial(path: Path) -> dict:
    """The rows an interrupted run saved; ValueError when `path` is not such a record."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"unreadable ({err})") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("rows"), list)
            and isinstance(saved.get("segments"), list) and "grid" in saved
            and all(isinstance(r, dict) and {"shapes", "scope", "batch", "context"} <= set(r)
                    for r in saved["rows"])):
        raise ValueError("not a partial record of this benchmark (grid, segments, rows)")
    return saved


def write_atomic(path: Path, text: str) -> None:
    """A reader sees the previous file or the whole new one, never a part."""
    files.write_text(path, text)


def format_row(r: dict) -> str:
    head = f"{r['shapes']:5} {r['scope']:5} B={r['batch']:<2} S={r['context']:<5} {r['variant']:28}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    return f"{head} {r['ms']:9.2f} ms  peak {r['peak_transient_mib']:8.1f} MiB"


# ---- report ----------------------------------------------------------------------------------


def _fmt_ms(x: float) -> str:
    return f"{x:,.2f}" if x < 100 else f"{x:,.0f}"


def _shas(meta: dict) -> str:
    """The commit(s) the rows were measured at: one per run segment when a run was resumed."""
    gits = [seg["git"] for seg in meta.get("segments", [])] or [meta["git"]]
    shas = dict.fromkeys(f"{g['sha']}{' (dirty tree)' if g['dirty'] else ''}" for g in gits)
    return " then ".join(shas) + (f" ({len(gits)} run segments)" if len(gits) > 1 else "")


def _sequential_note(rows: list[dict]) -> list[str]:
    cells = sorted({(r["shapes"], r["batch"], r["context"]) for r in rows
                    if not r.get("interleaved", True)})
    if not cells:
        return []
    where = "; ".join(f"{f} B={b} S={c:,}" for f, b, c in cells)
    return [f"Whole-model cells timed one variant after another (their caches do not fit in "
            f"memory together), not interleaved: {where}."]


def render(rows: list[dict], meta: dict) -> str:
    out = ["# Decode-step cost by attention variant and context length", "",
           f"{meta['hardware'].get('cpu', 'CPU')} ({meta['hardware'].get('cpu_count')} cores), "
           f"torch {meta['versions']['torch']}, float32, git {_shas(meta)}. "
           f"Command: `{meta['command_line']}`. "
           "Median of interleaved rounds (one round for steps over the --slow-ms limit).",
           *_sequential_note(rows), ""]
    contexts = sorted({r["context"] for r in rows})
    for family in dict.fromkeys(r["shapes"] for r in rows):
        fam = [r for r in rows if r["shapes"] == family]
        variants = list(dict.fromkeys(r["variant"] for r in fam))
        first = {v: next(r for r in fam if r["variant"] == v and "skipped" not in r) for v in variants}
        out += [f"## {family} shapes", "",
                "Analytic, one layer, one decode step (T = 1), per cached key: multiply-accumulates, "
                "cache bytes read (float32; EG-MLA kv: + the int32 id, absorbed: + its norm "
                "statistics), and the gate-table bytes a kv step also reads (not KV cache). "
                "MACs per query: the part that does not grow with the context.", "",
                "| variant | MACs / key | MACs / query | cache B / key | gate-table B / key |",
                "|---|---:|---:|---:|---:|"]
        for v in variants:
            a = first[v]
            out.append(f"| {v} | {a['macs_per_key']:,} | {a['macs_per_query']:,} | "
                       f"{a['cache_bytes_per_key']:,} | {a['gate_bytes_per_key']:,} |")
        for scope, title in (("layer", "attention layer alone, ms per decode step"),
                             ("model", "whole model, ms per decode step")):
            for batch in sorted({r["batch"] for r in fam}):
                sel = {(r["variant"], r["context"]): r for r in fam
                       if r["scope"] == scope and r["batch"] == batch}
                if not sel:
                    continue
                out += ["", f"### {title}, batch {batch} (peak transient MiB in brackets)", "",
                        "| variant | " + " | ".join(f"S={c:,}" for c in contexts) + " |",
                        "|---|" + "---:|" * len(contexts)]
                for v in variants:
                    cells = []
                    for c in contexts:
                        r = sel.get((v, c))
                        if r is None:
                            cells.append("")
                        elif "skipped" in r:
                            cells.append("skipped")
                        else:
                            cells.append(f"{_fmt_ms(r['ms'])} [{r['peak_transient_mib']:,.0f}]")
                    out.append(f"| {v} | " + " | ".join(cells) + " |")
        out += ["", *absorption_summary(fam, contexts)]
    return "\n".join(out) + "\n"


def absorption_summary(fam: list[dict], contexts: list[int]) -> list[str]:
    """kv absorbed against kv rebuilt and against MLA, per layer; and auto's choice."""
    layer = {(r["variant"], r["batch"], r["context"]): r for r in fam
             if r["scope"] == "layer" and "skipped" not in r}
    pairs = sorted({v.removesuffix(" rebuilt") for v, _, _ in layer if v.endswith(" rebuilt")})
    mla = next((v for v, _, _ in layer if v.startswith("MLA")), None)
    if not pairs:
        return []
    lines = ["### EG-MLA kv: absorbed against rebuilt, per layer", "",
             "Speedup = rebuilt ms / absorbed ms (above 1: absorption pays). vs MLA = absorbed ms / "
             "MLA ms. auto: the computation `impl: auto` picks from its MAC count, and whether that "
             "is the faster one measured here.", "",
             "| variant | batch | " + " | ".join(f"S={c:,}" for c in contexts) + " |",
             "|---|---:|" + "---:|" * len(contexts)]
    for base in pairs:
        for batch in sorted({b for _, b, _ in layer}):
            cells = []
            for c in contexts:
                rb, ab = layer.get((f"{base} rebuilt", batch, c)), layer.get((f"{base} absorbed", batch, c))
                ml = layer.get((mla, batch, c))
                if not (rb and ab):
                    cells.append("")
                    continue
                speed = rb["ms"] / ab["ms"]
                faster_absorbed = speed > 1
                auto = ab["auto_picks_absorbed"]
                mark = ("auto: absorbed" if auto else "auto: rebuilt") + (
                    "" if auto == faster_absorbed else " (slower)")
                vs = f", {ab['ms'] / ml['ms']:.1f}x MLA" if ml else ""
                cells.append(f"{speed:.2f}x{vs}; {mark}")
            lines.append(f"| {base} | {batch} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=["paper", "small"], default=["paper", "small"])
    p.add_argument("--contexts", nargs="+", type=positive_int,
                   default=[256, 512, 1024, 2048, 4096, 8192],
                   help="cache lengths S (one layer's cache at the largest batch must fit "
                        "--max-cache-gib)")
    p.add_argument("--batches", nargs="+", type=positive_int, default=[1, 16])
    p.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds per cell")
    p.add_argument("--slow-ms", type=float, default=1500.0,
                   help="a step slower than this (first round) is timed once")
    p.add_argument("--max-cache-gib", type=float, default=6.0,
                   help="skip whole-model cells whose float32 cache is larger")
    p.add_argument("--max-group-gib", type=float, default=3.0,
                   help="whole-model cells of one (batch, context) whose caches add up to more are "
                        "timed one variant at a time instead of interleaved (memory)")
    p.add_argument("--quick", action="store_true",
                   help="by default small presets, S 256 and 1024, batch 1 (options given "
                        "explicitly still apply)")
    p.add_argument("--out", type=files.output_prefix,
                   help="path prefix (default benchmarks/results/decode_cost)")
    p.add_argument("--fresh", action="store_true",
                   help="ignore the <out>.partial.json of an earlier run cut short and start over")
    args = p.parse_args(argv)
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        p.set_defaults(shapes=["small"], contexts=[256, 1024], batches=[1], rounds=2)
        args = p.parse_args(argv)
    if not 0 <= args.slow_ms < float("inf"):
        p.error(f"--slow-ms {args.slow_ms}: must be a finite number >= 0")
    for name in ("max_cache_gib", "max_group_gib"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            p.error(f"--{name.replace('_', '-')} {value}: must be a finite number > 0")
    families = {"paper": PAPER, "small": SMALL}
    if too_big := oversized_layer(families, args):
        p.error(too_big)
    out = args.out or ROOT / "benchmarks/results" / ("decode_cost_quick" if args.quick else "decode_cost")
    grid = {k: v for k, v in vars(args).items() if k not in ("out", "fresh")}
    partial = out.with_name(out.name + ".partial.json")
    rows, segments = [], []
    if partial.exists() and not args.fresh:
        try:
            saved = read_partial(partial)
        except ValueError as err:
            p.error(f"{partial}: {err}; move it away, or give --fresh to start over")
        if saved["grid"] == grid:
            rows, segments = saved["rows"], saved["segments"]
            print(f"resuming {partial}: {len({group_key(r) for r in rows})} groups already "
                  f"measured (--fresh starts over)", flush=True)
        else:
            print(f"ignoring {partial}: it was started with other settings", flush=True)
    started, load_start = time.time(), os.getloadavg()
    segment = {"git": provenance()["git"], "started_unix": round(started),
               "groups_before": len({group_key(r) for r in rows}), "load_avg_start": load_start}
    segments.append(segment)
    out.parent.mkdir(parents=True, exist_ok=True)

    def checkpoint(rows_so_far: list[dict]) -> None:
        segment["load_avg_last"] = os.getloadavg()
        segment["elapsed_s"] = round(time.time() - started, 1)
        write_atomic(partial, json.dumps({"grid": grid, "segments": segments, "rows": rows_so_far},
                                         indent=1, default=str) + "\n")

    rows = run_grid({f: families[f] for f in args.shapes}, args.contexts, args.batches,
                    args.rounds, args.slow_ms, args.max_cache_gib * 2**30,
                    args.max_group_gib * 2**30, rows, checkpoint)
    checkpoint(rows)
    meta = {**provenance(), "command_line": " ".join(["python", *sys.argv]),
            "elapsed_s": round(sum(s.get("elapsed_s", 0) for s in segments), 1),
            "settings": vars(args) | {"out": str(out)}, "segments": segments,
            "load_avg_start_end": [segments[0]["load_avg_start"], os.getloadavg()]}
    text = render(rows, meta)
    write_atomic(out.with_suffix(".json"), json.dumps({"rows": rows, **meta}, indent=2, default=str) + "\n")
    write_atomic(out.with_suffix(".md"), text)
    partial.unlink()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
