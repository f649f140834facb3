"""`python -m egmla.export --checkpoint RUN_OR_CKPT --out DIR [--format hf|native|egmla]`."""

from __future__ import annotations

import argparse
import os
import sys

EPILOG = """\
formats:
  hf      transformers format + our modeling code (all variants); load it with
          AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
  native  no remote code: MHA as Llama, MLA as dense DeepSeek-V3 (what vLLM serves natively);
          EG-MLA has no native architecture and is refused
  egmla   egmla's plain export (config.json + model.safetensors)

examples:
  python -m egmla.export --checkpoint runs/quickstart --out exports/quickstart-hf
  python -m egmla.export --checkpoint runs/x/checkpoints/last.ckpt --out exports/x --format egmla
  lm_eval --model hf --model_args pretrained=exports/quickstart-hf,trust_remote_code=True ...

Nothing is written unless the export succeeds; errors are one line and exit status 2
(EGMLA_DEBUG=1 shows the traceback). See docs/export.md.
"""

from egmla.dtypes import WEIGHT_DTYPES as DTYPES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m egmla.export",
        description="Export an egmla checkpoint for transformers, lm-eval and vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, metavar="RUN_OR_CKPT",
                        help="a run directory, a Lightning .ckpt, an egmla export, a "
                             "transformers directory (ours or a Llama), or a known model name")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    parser.add_argument("--format", default="hf", choices=("hf", "native", "egmla"),
                        help="what to write (default: hf)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast the weights (default: keep the checkpoint's dtype)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out even if egmla.export did not write it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from egmla.checkpoint import CheckpointError
    from egmla.config import DEEPSEEK_LATENT_NORM_EPS, ConfigError
    from egmla.dtypes import dtype_name, parse_dtype
    from egmla.export import export, load_source
    from egmla.export.hf import transformers_cache_spec
    from egmla.models import cache_spec_for

    dtype = parse_dtype(args.dtype) if args.dtype else None
    try:
        out = export(args.checkpoint, args.out, format=args.format, dtype=dtype,
                     overwrite=args.overwrite)
        # Read back what was written: the summary describes the files, not the intentions.
        written = load_source(out)
    except (CheckpointError, ConfigError, ValueError, OSError) as err:
        if os.environ.get("EGMLA_DEBUG"):
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)  # one line
        return 2
    model = written.model
    config, weight_dtype = model.config, next(model.parameters()).dtype
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"wrote {out} ({args.format} format, {len(files)} files, {size / 2**20:.1f} MiB)")
    print(f"  attention      {config.attention.type}, {config.n_layers} layers, "
          f"{model.num_params():,} parameters, {dtype_name(weight_dtype)}")
    spec = transformers_cache_spec(config) if args.format == "hf" else cache_spec_for(config)
    print(f"  KV cache       {spec.bytes_per_token(weight_dtype):,} bytes per token (what the "
          "exported model caches)")
    print(f"  tokenizer      {'included' if written.tokenizer is not None else 'none'}")
    if args.format == "hf":
        print("  load with      AutoModelForCausalLM.from_pretrained("
              f"{str(out)!r}, trust_remote_code=True)")
    elif args.format == "native":
        print(f"  load with      AutoModelForCausalLM.from_pretrained({str(out)!r}) or vllm serve")
        latent = DEEPSEEK_LATENT_NORM_EPS  # what transformers computes and the model trained at
        if config.attention.native_architecture == "deepseek_v3" and config.norm_eps != latent:
            # vLLM's DeepSeek model builds the latent norms with rms_norm_eps, the block norms' eps
            print(f"  note           vLLM computes the latent norms with rms_norm_eps="
                  f"{config.norm_eps:g}, not the trained {latent:g} (docs/export.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
