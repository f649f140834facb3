"""KV-cache bytes per model config: analytic, and measured on a real allocated cache.

    python -m eval.kv_bytes                      # the paper's six configs, bf16, 1K/4K/32K tokens
    python -m eval.kv_bytes --presets small --dtype fp32 bf16 fp8
    python -m eval.kv_bytes --json > kv.json     # the same numbers as JSON on stdout

For every config the report gives the float elements cached per token (the paper's unit), the
bytes per token in each dtype (per-layer K/V fields, EG-MLA `kv`'s per-layer norm statistics and
per-sequence fields such as its int32 token ids, each stated separately), the cache size per
sequence at each context length, and the reduction against the same model with plain MHA and
against its MLA reference. Every number is also measured: a `ContiguousCache` (batch 1) is
allocated and its `nbytes()` must equal the analytic bytes exactly, and so must the serving
engine's paged pool for the blocks its block manager gives the same sequence (whole blocks: the
last one's empty slots are counted), or the command exits 1. See docs/kv_bytes.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from egmla import files
from egmla.cache import CacheSpec, ContiguousCache
from egmla.config import ConfigError, ModelConfig
from egmla.dtypes import REPORT_DTYPES, short_name
from egmla.dtypes import parse_dtype as parse_dtype_name
from egmla.models import cache_spec_for
from egmla.presets import PRESETS, preset
from egmla.provenance import git_info, hardware

PAPER_SET = ["paper-mha", "paper-gqa4", "paper-mla", "paper-egmla-kv256", "paper-egmla-kv64",
             "paper-egmla-kv16"]
GROUPS = {
    "paper": PAPER_SET,
    "small": [n for n in PRESETS if n.startswith("small-")],
    "tiny": [n for n in PRESETS if n.startswith("tiny-")],
    "all": list(PRESETS),
    "none": [],
}


class UsageError(ValueError):
    """A bad command-line value; `main` prints it as one line and exits 2."""


# ---- small pure helpers ----------------------------------------------------------------------


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' -> torch.bfloat16; anything not in REPORT_DTYPES raises UsageError."""
    try:
        return parse_dtype_name(name, REPORT_DTYPES, aliases=True)
    except ValueError as error:
        raise UsageError(str(error)) from None


def parse_length(text: str) -> int:
    """'4096' -> 4096, '32k' -> 32768 (k = 1024, m = 1024**2); must be >= 1."""
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale < 1:
        raise UsageError(f"bad length {text!r}: expected a positive integer such as 4096 or 32k")
    return int(digits) * scale


def resolve_presets(tokens: list[str]) -> list[str]:
    """Group names (paper, small, tiny, all, none) and preset names -> unique preset names."""
    names: list[str] = []
    for token in tokens:
        if token in GROUPS:
            names += GROUPS[token]
        elif token in PRESETS:
            names.append(token)
        else:
            raise UsageError(f"unknown preset {token!r}; groups: {', '.join(GROUPS)}; "
                             f"presets: {', '.join(PRESETS)}")
    return list(dict.fromkeys(names))


def load_config(path: str) -> ModelConfig:
    """A ModelConfig from a JSON file holding `ModelConfig.to_dict()`-shaped data."""
    try:
        data = json.loads(Path(path).read_text())
        return ModelConfig.from_dict(data)
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--config {path}: not valid JSON: {e}") from None
    except (ConfigError, TypeError) as e:
        raise UsageError(f"--config {path}: {e}") from None


def reduction_pct(value: int, baseline: int | None) -> float | None:
    """Change against a baseline in percent: 1536 vs 18432 -> -91.666...; None without one."""
    return None if not baseline else 100.0 * (value - baseline) / baseline


