"""Convert a pretrained GQA/MHA model to MLA or EG-MLA and write a plain export.

    python -m egmla.upcycle --model SmolLM2-135M-Instruct --to mla --d-c 48 --out exports/mla48
    python -m egmla.upcycle --model SmolLM2-135M-Instruct --to egmla --d-c 24 \\
        --gate-position latent --out exports/egmla-latent24

The export (config.json, model.safetensors, the tokenizer) loads with `load_export`,
`serve.LLM` and `python -m serve --model DIR`; its config.json's "extra.upcycle" records the
options, the frequencies kept per layer and KV head, and the singular-value energy kept.
Calibration text (for the 2-norm rule, the whitened SVD and the paper-form gate) is the first
tokens of the recovery mixture's training split (egmla.data.recovery), never evaluated text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from egmla.checkpoint import CheckpointError, check_destination, save_export
from egmla.config import ConfigError
from egmla.upcycle import GATE_FORMS, TARGETS, UpcycleError, check_options, upcycle
from egmla.upcycle.rope import RULES
from egmla.upcycle.svd import SVD_KINDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m egmla.upcycle", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The method and its choices: docs/upcycling.md")
    p.add_argument("--model", required=True,
                   help="the source: a known name (SmolLM2-135M-Instruct), an egmla export or a "
                        "transformers Llama directory")
    p.add_argument("--to", required=True, choices=TARGETS, help="the target attention")
    p.add_argument("--d-c", type=int, required=True,
                   help="the latent width (all KV heads together); SmolLM2 with --rope-dims 8: "
                        "96, 48, 24 are MHA2MLA's sizes, 360 keeps everything")
    p.add_argument("--rope-dims", type=int, default=8,
                   help="RoPE dims kept per KV head (default 8: four frequency pairs)")
    p.add_argument("--rule", choices=RULES, default="2norm",
                   help="which frequency pairs keep RoPE (default 2norm, MHA2MLA's best)")
    p.add_argument("--svd", choices=SVD_KINDS, default="whitened",
                   help="whitened by the inputs' second moment (activation-aware; default), or "
                        "plain (MHA2MLA's default)")
    g = p.add_argument_group("EG-MLA's gate (--to egmla)")
    g.add_argument("--gate-form", choices=GATE_FORMS, default=None,
                   help="identity: g = 1 + W_UE E[id] starting at 1 (step 0 equals the MLA "
                        "conversion); paper: LayerNorm after the gate, fitted (default identity)")
    g.add_argument("--gate-position", choices=("kv", "latent"), default=None,
                   help="gate the up-projected K/V (kv, default) or the latent")
    g.add_argument("--d-e", type=int, default=None, help="gate table width (default 32)")
    g.add_argument("--gate-group-size", type=int, default=None,
                   help="consecutive layers sharing one gate table (default 2)")
    g.add_argument("--seed", type=int, default=None, help="draws the gate tables (default 0)")
    c = p.add_argument_group("calibration")
    c.add_argument("--calibration-tokens", type=int, default=32768,
                   help="tokens of the recovery mixture to calibrate on (default 32768)")
    c.add_argument("--calibration-seq-len", type=int, default=512,
                   help="their sequence length (default 512)")
    p.add_argument("--out", required=True, type=Path, help="the export directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if egmla did not write it")
    return p


def calibration_ids(tokenizer, tokens: int, seq_len: int) -> torch.Tensor:
    """(tokens // seq_len, seq_len) token ids: the start of the recovery mixture's training
    split, tokenized with `tokenizer` (cached)."""
    from egmla.data.packing import tokenize_to_cache
    from egmla.data.sources import load_text_source

    source = load_text_source("recovery")
    flat = tokenize_to_cache(source.train, tokenizer, {"data": source.fingerprint,
                                                       "split": "train", "purpose": "calibration"},
                             max_tokens=tokens, desc="tokenize calibration")
    n = len(flat) // seq_len
    if n < 1:
        raise UpcycleError(f"--calibration-tokens={tokens}: fewer than one sequence of "
                           f"--calibration-seq-len={seq_len}")
    return torch.from_numpy(flat[: n * seq_len].astype("int64")).view(n, seq_len)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (UpcycleError, ConfigError, CheckpointError, ValueError, OSError) as err:
        if os.environ.get("EGMLA_DEBUG"):
            raise
        message = str(err).replace("\n", " ")
        print(f"python -m egmla.upcycle: error: {message} (EGMLA_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from egmla.imports import load_pretrained

    for name in ("d_c", "rope_dims", "calibration_tokens", "calibration_seq_len"):
        value = getattr(args, name)
        if value < (0 if name == "calibration_tokens" else 1):
            raise UpcycleError(f"--{name.replace('_', '-')}={value}: must be positive")
    gate_flags = {"--gate-form": args.gate_form, "--gate-position": args.gate_position,
                  "--d-e": args.d_e, "--gate-group-size": args.gate_group_size,
                  "--seed": args.seed}
    given = [flag for flag, value in gate_flags.items() if value is not None]
    if args.to == "mla" and given:
        raise UpcycleError(f"{', '.join(given)}: EG-MLA's gate options, for --to egmla")
    gate_form = args.gate_form or "identity"
    seed = 0 if args.seed is None else args.seed
    if not 0 <= seed < 2**64:
        raise UpcycleError(f"--seed={seed}: must be in [0, 2**64)")
    check_destination(args.out, args.overwrite)  # a bad --out fails now, not after the conversion
    started = time.perf_counter()
    model, tokenizer = load_pretrained(args.model, dtype=torch.float32)
    check_options(model, to=args.to, d_c=args.d_c, rope_dims=args.rope_dims, rule=args.rule,
                  svd=args.svd, gate_form=gate_form, gate_position=args.gate_position,
                  d_e=args.d_e, gate_group_size=args.gate_group_size,
                  seed=seed)  # before any calibration
    if args.calibration_seq_len > model.config.max_seq_len:
        raise UpcycleError(f"--calibration-seq-len={args.calibration_seq_len}: the model's "
                           f"context is {model.config.max_seq_len} tokens")
    calibration = None
    if args.calibration_tokens:
        if tokenizer is None:
            raise UpcycleError(f"--model {args.model}: has no tokenizer to calibrate with; pass "
                               "--calibration-tokens 0 with --rule high|low|uniform --svd plain")
        calibration = calibration_ids(tokenizer, args.calibration_tokens, args.calibration_seq_len)
        if calibration.numel() < args.calibration_tokens:
            print(f"calibrating on {calibration.numel():,} tokens, not {args.calibration_tokens:,}: "
                  f"whole sequences of {args.calibration_seq_len} from what the recovery "
                  "mixture's training split holds", file=sys.stderr)
    result = upcycle(model, to=args.to, d_c=args.d_c, rope_dims=args.rope_dims, rule=args.rule,
                     calibration=calibration, svd=args.svd, gate_form=gate_form,
                     gate_position=args.gate_position, d_e=args.d_e,
                     gate_group_size=args.gate_group_size, seed=seed, progress=True)
    record = result.record()
    original = model.cache_spec().elements_per_token()
    save_export(result.model, args.out, tokenizer=tokenizer, overwrite=args.overwrite,
                extra={"source": str(args.model), "upcycle": record,
                       "source_kv_elements_per_token": original})
    energy = record["energy_kept"]
    print(f"{args.out}: {args.to} d_c {args.d_c}, rope {args.rope_dims} per KV head ({args.rule}); "
          f"KV {record['kv_elements_per_token']:,} elements per token against the original's "
          f"{original:,} ({record['kv_elements_per_token'] / original:.1%}); energy kept "
          f"{min(energy):.3f}-{max(energy):.3f} by layer; {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
