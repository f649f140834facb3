"""Decode attention of each variant at the paper's shapes, read from paged pools: our native
kernels against the PyTorch path they replace and against the roofline of the machine.

One layer's attention core for one decode step (one query per sequence over its cached keys,
the projections left out), float32 pools holding each sequence's keys in blocks of 16 slots in
scattered order, on huge pages, as serve's paged cache holds them (and enough copies of the
cache, each call reading the next, that the keys come from memory, not from the last call's
cache), at batch 1 over 1,024 / 4,096 / 8,192 keys and batch 16 over 1,024 / 4,096
(`--contexts`, `--batches`):

- `mha` (paper-mha: 12 heads of 64): `native` is egmla.kernels.paged_attention; `pytorch`
  gathers K and V into a padded copy (index_select, as serve's gather path does) and runs SDPA
  with the causal mask (egmla.models.attention.common.attend);
- `mla` (paper-mla: d_c 256, d_rope 64) and `egmla-latent` (paper-egmla-latent64: d_c 64):
  absorbed decode, an MQA over [c, k_rope] with value c; `native` is
  egmla.kernels.paged_latent_attention, `pytorch` the gather + SDPA of MLA._absorbed;
- `egmla-kv` (paper-egmla-kv256, d_e 256, LayerNorm): its absorbed form (cached norm
  statistics, gate rows looked up per key); `native` is egmla.kernels.paged_gated_attention
  (the per-key work, read in place) between the per-query work in PyTorch
  (EGMLA._absorbed_query and _absorbed_output), `pytorch` EGMLA._absorbed over gathered fields.

The roofline of a cell: the bytes a step must read (every key's cached fields once, and for
`egmla-kv` its keys' gate-table rows and token ids) over the machine's read bandwidth, or the
multiply-accumulates it must do (the layer's decode_cost: per key and per query) over the
machine's FMA throughput, whichever is longer. Both rates are measured in the same run
(`--threads` threads), before and after the timings: bandwidth as the best of 5 sums over 135M
float32 values, FMA throughput as the best of 5 float32 2048^3 matrix products (MACs / s); the
roofline takes the better of the two measurements of each (a moment's slowdown while a rate
is measured would otherwise lower the bound and flatter every ratio: one run measured 52
GMAC/s before and 94 after). `time_over_roofline` is the measured time over that bound.

Method: every (batch, context) cell, variant and path interleaved, `--repeats` rounds, the path
order alternating; each measurement is the mean of enough calls to fill 50 ms; the median over
rounds is reported with min..max, and native/pytorch as the median of the per-round ratios.

    python benchmarks/latent_decode.py                 # the grid, about 5 minutes on 2 cores
    python benchmarks/latent_decode.py --quick         # batch 1, 1,024 keys, 2 rounds

Writes benchmarks/results/latent_decode.{json,md} (latent_decode_quick.* with --quick) with
the configuration, git SHA, versions and load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from egmla import files, kernels  # noqa: E402
from egmla.devices import thread_count  # noqa: E402
from egmla.models.attention import attention_module  # noqa: E402
from egmla.models.attention.common import attend  # noqa: E402
from egmla.models.positions import Positions  # noqa: E402
from egmla.presets import preset  # noqa: E402
from egmla.provenance import provenance  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402

VARIANTS = {"mha": "paper-mha", "mla": "paper-mla", "egmla-latent": "paper-egmla-latent64",
            "egmla-kv": "paper-egmla-kv256", "egmla-kv64": "paper-egmla-kv64"}
GATED = ("egmla-kv", "egmla-kv64")
FILL_S = 0.05  # each measurement: calls until this long
BLOCK = 16  # tokens per cache block (serve's default), the blocks in scattered order
COLD_BYTES = 96 << 20  # a cell's cache copies total at least this (3x the L3 of this machine)
MAX_KEYS = 1 << 20  # batch x keys of a cell at most: MHA's float32 K and V for 2**20 keys are 6 GiB


def layer(variant: str):
    """The variant's attention module (layer 0 of its paper preset), float32, absorbed decode."""
    cfg = preset(VARIANTS[variant])
    torch.manual_seed(0)
    module = attention_module(cfg.attention).build_layers(cfg)[0]
    return module.float().eval(), cfg


