"""`python -m serve --model MODEL` (or `python -m serve MODEL`, as `vllm serve MODEL`): the
OpenAI-compatible HTTP server.

MODEL is a training export directory (runs/<name>/export) or a known imported model name
(SmolLM2-135M-Instruct). vLLM's flags that change nothing on one device at the values given
(--tensor-parallel-size 1, --disable-log-stats, --swap-space, ...) are accepted and logged; a
value that would need more is refused by name. Try it with any OpenAI client:

    python -m serve --model SmolLM2-135M-Instruct --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import time
from pathlib import Path

from egmla.devices import thread_count
from egmla.dtypes import VLLM_NAMES
from egmla.dtypes import WEIGHT_DTYPES as DTYPES
from egmla.quant import QUANTIZATIONS
from egmla.units import parse_bytes
from serve.attention import BACKENDS as ATTENTION_BACKENDS  # noqa: F401 (its old name here)
from serve.config import VLLM_NO_OPS, EngineConfig, accept_vllm_no_ops


LOG_LEVELS = ("debug", "info", "warning", "error")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


def api_key(text: str) -> str:
    """argparse type of --api-key: what a client can send as a bearer token, visible ASCII; an
    empty key (an unset variable in `--api-key "$KEY"`) would guard nothing."""
    if not text or not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r}: a key is one or more visible ASCII "
                                         "characters, no spaces")
    return text


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: must be in [0, 65535] (0: any free port)")
    return value


def cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, or None. Tried before the model loads
    (seconds to minutes), so that a port in use or a mistyped host fails at once; a port taken
    in between is still uvicorn's error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        return f"--host {host}: {getattr(err, 'strerror', None) or err}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            return f"cannot listen on {host}:{port}: {err.strerror or err}"
    return None


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
    if text is template and "{{" not in text and "{%" not in text:  # a mistyped file name
        raise ValueError(f"--chat-template {template}: no such file, and not a template either "
                         "(no {{ ... }} or {% ... %} in it)")
    if llm.tokenizer is None:
        raise ValueError("--chat-template: this model has no tokenizer")
    llm.tokenizer.chat_template = text
    try:
        llm.encode_chat([{"role": "user", "content": "hello"}])
    except Exception as error:  # noqa: BLE001 - Jinja fails in many ways: one line, named
        raise ValueError(f"--chat-template: it does not render a conversation: "
                         f"{type(error).__name__}: {error}") from None


def show_bytes(n: int) -> str:
    """536870912 -> '512MiB' (a whole number of the largest binary unit that divides it)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# How an EngineConfig field's metadata `parse` reads the flag's text (serve/config.py).
PARSERS = {"positive": positive_int, "bytes": parse_bytes, "fraction": non_negative_float,
           "int": int}


def add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    """One flag per `EngineConfig` field (serve/config.py), its default and help read from the
    field: --field-name, or the spelling its metadata gives. The parsed value lands under the
    field's name (`engine_args`)."""
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        if "off" in meta:  # on by default: vLLM's --enable-x / --no-enable-x, and our --no-x
            on = "--" + f.name.replace("_", "-")
            group.add_argument(on, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=True, help=f"on by default (vLLM's flag; "
                               f"--no-{on[2:]} is {meta['off']})")
            group.add_argument(meta["off"], dest=f.name, action="store_false", help=meta["help"])
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        default = meta["none"] if f.default is None and "none" in meta else f.default
        shown = show_bytes(default) if meta.get("parse") == "bytes" else default
        help = meta["help"] + ("" if default is None else f" (default {shown})")
        if isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help)
            continue
        group.add_argument(flag, dest=f.name, type=PARSERS.get(meta.get("parse")),
                           choices=meta.get("choices"), default=default, help=help)