def human_bytes(n: int) -> str:
    """Binary units: 37748736 -> '36.00 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# ---- the report ------------------------------------------------------------------------------


@functools.cache
def _preset_configs() -> tuple[tuple[str, ModelConfig], ...]:
    return tuple((name, preset(name)) for name in PRESETS)


def _shape_key(config: ModelConfig) -> str:
    """Everything but the attention: configs with equal keys differ only in what they cache."""
    shape = {k: v for k, v in config.to_dict().items() if k != "attention"}
    return json.dumps(shape, sort_keys=True)


def _baselines(name: str, config: ModelConfig, selected: list[tuple[str, ModelConfig]]
               ) -> dict[str, tuple[str, ModelConfig] | None]:
    """The MHA and MLA references of a config, both of the same shape (layers, width, heads).

    MHA: the config itself with `attention: {type: mha}` (named after the preset it equals, if
    one does). MLA: the first selected config, else the first preset, of the same shape with
    attention type `mla`; None if there is none.
    """
    data = config.to_dict()
    try:
        mha = ModelConfig.from_dict({**data, "attention": {"type": "mha"}})
    except ConfigError:
        mha_ref = None
    else:
        twin = [n for n, c in _preset_configs() if c.to_dict() == mha.to_dict()]
        mha_ref = (twin[0] if twin else f"{name} as mha", mha)
    key = _shape_key(config)
    candidates = [*selected, *_preset_configs()]
    mla_ref = next(((n, c) for n, c in candidates
                    if c.attention.type == "mla" and _shape_key(c) == key), None)
    return {"mha": mha_ref, "mla": mla_ref}


def _describe_fields(fields: dict) -> dict[str, dict[str, Any]]:
    def dtype(f) -> str | None:
        if f.dtype is not None:
            return str(f.dtype)[6:]
        return None if f.min_dtype is None else f">={str(f.min_dtype)[6:]}"

    return {n: {"shape": list(f.shape), "dtype": dtype(f)} for n, f in fields.items()}


def measure(spec: CacheSpec, dtype: torch.dtype, tokens: int) -> dict[str, Any]:
    """Allocate a real batch-1 ContiguousCache of `tokens` positions and compare its bytes."""
    analytic = spec.bytes_per_token(dtype) * tokens
    try:
        cache = ContiguousCache(spec, batch_size=1, max_len=tokens, dtype=dtype, device="cpu")
    except (RuntimeError, TypeError) as e:  # a dtype this torch build cannot allocate
        return {"tokens": tokens, "nbytes": None, "analytic_nbytes": analytic, "match": False,
                "error": f"{type(e).__name__}: {e}"}
    nbytes = cache.nbytes()
    del cache
    return {"tokens": tokens, "nbytes": nbytes, "analytic_nbytes": analytic,
            "bytes_per_token": nbytes // tokens if nbytes % tokens == 0 else nbytes / tokens,
            "match": nbytes == analytic}


def measure_paged(spec: CacheSpec, dtype: torch.dtype, tokens: int, block_size: int
                  ) -> dict[str, Any]:
    """What one `tokens`-long sequence costs in the serving engine's paged cache.

    The engine's block manager hands out the sequence's blocks; a `PagedKVCache` of exactly that
    many blocks is allocated and its nbytes() compared with blocks x block_size x bytes/token.
    The difference from the contiguous figure is the last block's unused slots (`slack_bytes`):
    1,000 tokens in blocks of 16 take 63 blocks = 1,008 slots, 8 of them empty.
    """
    from serve.block_manager import BlockManager
    from serve.paged_cache import PagedKVCache

    manager = BlockManager(-(-tokens // block_size), block_size, enable_prefix_caching=False)
    manager.allocate_prompt(0, list(range(tokens)))
    if manager.append_slots(0, list(range(tokens)), tokens) is None:
        raise AssertionError(f"the block manager could not place {tokens} tokens")
    blocks = len(manager.block_table(0))
    analytic = blocks * block_size * spec.bytes_per_token(dtype)
    out = {"tokens": tokens, "block_size": block_size, "blocks": blocks, "analytic_nbytes": analytic}
    try:
        cache = PagedKVCache(spec, blocks, block_size, dtype=dtype, device="cpu")
    except (RuntimeError, TypeError) as e:
        return {**out, "nbytes": None, "match": False, "error": f"{type(e).__name__}: {e}"}
    nbytes = cache.nbytes()
    del cache
    return {**out, "nbytes": nbytes, "slack_bytes": nbytes - spec.bytes_per_token(dtype) * tokens,
            "match": nbytes == analytic}


def build_report(configs: list[tuple[str, ModelConfig]], contexts: list[int],
                 dtypes: list[torch.dtype], measure_len: int = 1024, measure_max: int = 4096,
                 block_size: int = 16) -> dict[str, Any]:
    """Analytic and measured KV bytes for each (name, config); plain JSON-ready data."""
    lengths = sorted({measure_len, *(c for c in contexts if c <= measure_max)})
    specs: dict[str, CacheSpec] = {}  # by config, not name: a --config file may reuse a name

    def spec_of(name: str, config: ModelConfig) -> CacheSpec:
        key = json.dumps(config.to_dict(), sort_keys=True)
        if key not in specs:
            specs[key] = cache_spec_for(config)
        return specs[key]

    rows, mismatches = [], []
    for name, config in configs:
        spec = spec_of(name, config)
        refs = _baselines(name, config, configs)
        ref_specs = {k: spec_of(*r) if r else None for k, r in refs.items()}
        elements = spec.elements_per_token()
        layer_fields = {json.dumps(_describe_fields(layer)) for layer in spec.layers}
        row: dict[str, Any] = {
            "name": name,
            "config": config.to_dict(),
            "n_layers": len(spec.layers),
            "layer_fields": _describe_fields(spec.layers[0]) if len(layer_fields) == 1 else None,
            "sequence_fields": _describe_fields(spec.sequence),
            "elements_per_token": elements,
            "references": {k: r[0] if r else None for k, r in refs.items()},
            "elements_change_pct": {
                k: reduction_pct(elements, s.elements_per_token() if s else None)
                for k, s in ref_specs.items()},
            "params": {"with_gate_tables": config.num_params(include_gate_tables=True),
                       "without_gate_tables": config.num_params(include_gate_tables=False)},
            "dtypes": {},
        }
        for dtype in dtypes:
            bpt = spec.bytes_per_token(dtype)
            measurements = [measure(spec, dtype, n) for n in lengths]
            paged = [measure_paged(spec, dtype, n, block_size) for n in lengths]
            bad = [m for m in measurements if not m["match"]]
            bad += [{"cache": "paged", **m} for m in paged if not m["match"]]
            mismatches += [{"name": name, "dtype": short_name(dtype), **m} for m in bad]
            measured = {m["tokens"]: m["nbytes"] for m in measurements}
            measured_paged = {m["tokens"]: m["nbytes"] for m in paged}
            row["dtypes"][short_name(dtype)] = {
                "torch_dtype": str(dtype),
                "layer_bytes_per_token": spec.layer_bytes_per_token(dtype),
                "auxiliary_bytes_per_token": spec.auxiliary_bytes_per_token(dtype),
                "sequence_bytes_per_token": spec.sequence_bytes_per_token(dtype),
                "bytes_per_token": bpt,
                "bytes_change_pct": {
                    k: reduction_pct(bpt, s.bytes_per_token(dtype) if s else None)
                    for k, s in ref_specs.items()},
                "totals": [{"context": c, "bytes": bpt * c, "measured_bytes": measured.get(c),
                            "paged_bytes": -(-c // block_size) * block_size * bpt,
                            "measured_paged_bytes": measured_paged.get(c)} for c in contexts],
                "measurements": measurements,
                "paged_measurements": paged,
                "match": not bad,
            }
        rows.append(row)
    return {
        "schema": "egmla.kv_bytes/1",
        "settings": {"contexts": contexts, "dtypes": [short_name(d) for d in dtypes],
                     "batch_size": 1, "measured_lengths": lengths,
                     "measure_len": measure_len, "measure_max": measure_max,
                     "block_size": block_size},
        "configs": rows,
        "all_match": not mismatches,
        "mismatches": mismatches,
    }


# ---- rendering -------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _fields(fields: dict[str, dict[str, Any]] | None) -> str:
    if fields is None:
        return "(differs by layer)"
    if not fields:
        return "-"
    return " ".join(n + (f"[{'x'.join(map(str, f['shape']))}]" if f["shape"] else "")
                    + (f":{f['dtype']}" if f["dtype"] else "") for n, f in fields.items())


def _table(headers: list[str], rows: list[list[str]], markdown: bool, text_cols: int = 1) -> str:
    """Columns before `text_cols` are left-aligned text, the rest right-aligned numbers."""
    if markdown:
        rule = ["---" if i < text_cols else "---:" for i in range(len(headers))]
        return "\n".join("| " + " | ".join(r) + " |" for r in [headers, rule, *rows])
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]
    fmt = lambda r: "  ".join(x.ljust(w) if i < text_cols else x.rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def render(report: dict[str, Any], markdown: bool = False) -> str:
    """The report as aligned plain-text tables (or markdown tables)."""
    s, rows = report["settings"], report["configs"]
    h = "### " if markdown else "== "
    out = [f"{h}Cached per token (all layers), references and parameters"]
    out.append(_table(
        ["config", "layers x per-layer fields", "per-seq fields", "MLA ref", "elems/tok", "vs MHA",
         "vs MLA", "params", "+gate tables"],
        [[r["name"], f"{r['n_layers']} x {_fields(r['layer_fields'])}",
          _fields(r["sequence_fields"]), r["references"]["mla"] or "-",
          f"{r['elements_per_token']:,}", _pct(r["elements_change_pct"]["mha"]),
          _pct(r["elements_change_pct"]["mla"]),
          _count(r["params"]["without_gate_tables"]),
          _count(r["params"]["with_gate_tables"])] for r in rows], markdown, text_cols=4))
    for dt in s["dtypes"]:
        out.append("")
        out.append(f"{h}Bytes, {dt} ({rows[0]['dtypes'][dt]['torch_dtype'] if rows else dt}), "
                   "cache size per sequence (batch 1)")
        ctx_heads = [f"@{c:,}" for c in s["contexts"]]
        body = []
        for r in rows:
            d = r["dtypes"][dt]
            body.append([r["name"], f"{d['layer_bytes_per_token']:,}",
                         f"{d['auxiliary_bytes_per_token']:,}",
                         f"{d['sequence_bytes_per_token']:,}", f"{d['bytes_per_token']:,}",
                         _pct(d["bytes_change_pct"]["mha"]), _pct(d["bytes_change_pct"]["mla"]),
                         *[human_bytes(t["bytes"]) + ("" if t["measured_bytes"] is None else "*")
                           for t in d["totals"]],
                         "yes" if d["match"] else "NO"])
        out.append(_table(["config", "B/tok K/V", "+ norm stats", "+ per-seq", "= B/tok", "vs MHA",
                           "vs MLA",
                           *ctx_heads, "measured=analytic"], body, markdown))
        out.append("")
        out.append(f"{h}Paged, {dt}: the serving engine's blocks of {s['block_size']} tokens, "
                   "one sequence (whole blocks; slack = the last block's empty slots)")
        body = []
        for r in rows:
            d = r["dtypes"][dt]
            body.append([r["name"], f"{d['bytes_per_token'] * s['block_size']:,}",
                         *[human_bytes(t["paged_bytes"])
                           + ("" if t["measured_paged_bytes"] is None else "*")
                           + (f" (+{human_bytes(t['paged_bytes'] - t['bytes'])})"
                              if t["paged_bytes"] > t["bytes"] else "")
                           for t in d["totals"]],
                         "yes" if all(m["match"] for m in d["paged_measurements"]) else "NO"])
        out.append(_table(["config", "B/block", *ctx_heads, "measured=analytic"], body, markdown))
    n_alloc = sum(len(d["measurements"]) for r in rows for d in r["dtypes"].values())
    lengths = [f"{n:,}" for n in s["measured_lengths"]]
    lengths = ", ".join(lengths[:-1]) + " and " * (len(lengths) > 1) + lengths[-1]
    unallocated = [f"{c:,}" for c in s["contexts"] if c not in s["measured_lengths"]]
    if report["all_match"]:
        notes = [f"Measured == analytic for every row: {n_alloc} ContiguousCache allocations "
                 f"(batch 1; {lengths} tokens), nbytes() equal to bytes/token x tokens exactly.",
                 f"Paged == analytic too: {n_alloc} PagedKVCache pools of the blocks the engine's "
                 "block manager gives those sequences, nbytes() = blocks x block size x bytes/token."]
    else:
        notes = [f"MISMATCH: measured != analytic in {len(report['mismatches'])} of {2 * n_alloc} "
                 "allocations:\n" + "\n".join(
                     f"- {m['name']} {m['dtype']} {m.get('cache', 'contiguous')} @{m['tokens']}: "
                     f"measured {m['nbytes']}, analytic "
                     f"{m['analytic_nbytes']} {m.get('error', '')}".rstrip()
                     for m in report["mismatches"])]
    notes.append("Sizes marked * were allocated and measured at that length." + (
        f" Sizes at {', '.join(unallocated)} tokens are bytes/token x tokens, not allocated "
        "(raise --measure-max to allocate them)." if unallocated else ""))
    notes.append("vs MHA: against the same model with plain MHA; vs MLA: against the MLA config of "
                 "the same shape (MLA ref). Elements exclude per-sequence int fields and norm stats; "
                 "bytes include them.")
    out += ["", *notes] if not markdown else [x for n in notes for x in ("", n)]
    return "\n".join(out) + "\n"


# ---- metadata and CLI ------------------------------------------------------------------------


def metadata(argv: list[str]) -> dict[str, Any]:
    """What produced this report: command, git SHA, versions, host."""
    git = git_info()
    return {
        "command": shlex.join(["python", "-m", "eval.kv_bytes", *argv]),
        "git_sha": git["sha"], "git_dirty": git["dirty"],
        "torch": torch.__version__, "python": platform.python_version(),
        **hardware(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


EPILOG = """\
examples:
  python -m eval.kv_bytes                                  # paper set, bf16, 1K/4K/32K
  python -m eval.kv_bytes --presets small --dtype fp32 bf16 fp8
  python -m eval.kv_bytes --presets paper-mla paper-egmla-kv64 --context 128k
  python -m eval.kv_bytes --presets none --config my_model.json
  python -m eval.kv_bytes --json > kv_bytes.json           # JSON on stdout instead of tables
  python -m eval.kv_bytes --output-dir runs/kv             # also writes kv_bytes.{json,md}
  python -m eval.kv_bytes --measure-max 32k                # allocate every context length