def pool(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A cache pool of random values, where serve's paged cache puts its pools (huge pages)."""
    made = kernels.huge_zeros([(shape, torch.float32)])
    t = made[0] if made else torch.empty(shape)
    return t.copy_(torch.randn(shape, generator=g))


class Cell:
    """One variant's pools and queries at (batch, context), and its paths as callables."""

    def __init__(self, variant: str, batch: int, context: int):
        self.variant, self.batch, self.context = variant, batch, context
        self.module, cfg = layer(variant)
        g = torch.Generator().manual_seed(batch * 7919 + context)
        m, B = self.module, batch
        cost = m.decode_cost(context)
        self.macs = B * (cost["macs_per_key"] * context + cost["macs_per_query"])
        self.bytes = B * context * (cost["cache_bytes_per_key"] + cost["lookup_bytes_per_key"])
        # Copies of the cache, each call reading the next, so that a step's keys come from
        # memory and not from the last call's L3 (as a model's many layers do)
        self.copies = max(1, -(-COLD_BYTES // self.bytes))
        blocks = self.copies * batch * -(-context // BLOCK)
        slots_n = blocks * BLOCK
        order = torch.randperm(blocks, generator=g)[:, None] * BLOCK + torch.arange(BLOCK)
        self.tables = order.view(self.copies, batch, -1)[..., :context].contiguous()
        self.turn = 0
        self.lengths = torch.full((batch,), context)
        if variant == "mha":
            H, D = cfg.n_heads, cfg.d_model // cfg.n_heads
            self.k = pool((slots_n, H, D), g)
            self.v = pool((slots_n, H, D), g)
            self.q = torch.randn(B, H, D, generator=g)
            self.scale = D**-0.5
        else:
            C, r = m.d_c, m.d_rope
            self.c = pool((slots_n, C), g)
            self.k_rope = pool((slots_n, r), g)
            self.q = torch.randn(B, m.n_heads, C + r, generator=g) * 0.1
            self.scale = m.scale
        if variant in GATED:
            self.ids = torch.randint(0, cfg.vocab_size, (slots_n,), generator=g)
            self.ids32 = self.ids.int()  # the paged cache's token-id pool
            self.stats = torch.rand(slots_n, 2, generator=g) + 0.5  # mu, inv_sigma
            self.q_nope = torch.randn(B, 1, m.n_heads, m.d_nope, generator=g)
            self.q_rope = torch.randn(B, 1, m.n_heads, r, generator=g)
        self.positions = Positions.of(torch.full((B, 1), context - 1))
        self.key_positions = torch.arange(context).expand(B, context)

    @property
    def slots(self) -> torch.Tensor:
        """The next copy's slot table (B, context)."""
        self.turn = (self.turn + 1) % self.copies
        return self.tables[self.turn]

    def gather(self, *pools: torch.Tensor) -> list[torch.Tensor]:
        """Each pool's rows of the next copy's slots, padded per row (serve's gather path)."""
        slots = self.slots
        return [p.index_select(0, slots.flatten()).view(*slots.shape, *p.shape[1:]) for p in pools]

    def paths(self) -> dict:
        if self.variant == "mha":
            return {"native": lambda: kernels.paged_attention(self.q, self.k, self.v, self.slots,
                                                              self.lengths, self.scale),
                    "pytorch": self.pytorch_mha}
        if self.variant in GATED:
            return {"native": self.native_kv, "pytorch": self.pytorch_kv,
                    "pytorch-rebuild": self.pytorch_kv_rebuild}
        return {"native": lambda: kernels.paged_latent_attention(
                    self.q, self.c, self.k_rope, self.slots, self.lengths, self.scale),
                "pytorch": self.pytorch_latent}

    def pytorch_mha(self):
        k, v = self.gather(self.k, self.v)
        return attend(self.q[:, None], k, v, self.scale, self.positions, self.key_positions)

    def pytorch_latent(self):
        c, k_rope = self.gather(self.c, self.k_rope)
        k = torch.cat((c, k_rope), dim=-1)[:, :, None]
        return attend(self.q[:, None], k, c[:, :, None], self.scale, self.positions,
                      self.key_positions)

    def native_kv(self):
        m = self.module
        m_q, q_mu, outputs = m._absorbed_query(self.q_nope)
        a, msum = kernels.paged_gated_attention(
            m_q[:, 0], q_mu[:, 0], self.q_rope[:, 0], self.c, self.k_rope, self.stats, self.ids32,
            m.gate_table.weight, m.gate_residual, self.slots, self.lengths, m.scale)
        return m._absorbed_output(a[:, None], msum[:, None], outputs)

    def pytorch_kv(self):
        c, k_rope, stats, ids = self.gather(self.c, self.k_rope, self.stats, self.ids)
        fields = {"c": c, "k_rope": k_rope, "norm_stats": stats}
        return self.module._absorbed(self.q_nope, self.q_rope, fields, ids, self.positions,
                                     self.key_positions)

    def pytorch_kv_rebuild(self):
        c, k_rope, ids = self.gather(self.c, self.k_rope, self.ids)
        return self.module._naive(self.q_nope, self.q_rope, {"c": c, "k_rope": k_rope}, ids,
                                  self.positions, self.key_positions)


def timed(fn) -> float:
    """Mean seconds per call over calls filling FILL_S (after one warm-up call)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= FILL_S and calls >= 3:
            return elapsed / calls


def machine_rates(rounds: int = 5) -> dict:
    """Read bandwidth (GB/s, sums over 135M float32) and FMA throughput (GMAC/s, 2048^3 fp32
    matmuls), best of `rounds` each."""
    x = torch.ones(135_000_000)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    bw, macs = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        bw.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        a @ b
        macs.append(2048**3 / (time.perf_counter() - t) / 1e9)
    return {"read_gb_s": max(bw), "fma_gmac_s": max(macs), "read_runs": bw, "fma_runs": macs}


def grid(batches: list[int], contexts: list[int]) -> list[tuple[int, int]]:
    """The (batch, context) cells measured: batch > 1 stops at 4,096 keys."""
    return [(b, s) for b in batches for s in contexts if not (b > 1 and s > 4096)]


@torch.no_grad()
def measure(args) -> tuple[list[dict], dict]:
    rates = machine_rates()
    cells = [Cell(v, b, s) for b, s in grid(args.batches, args.contexts) for v in args.variants]
    times: dict[tuple, list[float]] = {}
    for rep in range(args.repeats):
        for cell in cells:
            paths = list(cell.paths().items())
            for name, fn in (paths if rep % 2 == 0 else paths[::-1]):
                times.setdefault((cell.variant, cell.batch, cell.context, name), []).append(timed(fn))
        print(f"round {rep + 1}/{args.repeats} done", flush=True)
    rates_after = machine_rates()
    best = {k: max(rates[k], rates_after[k]) for k in ("read_gb_s", "fma_gmac_s")}
    rows = []
    for cell in cells:
        bound = max(cell.bytes / (best["read_gb_s"] * 1e9), cell.macs / (best["fma_gmac_s"] * 1e9))
        key = (cell.variant, cell.batch, cell.context)
        for path in cell.paths():
            runs = times[(*key, path)]
            median = statistics.median(runs)
            row = {"variant": cell.variant, "preset": VARIANTS[cell.variant], "batch": cell.batch,
                   "context": cell.context, "path": path, "median_s": median, "min_s": min(runs),
                   "max_s": max(runs), "runs_s": runs, "bytes": cell.bytes, "macs": cell.macs,
                   "roofline_s": bound,
                   "bound_by": ("bandwidth" if cell.bytes / best["read_gb_s"]
                                >= cell.macs / best["fma_gmac_s"] else "fma"),
                   "time_over_roofline": median / bound}
            if path == "native":
                paired = [n / p for n, p in zip(runs, times[(*key, "pytorch")])]
                row["native_over_pytorch"] = statistics.median(paired)
                row["native_over_pytorch_runs"] = paired
            rows.append(row)
    return rows, {"before": rates, "after": rates_after, "roofline": best}


def markdown(result: dict) -> str:
    meta, rates = result["meta"], result["machine"]["before"]
    lines = ["# Decode attention from paged pools: native kernels, PyTorch, roofline", "",
             (f"{meta['time_utc']}; git {meta['git']['sha'][:10]}"
              f"{' (dirty tree)' if meta['git']['dirty'] else ''}; torch "
              f"{meta['versions'].get('torch')}; {result['config']['threads']} threads; load "
              f"average {result['load_average']['before']} before, "
              f"{result['load_average']['after']} after."), "",
             (f"Machine, measured in this run: read {rates['read_gb_s']:.1f} GB/s, FMA "
              f"{rates['fma_gmac_s']:.1f} GMAC/s (float32 matmul); after the timings "
              f"{result['machine']['after']['read_gb_s']:.1f} GB/s and "
              f"{result['machine']['after']['fma_gmac_s']:.1f} GMAC/s; the roofline takes the better "
              "of each."), "",
             ("One layer's attention for one decode step, float32 pools, medians over "
              f"{result['config']['repeats']} interleaved rounds (min..max). Roofline: bytes / "
              "bandwidth or MACs / FMA rate, the longer; native/pytorch: median of the per-round "
              "ratios."), "",
             ("| variant | batch | keys | path | time ms | roofline ms | bound by | x roofline "
              "| native/pytorch |"),
             "|---|---:|---:|---|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        ratio = f"{r['native_over_pytorch']:.3f}" if "native_over_pytorch" in r else ""
        lines.append(f"| {r['variant']} | {r['batch']} | {r['context']} | {r['path']} | "
                     f"{r['median_s'] * 1e3:.3f} ({r['min_s'] * 1e3:.3f}..{r['max_s'] * 1e3:.3f}) | "
                     f"{r['roofline_s'] * 1e3:.3f} | {r['bound_by']} | "
                     f"{r['time_over_roofline']:.2f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--batches", nargs="+", type=positive_int, default=[1, 16])
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[1024, 4096, 8192],
                   help="keys per sequence (batch > 1 stops at 4,096: larger MHA caches do "
                        f"not fit in 24 GiB beside the rest); batch x keys at most {MAX_KEYS:,}")
    p.add_argument("--repeats", type=positive_int, default=5, help="interleaved rounds (5)")
    p.add_argument("--threads", type=thread_count, default=2, help="torch threads (2)")
    p.add_argument("--quick", action="store_true",
                   help="by default batch 1, 1,024 keys, 2 rounds (options given explicitly still apply)")
    p.add_argument("--out", type=files.output_directory, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        p.set_defaults(batches=[1], contexts=[1024], repeats=2)
        args = p.parse_args(argv)
    if not (cells := grid(args.batches, args.contexts)):
        p.error(f"--batches {args.batches} --contexts {args.contexts}: no cell to measure "
                "(batch > 1 stops at 4,096 keys)")
    b, s = max(cells, key=lambda cell: cell[0] * cell[1])
    if b * s > MAX_KEYS:
        p.error(f"--contexts {s} at --batches {b}: {b * s:,} keys in one cell, at most "
                f"{MAX_KEYS:,} (the cache pools are held in memory)")
    torch.set_num_threads(args.threads)
    if not kernels.load():
        p.error(f"the kernels are unavailable: {kernels.status()['reason']}")
    load_before = os.getloadavg()
    rows, machine = measure(args)
    result = {"meta": provenance(), "config": {k: v for k, v in vars(args).items() if k != "out"},
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "machine": machine, "rows": rows}
    stem = "latent_decode_quick" if args.quick else "latent_decode"
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_json(args.out / f"{stem}.json", result, indent=2)
    md = markdown(result)
    files.write_text(args.out / f"{stem}.md", md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