def engine_args(args: argparse.Namespace) -> dict:
    """The parsed command line's EngineConfig fields, as `LLM(model, **engine_args)` takes them."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(  # no abbreviations: --tokenizer must not mean --tokenizer-mode
        prog="python -m serve", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_argument", nargs="?", metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--model",
                   help="a training export directory or a known model name (SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer",
                   help="the tokenizer, when not the model's own: a directory with tokenizer "
                        "files or a known model name (vLLM's flag)")
    p.add_argument("--served-model-name", help="the name clients pass as 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default %(default)s)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="TCP port, 0 for any free one (default %(default)s)")
    p.add_argument("--dtype", choices=(*DTYPES, "auto", *VLLM_NAMES),
                   help="the weights' dtype (default, or auto: the export's; vLLM's half, float, "
                        "bf16, ... name the same dtypes)")
    p.add_argument("--device", help="where the model runs: cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="block-quantized weights (vLLM's flag): q8_0, q4_0 or q4_1 quantizes "
                        "them at load into llama.cpp's blocks of 32 (8 or 4 bits, a float16 "
                        "scale; a 4-bit method's LM head in q8_0); gguf keeps a GGUF model's "
                        "quantized tensors as stored (default: none, the float weights)")
    p.add_argument("--api-key", type=api_key,
                   help="requests to /v1 must send 'Authorization: Bearer KEY' (else 401)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) in place of the "
                        "tokenizer's")
    g = p.add_argument_group("engine: KV cache, scheduling, attention (serve.config.EngineConfig)")
    add_engine_arguments(g)
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests accepted beyond --max-num-seqs before answering 503; each prompt "
                        "of a completion is one, and one with more prompts than both together "
                        "is a 400 (default %(default)s)")
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
                   help="predictors.safetensors written by `python -m studies.locality predictors` "
                        "for this model (with --ffn-sparsity predicted)")
    g.add_argument("--ffn-threshold", type=thresholds, default=0.0, metavar="T[,T...]",
                   help="a neuron fires only above this score (|silu(gate)| for SwiGLU, the gate "
                        "for the ReLU family): one number, or one per layer separated by commas; "
                        "predicted mode takes its predictors' own; default %(default)s")
    g = p.add_argument_group("vLLM's flags that change nothing here at these values (logged if given)")
    for name, no_op in VLLM_NO_OPS.items():
        flag = "--" + name.replace("_", "-")
        if no_op.flag == "flag":
            g.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS,
                           help=no_op.why)
        else:
            g.add_argument(flag, dest=name, type={"int": int, "float": float}.get(no_op.flag, str),
                           default=argparse.SUPPRESS, help=f"accepted: {no_op.what} ({no_op.why})")
    p.add_argument("--threads", type=thread_count, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--uvicorn-log-level", choices=(*LOG_LEVELS, "critical", "trace"),
                   help="uvicorn's own log level (vLLM's flag; default: --log-level)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model and args.model_argument and args.model != args.model_argument:
        parser.error(f"two models: {args.model_argument!r} and --model {args.model!r}; give one")
    args.model = args.model or args.model_argument
    if not args.model:
        parser.error("a model is needed: python -m serve MODEL, or --model MODEL")
    if args.dtype == "auto":
        args.dtype = None
    if args.max_queued_requests < 0:
        print(f"error: --max-queued-requests={args.max_queued_requests}: must be >= 0", file=sys.stderr)
        return 2
    unusable = cannot_listen(args.host, args.port)
    if unusable:
        print(f"error: {unusable}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:  # vLLM's no-op flags: logged, or refused by name before anything loads
        accept_vllm_no_ops({name: getattr(args, name) for name in VLLM_NO_OPS if hasattr(args, name)})
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # The server's imports after argument parsing, so usage errors come before they load.
    import torch
    import uvicorn

    from egmla.checkpoint import CheckpointError
    from serve.server import build_app
    from serve.async_engine import AsyncEngine
    from serve.llm import LLM
    from serve.shutdown import DrainingServer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        llm = LLM(args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                  ffn_sparsity=args.ffn_sparsity, ffn_threshold=args.ffn_threshold,
                  ffn_predictors=args.ffn_predictors, device=args.device,
                  quantization=args.quantization, **engine_args(args))
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
    c, started = llm.engine.config, time.perf_counter()
    llm.engine.cache.populate()  # the pool's page faults now, not in the first requests' steps
    logging.getLogger("serve").info(
        "serving %s as %r: %d KV blocks of %d tokens (%.1f MiB, touched in %.1f s), attention %s",
        args.model, name, c.num_blocks, c.block_size, llm.engine.cache.nbytes() / 2**20,
        time.perf_counter() - started, llm.engine.attention_backend)
    engine = AsyncEngine(llm, max_queued_requests=args.max_queued_requests).start()
    app = build_app(engine, name, max_request_bytes=args.max_request_bytes, api_key=args.api_key)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.uvicorn_log_level or args.log_level,
                                           timeout_graceful_shutdown=5),
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