groups for --presets: paper (default), small, tiny, all, none
dtypes: fp32/float32, bf16/bfloat16, fp16/float16, fp8/float8_e4m3fn
exit status: 0 ok, 1 measured != analytic somewhere, 2 bad arguments
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.kv_bytes", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="KV-cache size per model config: float elements per token, bytes per token\n"
                    "per dtype, cache size per sequence at each context length, and the reduction\n"
                    "against MHA and MLA; every row checked against a really allocated cache.")
    p.add_argument("--presets", nargs="+", default=["paper"], metavar="NAME",
                   help="preset names or groups (paper, small, tiny, all, none); default: paper")
    p.add_argument("--config", action="append", default=[], metavar="PATH",
                   help="add a model config from a JSON file (ModelConfig.to_dict() shape); "
                        "repeatable; named after the file")
    p.add_argument("--context", nargs="+", default=["1024", "4096", "32768"], metavar="N",
                   help="context lengths in tokens (32k = 32768); default: 1024 4096 32768")
    p.add_argument("--dtype", nargs="+", default=["bf16"], metavar="DTYPE",
                   help="cache float dtypes; default: bf16")
    p.add_argument("--measure-len", default="1024", metavar="N",
                   help="always allocate a cache of this many tokens (default 1024)")
    p.add_argument("--measure-max", default="4096", metavar="N",
                   help="also allocate at each context length up to N tokens (default 4096)")
    p.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="tokens per block of the paged (serving) cache; default: 16, the engine's")
    p.add_argument("--json", action="store_true", help="print JSON to stdout instead of tables")
    p.add_argument("--output-dir", metavar="DIR",
                   help="also write DIR/kv_bytes.json and DIR/kv_bytes.md (with metadata)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        configs = [(n, preset(n)) for n in resolve_presets(args.presets)]
        configs += [(Path(p).stem, load_config(p)) for p in args.config]
        if not configs:
            raise UsageError("nothing to report: no presets and no --config")
        if len({n for n, _ in configs}) != len(configs):
            raise UsageError(f"duplicate config names: {[n for n, _ in configs]}")
        contexts = list(dict.fromkeys(parse_length(c) for c in args.context))
        dtypes = list(dict.fromkeys(parse_dtype(d) for d in args.dtype))
        measure_len, measure_max = parse_length(args.measure_len), parse_length(args.measure_max)
        if args.block_size < 1:
            raise UsageError(f"--block-size {args.block_size}: must be >= 1")
        if args.output_dir:  # made now: a directory that cannot be fails before any work
            try:
                Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise UsageError(f"--output-dir {args.output_dir}: {err.strerror or err}") from None
    except UsageError as e:
        print(f"kv_bytes: error: {e}", file=sys.stderr)
        return 2

    report = build_report(configs, contexts, dtypes, measure_len, measure_max, args.block_size)
    report["metadata"] = {**metadata(argv), "elapsed_s": round(time.perf_counter() - start, 3)}
    text = json.dumps(report, indent=2)
    print(text if args.json else render(report), end="\n" if args.json else "")
    if args.output_dir:
        out = Path(args.output_dir)
        meta = "\n".join(f"- {k}: `{v}`" for k, v in report["metadata"].items())
        files.write_text(out / "kv_bytes.json", text + "\n")  # whole files or none
        files.write_text(out / "kv_bytes.md", f"# KV-cache bytes\n\n{meta}\n\n{render(report, True)}")
    if not report["all_match"]:
        print(f"kv_bytes: error: measured != analytic in {len(report['mismatches'])} allocations",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
