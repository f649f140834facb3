"""`python -m serve --model MODEL`: the OpenAI-compatible HTTP server.

MODEL is a training export directory (runs/<name>/export) or a known imported model name
(SmolLM2-135M-Instruct). Try it with any OpenAI client:

    python -m serve --model SmolLM2-135M-Instruct --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from egmla.dtypes import WEIGHT_DTYPES as DTYPES
from egmla.units import parse_bytes

# serve.attention.BACKENDS, spelled here so that --help does not import torch (a test keeps
# the two equal)
ATTENTION_BACKENDS = ("auto", "native", "sdpa", "flex", "flash_attn")

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return value


def thresholds(text: str) -> float | list[float]:
    """One non-negative number, or a comma-separated list of them (one per layer)."""
    parts = text.split(",")
    values = [non_negative_float(part.strip()) for part in parts]
    return values if len(parts) > 1 else values[0]


def set_chat_template(llm, template: str) -> None:
    """Give the tokenizer `template` (a file's text, or the template itself), checked by
    rendering a one-message conversation; ValueError naming what is wrong."""
    path = Path(template)
    try:
        text = path.read_text() if path.is_file() else template
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--chat-template {template}: cannot read it ({error})") from None
    if llm.tokenizer is None:
        raise ValueError("--chat-template: this model has no tokenizer")
    llm.tokenizer.chat_template = text
    try:
        llm.encode_chat([{"role": "user", "content": "hello"}])
    except Exception as error:  # noqa: BLE001 - Jinja fails in many ways: one line, named
        raise ValueError(f"--chat-template: it does not render a conversation: "
                         f"{type(error).__name__}: {error}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a training export directory or a known model name (SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the name clients pass as 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, help="the weights' dtype (default: the export's)")
    p.add_argument("--kv-cache-dtype", choices=["auto", *DTYPES], default="auto",
                   help="the KV cache's dtype (default auto: the weights')")
    p.add_argument("--device", help="where the model runs: cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="how MHA/GQA layers attend over the paged cache: native (this project's "
                        "CPU kernels), sdpa (gather + PyTorch SDPA), flex (FlexAttention in "
                        "place), flash_attn (flash-attn's paged decode; CUDA, fp16/bf16, "
                        "--block-size a multiple of 256); auto picks native on a CPU, flash_attn "
                        "or flex on a GPU, and logs its choice (default %(default)s)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="run decode steps eagerly; --no-enforce-eager compiles them with "
                        "torch.compile (dynamic shapes; seconds to minutes at start; no CUDA "
                        "graphs). Default eager (vLLM's default is compiled)")
    p.add_argument("--max-model-len", type=positive_int,
                   help="a request's prompt + output at most (default: the model's context)")
    p.add_argument("--seed", type=int,
                   help="seeds the sampling of requests that bring no seed (reproducible runs)")
    p.add_argument("--api-key",
                   help="requests to /v1 must send 'Authorization: Bearer KEY' (else 401)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) in place of the "
                        "tokenizer's")
    g = p.add_argument_group("KV cache and scheduling")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (%(default)s)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default="512MiB",
                   help="memory for the paged KV pool, e.g. 512MiB or 4GiB (default %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=non_negative_float,
                   help="on a CUDA device: the share of its memory (0-1] to use, the KV pool "
                        "taking what the weights and an activation reserve leave; overrides "
                        "--kv-cache-memory (not on a CPU)")
    g.add_argument("--num-blocks", type=positive_int,
                   help="blocks in the KV pool; overrides --kv-cache-memory")
    g.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="sequences in one batch (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                   help="token budget of one step (default %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests accepted beyond --max-num-seqs before answering 503; each prompt "
                        "of a completion is one, and one with more prompts than both together "
                        "is a 400 (default %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
    g.add_argument("--no-chunked-prefill", action="store_true", help="turn off chunked prefill")
    g = p.add_argument_group("requests and shutdown")
    g.add_argument("--max-request-bytes", type=parse_bytes, default="8MiB",
                   help="largest request body accepted; larger ones get 413 (default %(default)s: "
                        "holds 100,000 stop strings of 40 characters)")
    g.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                   help="on SIGTERM or Ctrl-C: seconds to let running requests finish (new ones get "
                        "503) before the rest are ended; a second signal ends them at once "
                        "(default %(default)s)")
    g = p.add_argument_group("activation-locality decoding (egmla.models.sparse_ffn)")
    g.add_argument("--ffn-sparsity", choices=("gate", "oracle", "predicted"),
                   help="decode the MLPs over only the neurons that fire: gate (exact for ReLU-"
                        "family MLPs; SwiGLU needs --ffn-threshold), oracle (exact, slower) or "
                        "predicted (a hot block and what --ffn-predictors predict; an "
                        "approximation); default: dense")
    g.add_argument("--ffn-predictors", metavar="FILE",
                   help="predictors.safetensors written by `python -m eval.locality predictors` "
                        "for this model (with --ffn-sparsity predicted)")
    g.add_argument("--ffn-threshold", type=thresholds, default=0.0, metavar="T[,T...]",
                   help="a neuron fires only above this score (|silu(gate)| for SwiGLU, the gate "
                        "for the ReLU family): one number, or one per layer separated by commas; "
                        "predicted mode takes its predictors' own; default %(default)s")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_queued_requests < 0:
        print(f"error: --max-queued-requests={args.max_queued_requests}: must be >= 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Heavy imports after argument parsing, so --help and usage errors are instant.
    import torch
    import uvicorn

    from egmla.checkpoint import CheckpointError
    from serve.api import build_app
    from serve.async_engine import AsyncEngine
    from serve.llm import LLM
    from serve.shutdown import DrainingServer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        llm = LLM(args.model, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                  num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=not args.no_prefix_caching,
                  enable_chunked_prefill=not args.no_chunked_prefill,
                  dtype=args.dtype, cache_dtype=args.kv_cache_dtype,
                  ffn_sparsity=args.ffn_sparsity, ffn_threshold=args.ffn_threshold,
                  ffn_predictors=args.ffn_predictors, max_model_len=args.max_model_len,
                  seed=args.seed, device=args.device, attention_backend=args.attention_backend,
                  enforce_eager=args.enforce_eager,
                  gpu_memory_utilization=args.gpu_memory_utilization)
    except (CheckpointError, ValueError, OSError) as error:
        print(f"error: cannot load --model {args.model}: {error}", file=sys.stderr)
        return 2
    if args.chat_template is not None:
        try:
            set_chat_template(llm, args.chat_template)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model))
                                      if os.path.isdir(args.model) else args.model)
    c = llm.engine.config
    logging.getLogger("serve").info(
        "serving %s as %r: %d KV blocks of %d tokens (%.1f MiB), attention %s", args.model, name,
        c.num_blocks, c.block_size, llm.engine.cache.nbytes() / 2**20, llm.engine.attention_backend)
    engine = AsyncEngine(llm, max_queued_requests=args.max_queued_requests).start()
    app = build_app(engine, name, max_request_bytes=args.max_request_bytes, api_key=args.api_key)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5),
                            engine, args.shutdown_timeout)
    try:
        server.run()
    finally:
        engine.close()
        summary = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in llm.engine.metrics().items() if v is not None)
        logging.getLogger("serve").info("engine statistics: %s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
