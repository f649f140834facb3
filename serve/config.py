"""The engine's settings (`EngineConfig`) and the GPU memory sizing of its KV pool.

Every setting is a field here, with its default and its `--help` text (vLLM's
`engine/arg_utils.py` idea): `LLM(model, **engine_args)` builds an EngineConfig from its
keywords, and `python -m serve` derives its engine flags from these fields
(`serve.__main__.add_engine_arguments`), so a default lives here only. A field's metadata says
how the command line spells it where that is not `--field-name`:

    parse    how the flag's text is read: "positive" (an integer >= 1), "bytes" (512MiB, 4GiB),
             "fraction" (a number >= 0), "int"
    flag     another spelling (cache_dtype is --kv-cache-dtype)
    off      a flag that turns a True default off (--no-prefix-caching)
    none     the command line's word for None (--kv-cache-dtype auto)
    choices  the accepted words
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from egmla.dtypes import WEIGHT_DTYPES
from egmla.models import Transformer
from serve import attention
from serve.sampling import SEED_RANGE, is_int

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20  # bytes
log = logging.getLogger("serve")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class NoOp:
    """A vLLM argument that asks nothing of this engine at the values `accepts` takes (`what`
    says which), for the reason `why`; `flag`: how the command line reads it ("int", "float",
    "flag" for a switch, "str")."""

    accepts: Callable[[Any], bool]
    what: str
    why: str
    flag: str


# vLLM's arguments that scripts pass with values meaning "nothing to do" here: accepted with one
# log line each; any other value would need what this engine does not do, and is refused by
# name. (dtype "auto", kv_cache_dtype "auto", enforce_eager and gpu_memory_utilization are
# settings of their own.)
VLLM_NO_OPS: dict[str, NoOp] = {
    "tensor_parallel_size": NoOp(lambda v: v == 1 and is_int(v), "1",
                                 "one device: the weights are not split", "int"),
    "pipeline_parallel_size": NoOp(lambda v: v == 1 and is_int(v), "1",
                                   "one device: the layers are not split", "int"),
    "data_parallel_size": NoOp(lambda v: v == 1 and is_int(v), "1", "one engine", "int"),
    "disable_log_stats": NoOp(lambda v: isinstance(v, bool), "true or false",
                              "no periodic statistics are logged (the server's /metrics has them)",
                              "flag"),
    "disable_log_requests": NoOp(lambda v: isinstance(v, bool), "true or false",
                                 "requests are not logged", "flag"),
    "swap_space": NoOp(lambda v: _number(v) and v >= 0, "a number of GiB >= 0",
                       "a preempted request is recomputed, never swapped to CPU memory", "float"),
    "cpu_offload_gb": NoOp(lambda v: _number(v) and v == 0, "0",
                           "the weights stay where the model runs", "float"),
    "disable_custom_all_reduce": NoOp(lambda v: isinstance(v, bool), "true or false",
                                      "one device: nothing to reduce across", "flag"),
    "tokenizer_mode": NoOp(lambda v: v == "auto", '"auto"', "the model's own tokenizer", "str"),
    "load_format": NoOp(lambda v: v == "auto", '"auto"',
                        "the format is read from the model's files", "str"),
    "trust_remote_code": NoOp(lambda v: isinstance(v, bool), "true or false",
                              "no code from a checkpoint is ever run", "flag"),
    "generation_config": NoOp(lambda v: v in ("auto", "vllm"), '"auto" or "vllm"',
                              "the models here carry no generation config: vLLM's sampling "
                              "defaults apply", "str"),
    "task": NoOp(lambda v: v in ("auto", "generate"), '"auto" or "generate"',
                 "this engine generates text", "str"),
    "max_seq_len_to_capture": NoOp(lambda v: is_int(v) and v >= 1, "an integer >= 1",
                                   "no CUDA graphs are captured", "int"),
    "disable_async_output_proc": NoOp(lambda v: isinstance(v, bool), "true or false",
                                      "outputs are processed within each step", "flag"),
    "response_role": NoOp(lambda v: v == "assistant", '"assistant"',
                          "chat replies have the role assistant", "str"),
}


def accept_vllm_no_ops(args: dict[str, Any]) -> dict[str, Any]:
    """`args` without vLLM's no-op arguments (VLLM_NO_OPS), each logged as accepted; a value
    that would need something this engine does not do is a ValueError naming the argument.
    vLLM's `kv_cache_dtype` is read as `cache_dtype` (the same setting)."""
    rest = dict(args)
    for name, no_op in VLLM_NO_OPS.items():
        if name not in rest:
            continue
        value = rest.pop(name)
        if not no_op.accepts(value):
            raise ValueError(f"{name}={value!r}: this engine accepts only {no_op.what} "
                             f"({no_op.why})")
        log.info("%s=%r accepted; it changes nothing here: %s", name, value, no_op.why)
    if "kv_cache_dtype" in rest:
        if "cache_dtype" in rest:
            raise ValueError("kv_cache_dtype and cache_dtype name one setting: give one")
        rest["cache_dtype"] = rest.pop("kv_cache_dtype")
    return rest


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A field with its --help text and, in `cli`, how the command line spells it (the module
    docstring lists the keys)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """Every engine setting, with its default: `LLM(model, **engine_args)` and the servers build
    one of these from their keywords, and the server's command line from its fields, so the
    defaults live here only."""

    block_size: int = setting(16, "tokens per KV block", parse="positive")
    num_blocks: int | None = setting(
        None, "blocks in the KV pool; overrides --kv-cache-memory (default: as many as "
        "--kv-cache-memory holds)", parse="positive")
    kv_cache_memory: int = setting(
        DEFAULT_KV_CACHE_MEMORY, "memory for the paged KV pool when --num-blocks is not given, "
        "e.g. 512MiB or 4GiB", parse="bytes")
    max_num_seqs: int = setting(64, "sequences in one batch (rows of a step)", parse="positive")
    max_num_batched_tokens: int = setting(512, "token budget of one step", parse="positive")
    enable_prefix_caching: bool = setting(True, "turn off prefix caching",
                                          off="--no-prefix-caching")
    enable_chunked_prefill: bool = setting(True, "turn off chunked prefill",
                                           off="--no-chunked-prefill")
    cache_dtype: torch.dtype | None = setting(
        None, "the KV cache's dtype, auto meaning the weights'", flag="--kv-cache-dtype",
        none="auto", choices=("auto", *WEIGHT_DTYPES))
    max_model_len: int | None = setting(
        None, "a request's prompt + output at most (default: the model's context)",
        parse="positive")
    seed: int | None = setting(
        None, "seeds the sampling of requests that bring no seed (reproducible runs)",
        parse="int")
    attention_backend: str = setting(
        "auto", "how MHA/GQA layers attend over the paged cache: native (this project's CPU "
        "kernels), sdpa (gather + PyTorch SDPA), flex (FlexAttention in place), flash_attn "
        "(flash-attn's paged decode; CUDA, fp16/bf16, --block-size a multiple of 256); auto "
        "picks native on a CPU, flash_attn or flex on a GPU, and logs its choice",
        choices=attention.BACKENDS)
    # vLLM's name. False: decode steps run through torch.compile (dynamic shapes: one graph
    # serves every batch and context; no CUDA graphs: the KV pools are inputs it mutates).
    # Default True here (vLLM's is False): compiling costs seconds to minutes at start.
    enforce_eager: bool = setting(
        True, "run decode steps eagerly; --no-enforce-eager compiles them with torch.compile "
        "(dynamic shapes; seconds to minutes at start; no CUDA graphs). Default eager (vLLM's "
        "default is compiled)")
    # vLLM's: on a CUDA device, the share of its memory this engine may hold (weights,
    # activations, KV pool); the pool gets what the weights and an activation reserve leave.
    # None: kv_cache_memory sizes the pool (and it is the only way on a CPU).
    gpu_memory_utilization: float | None = setting(
        None, "on a CUDA device: the share of its memory (0-1] to use, the KV pool taking what "
        "the weights and an activation reserve leave; overrides --kv-cache-memory (not on a "
        "CPU)", parse="fraction")

    @classmethod
    def from_args(cls, **engine_args) -> EngineConfig:
        """An EngineConfig from keyword arguments; an unknown one is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; accepted: "
                             f"{', '.join(sorted(known))}")
        backend = engine_args.get("attention_backend", cls.attention_backend)
        if backend not in attention.BACKENDS:  # before a model is loaded
            raise ValueError(f"attention_backend={backend!r}: expected one of "
                             f"{', '.join(attention.BACKENDS)}")
        share = engine_args.get("gpu_memory_utilization")
        if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool)
                                      and 0 < share <= 1):
            raise ValueError(f"gpu_memory_utilization={share!r}: must be a number in (0, 1]")
        eager = engine_args.get("enforce_eager", cls.enforce_eager)
        if not isinstance(eager, bool):
            raise ValueError(f"enforce_eager={eager!r}: must be true or false")
        return cls(**engine_args)


def kv_memory_for_share(share: float, total: int, used: int, reserve: int) -> int:
    """Bytes left for the KV pool when the engine may hold `share` of a device's `total` bytes,
    `used` are held already (the weights) and `reserve` are kept for a step's activations;
    ValueError, with the numbers, when nothing is left."""
    left = int(share * total) - used - reserve
    if left <= 0:
        raise ValueError(
            f"gpu_memory_utilization={share}: {share} x {total / 2**30:.2f} GiB leaves no room "
            f"for a KV pool after {used / 2**30:.2f} GiB held (the weights) and "
            f"{reserve / 2**30:.2f} GiB reserved for activations; raise it")
    return left


def kv_memory_on_gpu(model: Transformer, c: EngineConfig) -> int | None:
    """The KV pool's bytes under `c.gpu_memory_utilization` on the model's CUDA device; None
    (logged: kv_cache_memory sizes the pool) on any other device, where a vLLM script's share
    of GPU memory means nothing."""
    device = model.tok_emb.weight.device
    if device.type != "cuda":
        log.info("gpu_memory_utilization=%s accepted on %s, where it changes nothing: the KV pool "
                 "is sized by kv_cache_memory (%d MiB)", c.gpu_memory_utilization, device,
                 c.kv_cache_memory // 2**20)
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    cfg = model.config
    # A step's activations, roughly: hidden states, MLP and attention scratch and fp32 logits
    # for every token of the step's budget (vLLM profiles a forward; this is an estimate).
    per_token = 4 * (16 * cfg.d_model + 3 * cfg.d_ff + 2 * cfg.vocab_size)
    reserve = c.max_num_batched_tokens * per_token + 2**28  # + 256 MiB for the allocator
    return kv_memory_for_share(c.gpu_memory_utilization, total,
                               torch.cuda.memory_allocated(device), reserve)


def sized(config: EngineConfig, model: Transformer, dtype: torch.dtype) -> EngineConfig:
    """`config` with num_blocks set (from gpu_memory_utilization, else kv_cache_memory, for a
    KV cache in `dtype`) and checked against the model: ValueError naming the setting."""
    c, spec = config, model.cache_spec()
    if c.gpu_memory_utilization is not None and c.num_blocks is None:
        on_gpu = kv_memory_on_gpu(model, c)
        if on_gpu is not None:
            c = dataclasses.replace(c, kv_cache_memory=on_gpu)
    if c.num_blocks is None:
        block_bytes = spec.bytes_per_token(dtype) * c.block_size
        if c.kv_cache_memory < block_bytes:
            raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds no block of "
                             f"{block_bytes} bytes (block_size={c.block_size})")
        c = dataclasses.replace(c, num_blocks=c.kv_cache_memory // block_bytes)
    limit = model.config.max_seq_len
    if c.max_model_len is not None and not (is_int(c.max_model_len)
                                            and 1 <= c.max_model_len <= limit):
        raise ValueError(f"max_model_len={c.max_model_len!r}: must be an integer in [1, "
                         f"{limit}] (the model's context)")
    if c.seed is not None and not (is_int(c.seed) and SEED_RANGE[0] <= c.seed <= SEED_RANGE[1]):
        raise ValueError(f"seed={c.seed!r}: must be an integer in {list(SEED_RANGE)}")
    return c
