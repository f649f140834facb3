"""A continuous-batching engine over the paged KV cache; the vLLM-shaped API (serve/llm.py) and
the HTTP server (serve/api.py) build on it.

Every step the scheduler fills a token budget: running decodes first (one token each), then
prefills in arrival order, long prompts cut into chunks (chunked prefill). When the block pool
cannot hold a decode, the most recently arrived running sequence is preempted by recompute: its
blocks are freed and it goes back to the head of the queue, to be prefilled again (prompt plus
what it had generated; full blocks may still be found in the prefix cache). The scheduler's
decision is a typed plan (`SchedulerOutput`: which sequences run how many new tokens from where,
and who was preempted), and the forward side reads only that plan: its rows run as a few ragged
forwards over `PagedKVCache`, grouped so that little is spent on padding (`_forward_groups`).

Callers above the engine (serve/outputs.py, serve/llm.py, serve/async_engine.py) use its face
only: `check_request`, `add_request`, `step`, `samples`, `stop_sample`, `abort`, `fail`,
`is_finished`, `release`, `metrics` and `snapshot`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from egmla.generate import sample_next
from egmla.models import Transformer
from serve import attention
from serve.block_manager import BlockManager
from serve.paged_cache import PagedKVCache

log = logging.getLogger("serve")


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field and `code` is the
    OpenAI error code where one applies (`context_length_exceeded`), for HTTP errors."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class Interval:
    """The numbers a sampling parameter accepts: from `low` to `high` (math.inf: unbounded),
    each end included unless `*_open`. Tests draw their values from these, so a changed range
    is a tested range."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


# What SamplingParams accepts for each numeric field that shapes a draw (the floats must also be
# finite; top_k and seed are integers, top_k None meaning no cut). min_tokens is in [0,
# max_tokens]. The sampler gives a valid draw for every value here (egmla.generate.sample_next).
RANGES: dict[str, Interval] = {
    "temperature": Interval(0),
    "top_p": Interval(0, 1, low_open=True),
    "min_p": Interval(0, 1),
    "presence_penalty": Interval(-2, 2),
    "frequency_penalty": Interval(-2, 2),
    "repetition_penalty": Interval(0, low_open=True),
    "top_k": Interval(-1),  # 0 and -1: every token (vLLM's -1)
    "seed": Interval(*SEED_RANGE),
}


class StepFailed(RuntimeError):
    """Requests of a step failed: each (`reasons`: request id -> "ExceptionType: message") ended
    with finish_reason "error" and its blocks were freed, while the step's other requests went
    on. `request_ids` lists the failed ones, `reason` the first one's reason; the first
    exception is `__cause__`. A `generate` call (`LLMEngine.generate`, `LLM.generate`) runs its
    other requests to the end before raising it, with `outputs`: every prompt's result in
    order, None for a failed one."""

    def __init__(self, reasons: dict[int, str], outputs: list | None = None) -> None:
        self.reasons, self.outputs = dict(reasons), outputs
        self.request_ids, self.reason = list(self.reasons), next(iter(self.reasons.values()))
        super().__init__(f"{len(self.reasons)} request(s) failed in a step: "
                         + "; ".join(f"request {rid}: {why}" for rid, why in self.reasons.items()))


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# vLLM's SamplingParams fields that this engine does not implement: refused by name.
NOT_IMPLEMENTED = ("best_of", "use_beam_search", "length_penalty", "early_stopping", "bad_words",
                   "allowed_token_ids", "logits_processors", "truncate_prompt_tokens",
                   "guided_decoding", "structured_outputs", "logit_bias", "output_kind",
                   "include_stop_str_in_output", "spaces_between_special_tokens", "detokenize",
                   "extra_args", "flat_logprobs")


@dataclass
class SamplingParams:
    """How one request samples, with vLLM's names and defaults (temperature 1.0: pass
    temperature=0 for greedy). Checked at construction, for every caller (the HTTP server and
    the Python API alike): a bad value is an `InvalidRequest` naming the field, and a vLLM field
    this engine does not implement is refused by name.

    The logits of each step go through, in order: repetition_penalty (> 1 divides a positive
    logit of every token seen in the prompt or output, multiplies a negative one), then
    frequency_penalty x (times the token was generated) and presence_penalty x (whether it was)
    are subtracted, then the stop tokens are masked while fewer than min_tokens were generated,
    then temperature, min_p (drop tokens below min_p x the top probability), top_k (None, 0 or
    -1: all) and top_p. `logprobs=N` returns, for every generated token, the N most likely
    tokens and the sampled one with their log-probabilities under the model's raw distribution
    (before penalties and temperature, as vLLM's default), and the sum of the sampled ones'
    (`cumulative_logprob`); `prompt_logprobs=N` the same for every prompt token after the first
    (its prompt is computed whole, not taken from the prefix cache)."""

    n: int = 1  # samples of one prompt; sample i draws with seed + i and shares the prompt's blocks
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings: applied by the output side (serve/outputs.py)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as the context leaves
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    eos_token_id: int | None = None  # set by LLM from the tokenizer: stops unless ignore_eos

    def __init__(self, **fields: object) -> None:
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            vllm = [k for k in unknown if k in NOT_IMPLEMENTED]
            other = [k for k in unknown if k not in NOT_IMPLEMENTED]
            raise InvalidRequest(
                "; ".join([*([f"{', '.join(vllm)}: vLLM's, not implemented here"] if vllm else []),
                           *([f"unknown field(s) {', '.join(other)}"] if other else [])])
                + f" (SamplingParams takes {', '.join(_FIELDS)})", unknown[0])
        for name, f in _FIELDS.items():
            setattr(self, name, fields[name] if name in fields else f.default)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.top_p is None:  # as vLLM: None is the default, no cut
            self.top_p = 1.0
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs", "eos_token_id"):
            value = getattr(self, name)
            if not (value is None and name not in ("n", "min_tokens")) and not _is_int(value):
                raise InvalidRequest(f"{name}={value!r}: must be an integer", name)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise InvalidRequest(f"{name}={value!r}: must be a finite number", name)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name}={getattr(self, name)!r}: must be true or false", name)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(t) for t in ids):
            raise InvalidRequest(f"stop_token_ids={self.stop_token_ids!r}: must be a list of "
                                 "integers", "stop_token_ids")
        self.stop_token_ids = tuple(ids)
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise InvalidRequest(f"stop={self.stop!r}: must be a string or a list of strings", "stop")
        self.stop = tuple(stop)
        seeds, (low, high) = RANGES["seed"], SEED_RANGE
        rules = {  # field: (holds, what it must be)
            "n": (self.n >= 1, "must be >= 1"),
            "max_tokens": (self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            "min_tokens": (0 <= self.min_tokens and (self.max_tokens is None
                                                     or self.min_tokens <= self.max_tokens),
                           "must be in [0, max_tokens]"),
            **{name: (getattr(self, name) in RANGES[name], f"must be {RANGES[name]}")
               for name in ("temperature", "top_p", "min_p", "presence_penalty",
                            "frequency_penalty", "repetition_penalty")},
            "top_k": (self.top_k is None or self.top_k in RANGES["top_k"],
                      "must be >= 1, or 0 or -1 (all)"),
            "logprobs": (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                         f"must be in [0, {MAX_LOGPROBS}]"),
            "prompt_logprobs": (self.prompt_logprobs is None
                                or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                                f"must be in [0, {MAX_LOGPROBS}]"),
            "seed": (self.seed is None or self.seed in seeds and self.seed + self.n - 1 in seeds,
                     f"seed and seed + n - 1 (the last sample's seed) must be in [{low}, {high}]"),
        }
        for name, (holds, rule) in rules.items():
            if not holds:
                raise InvalidRequest(f"{name}={getattr(self, name)}: {rule}", name)

    @property
    def top_k_or_none(self) -> int | None:
        """top_k as a cut: None where it keeps every token (None, 0 or -1)."""
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    def stops_at(self) -> tuple[int, ...]:
        """The token ids that end a sample: stop_token_ids, and the EOS unless ignore_eos."""
        eos = () if self.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        return (*self.stop_token_ids, *eos)

    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


MAX_LOGPROBS = 20  # as OpenAI's top_logprobs allows
_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}


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


def _kv_memory_on_gpu(model: Transformer, c: EngineConfig) -> int:
    device = model.tok_emb.weight.device
    if device.type != "cuda":
        raise ValueError(f"gpu_memory_utilization applies to a CUDA device (this engine is on "
                         f"{device}): size the KV pool with kv_cache_memory")
    total = torch.cuda.get_device_properties(device).total_memory
    cfg = model.config
    # A step's activations, roughly: hidden states, MLP and attention scratch and fp32 logits
    # for every token of the step's budget (vLLM profiles a forward; this is an estimate).
    per_token = 4 * (16 * cfg.d_model + 3 * cfg.d_ff + 2 * cfg.vocab_size)
    reserve = c.max_num_batched_tokens * per_token + 2**28  # + 256 MiB for the allocator
    return kv_memory_for_share(c.gpu_memory_utilization, total,
                               torch.cuda.memory_allocated(device), reserve)


def compiled_decode(model: Transformer):
    """`model` through torch.compile for decode steps: dynamic shapes from the first call (the
    batch and the context change every step), the CPU kernels loaded first (their loading
    takes a lock, which a traced region cannot)."""
    from egmla import kernels

    kernels.load()
    return torch.compile(model, dynamic=True)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


DEFAULT_KV_CACHE_MEMORY = 512 * 2**20  # bytes


@dataclass
class EngineConfig:
    """Every engine setting, with its default: `LLM(model, **engine_args)` and the servers build
    one of these from their keywords, so the defaults live here only."""

    block_size: int = 16
    num_blocks: int | None = None  # blocks in the pool; None: as many as kv_cache_memory holds
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY  # bytes for the paged KV pool when num_blocks is None
    max_num_seqs: int = 64  # rows in one step
    max_num_batched_tokens: int = 512  # token budget of one step
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cache_dtype: torch.dtype | None = None  # None: the model's dtype
    max_model_len: int | None = None  # a request's prompt + output at most; None: the model's
    seed: int | None = None  # seeds the sampling of requests without a seed of their own
    attention_backend: str = "auto"  # how MHA/GQA layers attend (serve.attention.BACKENDS)
    # vLLM's name. False: decode steps run through torch.compile (dynamic shapes: one graph
    # serves every batch and context; no CUDA graphs: the KV pools are inputs it mutates).
    # Default True here (vLLM's is False): compiling costs seconds to minutes at start.
    enforce_eager: bool = True
    # vLLM's: on a CUDA device, the share of its memory this engine may hold (weights,
    # activations, KV pool); the pool gets what the weights and an activation reserve leave.
    # None: kv_cache_memory sizes the pool (and it is the only way on a CPU).
    gpu_memory_utilization: float | None = None

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


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache on admission
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    preemptions: int = 0
    request_id: int = -1  # the request this sample belongs to (its first sample's seq_id)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # first admitted to the running batch
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With params.logprobs: per output token {token id: (logprob, rank)} (the top-N and the
    # sampled token), and the sum of the sampled tokens' logprobs.
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    cumulative_logprob: float | None = None
    # With params.prompt_logprobs: the same for each prompt token (None for the first).
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float | None:
        """Seconds from arrival to the last token (vLLM's end-to-end request latency)."""
        return None if self.finish_time is None else self.finish_time - self.arrival

    @property
    def queue_time(self) -> float | None:
        """Seconds waiting before first scheduled (vLLM's request queue time)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (n - 1), as vLLM reports it."""
        if self.finish_time is None or self.first_token_time is None or len(self.output) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.output) - 1)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence in a step: `num_new_tokens` tokens from position `start` (its KV up to
    `start` is in the cache already). `is_prefill`: more than its last token was new when it was
    scheduled (a prompt, a chunk of one, or a recompute), else a decode."""

    seq: Sequence
    start: int
    num_new_tokens: int
    is_prefill: bool

    @classmethod
    def of(cls, seq: Sequence, n: int) -> ScheduledRow:
        return cls(seq, seq.num_computed, n, len(seq.tokens) - seq.num_computed > 1)


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, decided by the scheduler before any forward (vLLM's SchedulerOutput):
    the rows in order (running sequences first, then newly admitted ones) and the sequences
    preempted to make room, by id."""

    rows: list[ScheduledRow]
    preempted: list[int]

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


@dataclass
class EngineStats:
    """Running sums the engine adds to as it works (its own bookkeeping; read `metrics()`)."""

    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    sampled_tokens: int = 0  # tokens generated, finished or not
    aborted: int = 0  # samples aborted (client gone, or stopped by the caller)
    failed: int = 0  # samples ended by a step that raised (StepFailed)
    cached_prompt_tokens: int = 0
    # finished (not aborted) requests' samples: running sums, so metrics survive release()
    finished: int = 0
    output_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    tpot_sum: float = 0.0
    tpot_count: int = 0
    first_arrival: float | None = None
    last_finish: float | None = None
    reserved_slot_steps: int = 0  # sum over steps of KV slots held by live sequences
    used_slot_steps: int = 0  # sum over steps of the slots those sequences filled


@dataclass(frozen=True)
class EngineMetrics:
    """The engine's metrics, in one record: `metrics()` returns it as a dict, the server publishes
    one after every step (`snapshot(now=False)`) for its `/metrics`. Latencies and throughput
    are over finished requests; `*_now` fields describe the pool at this moment."""

    running: int  # sequences in the running batch
    waiting: int  # sequences waiting to be scheduled
    requests_finished: int  # samples finished (not aborted or failed)
    output_tokens: int  # tokens of those samples
    output_tokens_per_s: float | None  # output_tokens / (last finish - first arrival)
    ttft_mean_s: float | None
    tpot_mean_s: float | None
    steps: int
    preemptions: int
    peak_running: int
    prompt_tokens: int  # prompt (and recomputed) tokens run through a forward
    generation_tokens: int  # tokens sampled, finished or not
    kv_blocks_used: int
    kv_blocks_total: int
    # The live pool's reserved and filled bytes and their unused share; None in a snapshot
    # taken with now=False (they need a walk over every held block).
    kv_bytes_reserved_now: int | None
    kv_bytes_used_now: int | None
    fragmentation_now: float | None
    fragmentation_mean: float  # unused / reserved KV slots, summed over every step of the run
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / looked up


class LLMEngine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None) -> None:
        self.model, c = model.eval(), config or EngineConfig()
        weight = model.tok_emb.weight
        spec, dtype = model.cache_spec(), c.cache_dtype or weight.dtype
        if c.gpu_memory_utilization is not None and c.num_blocks is None:
            c = dataclasses.replace(c, kv_cache_memory=_kv_memory_on_gpu(model, c))
        if c.num_blocks is None:
            block_bytes = spec.bytes_per_token(dtype) * c.block_size
            if c.kv_cache_memory < block_bytes:
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds no block of "
                                 f"{block_bytes} bytes (block_size={c.block_size})")
            c = dataclasses.replace(c, num_blocks=c.kv_cache_memory // block_bytes)
        limit = model.config.max_seq_len
        if c.max_model_len is not None and not (_is_int(c.max_model_len)
                                                and 1 <= c.max_model_len <= limit):
            raise ValueError(f"max_model_len={c.max_model_len!r}: must be an integer in [1, "
                             f"{limit}] (the model's context)")
        if c.seed is not None and not (_is_int(c.seed) and SEED_RANGE[0] <= c.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed={c.seed!r}: must be an integer in {list(SEED_RANGE)}")
        self.config = c
        # One generator for the requests that bring no seed (vLLM's LLM(seed=...)); None: torch's.
        self.device = model.tok_emb.weight.device  # where sampling draws: its generators too
        self._unseeded = None if c.seed is None else _generator(c.seed, self.device)
        head_dims = {f["k"].shape[-1] for f in spec.layers if set(f) == {"k", "v"}}
        choice = attention.select(c.attention_backend, weight.device, dtype, c.block_size, head_dims)
        self.attention_backend = choice.name  # what runs, and why (logged)
        log.info("attention backend: %s (%s)", choice.name, choice.reason)
        self.cache = PagedKVCache(spec, c.num_blocks, c.block_size, dtype=dtype,
                                  device=weight.device, attention=choice.backend)
        self._decode_model = model if c.enforce_eager else compiled_decode(model)
        self.blocks = BlockManager(c.num_blocks, c.block_size, c.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self.requests: dict[int, list[int]] = {}  # request id -> its samples' seq ids
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}  # every sample not yet released, by seq id
        self._scheduled: list[Sequence] | None = None  # the running step's sequences
        self.last_plan: SchedulerOutput | None = None  # what the latest step scheduled

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: the model's context or the
        KV pool, whichever is smaller."""
        context = self.config.max_model_len or self.model.config.max_seq_len
        return min(context, self.config.num_blocks * self.config.block_size)

    # ---- requests ---------------------------------------------------------------------------

    def check_request(self, prompt: list[int], params: SamplingParams,
                      score_prompt: bool = False) -> None:
        """Raise InvalidRequest if this request could never run here. Reads only the (fixed)
        configuration, so any thread may call it. `score_prompt`: the caller wants only the
        prompt's logprobs and drops the one token the request generates (max_tokens=1; the
        server's echo with max_tokens 0); that token is never read back, so the prompt alone
        must fit: a prompt of the whole context can be scored."""
        c, limit = self.config, self.config.max_model_len or self.model.config.max_seq_len
        if not prompt:
            raise InvalidRequest("prompt is empty: a request needs at least one token", "prompt")
        if score_prompt and params.max_tokens != 1:
            raise ValueError(f"score_prompt needs max_tokens=1, got {params.max_tokens}")
        made = self.max_new_tokens(len(prompt), params)
        total = len(prompt) + (0 if score_prompt else made)
        vocab = self.model.config.vocab_size
        for name, ids in (("prompt", prompt), ("stop_token_ids", params.stops_at())):
            bad = next((i for i, t in enumerate(ids) if not (_is_int(t) and 0 <= t < vocab)), None)
            if bad is not None:
                raise InvalidRequest(f"{name}[{bad}]={ids[bad]!r}: token ids must be integers in "
                                     f"[0, {vocab}) (the model's vocabulary)", name)
        if params.min_tokens and len(set(params.stops_at())) >= vocab:
            raise InvalidRequest(f"min_tokens={params.min_tokens}: every token of the vocabulary "
                                 f"({vocab}) is a stop token (stop_token_ids and the EOS), so "
                                 "none could be generated before min_tokens", "min_tokens")
        if total > limit or made < 1:
            asked = "" if score_prompt else f" + max_tokens ({params.max_tokens})"
            raise InvalidRequest(f"prompt ({len(prompt)} tokens){asked} exceeds the model's "
                                 f"context of {limit} tokens", "prompt",
                                 code="context_length_exceeded")
        if params.n > c.max_num_seqs:
            raise InvalidRequest(f"n={params.n}: exceeds max_num_seqs={c.max_num_seqs}", "n")
        alone = -(-len(prompt) // c.block_size)
        if alone > c.num_blocks:
            raise InvalidRequest(f"the prompt's {len(prompt)} tokens need {alone} KV blocks; the "
                                 f"pool has {c.num_blocks} (block_size={c.block_size})", "prompt")
        # The n samples share the prompt's full blocks and each need blocks of their own after.
        shared = len(prompt) // c.block_size
        blocks = shared + params.n * -(-(total - shared * c.block_size) // c.block_size)
        if blocks > c.num_blocks:
            param = "n" if params.n > 1 else "max_tokens"
            raise InvalidRequest(f"{params.n} x {total} tokens need {blocks} KV blocks; the pool "
                                 f"has {c.num_blocks} (block_size={c.block_size})", param)
        if not c.enable_chunked_prefill and len(prompt) > c.max_num_batched_tokens:
            raise InvalidRequest(f"prompt of {len(prompt)} tokens exceeds max_num_batched_tokens="
                                 f"{c.max_num_batched_tokens} and chunked prefill is off", "prompt")

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return self._unseeded if seed is None else _generator(seed, self.device)

    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The most tokens a request may generate: max_tokens, or (None) what the context and
        the pool leave after the prompt."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.max_request_tokens - prompt_len

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    score_prompt: bool = False) -> int:
        params = params or SamplingParams()
        self.check_request(prompt, params, score_prompt)
        seq_id = next(self._ids)
        seq = Sequence(seq_id, list(prompt), params, generator=self._generator(params.seed),
                       request_id=seq_id)
        self.requests[seq_id] = [seq_id]
        self._seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq_id

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> list[Sequence]:
        """Samples 1..n-1 of a request whose prompt just finished: they share every block of the
        prompt (copy-on-write on the first write into the shared last block) and draw their
        first token from the same logits with their own seeds."""
        p, children = parent.params, []
        for i in range(1, p.n):
            child = Sequence(next(self._ids), parent.prompt, p, num_computed=parent.num_computed,
                             generator=self._generator(None if p.seed is None else p.seed + i),
                             request_id=parent.request_id)
            self.blocks.fork(parent.seq_id, child.seq_id)
            self.requests[parent.request_id].append(child.seq_id)
            self._seqs[child.seq_id] = child
            children.append(child)
        return children

    def abort(self, request_id: int) -> None:
        """Stop every sample of a request and free its blocks (finished ones are left as is)."""
        if request_id not in self.requests:
            raise KeyError(f"unknown request {request_id}")
        for seq_id in self.requests[request_id]:
            self.finish_early(seq_id, "abort")

    def has_request(self, request_id: int) -> bool:
        """The request was added and not yet released."""
        return request_id in self.requests

    def sequence(self, seq_id: int) -> Sequence:
        """A sample by id, live or finished (until its request is released)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id} (never added, or released)") from None

    def samples(self, request_id: int) -> list[Sequence]:
        """A request's samples in index order, live or finished: read them, do not change them
        (`stop_sample`, `abort` and `release` are how callers act on them)."""
        if request_id not in self.requests:
            raise KeyError(f"unknown request {request_id}")
        return [self._seqs[s] for s in self.requests[request_id]]

    def stop_sample(self, seq_id: int) -> None:
        """The caller found a stop string in this sample's text: end it now with finish_reason
        "stop" (and free its blocks), or, if its last token already ended it, say "stop"."""
        seq = self.sequence(seq_id)
        if seq.finish_reason is None:
            self.finish_early(seq_id, "stop")
        elif seq.finish_reason == "length":
            seq.finish_reason = "stop"

    def finish_early(self, seq_id: int, reason: str) -> None:
        """End one live sample now (abort, or a stop string seen by the caller)."""
        seq = self.sequence(seq_id)
        if seq.finish_reason is not None:
            return  # already finished
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if self.blocks.has(seq_id):
            self.blocks.free(seq_id)
        self._finish(seq, reason)

    def fail(self, request_ids: list[int], reason: str = "error") -> None:
        """End every live sample of these requests with finish_reason `reason` and free their
        blocks. Safe on a state a raising step left half-updated: a sample forked but not yet
        scheduled is dropped from its request."""
        live = {s.seq_id: s for s in (*self.running, *self.waiting)}
        for rid in request_ids:
            for seq_id in list(self.requests.get(rid, ())):
                seq = live.get(seq_id)
                if seq is not None:
                    self.finish_early(seq_id, reason)
                elif seq_id not in self.finished:  # forked in the failed step, never scheduled
                    self.requests[rid].remove(seq_id)
                    self._seqs.pop(seq_id, None)
                    if self.blocks.has(seq_id):
                        self.blocks.free(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def is_finished(self, request_id: int) -> bool:
        """Every sample of the request has finished (an aborted or failed prompt never forks)."""
        seqs = [self.finished.get(s) for s in self.requests[request_id]]
        if any(s is None for s in seqs):
            return False
        return len(seqs) == seqs[0].params.n or seqs[0].finish_reason in ("abort", "error")

    def release(self, request_id: int) -> list[Sequence]:
        """Forget a finished request (a server calls this once it has answered); returns its
        samples. `metrics()` keeps counting it."""
        if not self.is_finished(request_id):
            raise ValueError(f"request {request_id} has not finished")
        seq_ids = self.requests.pop(request_id)
        for s in seq_ids:
            del self._seqs[s]
        return [self.finished.pop(s) for s in seq_ids]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.finish_time = reason, time.perf_counter()
        self.finished[seq.seq_id] = seq
        st = self.stats
        if reason in ("abort", "error"):
            if reason == "abort":
                st.aborted += 1
            else:
                st.failed += 1
            return
        st.finished += 1
        st.output_tokens += len(seq.output)
        if seq.ttft is not None:
            st.ttft_sum, st.ttft_count = st.ttft_sum + seq.ttft, st.ttft_count + 1
        if seq.tpot is not None:
            st.tpot_sum, st.tpot_count = st.tpot_sum + seq.tpot, st.tpot_count + 1
        st.first_arrival = min(seq.arrival, st.first_arrival or seq.arrival)
        st.last_finish = max(seq.finish_time, st.last_finish or seq.finish_time)

    # ---- scheduling -------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        pairs = self.blocks.append_slots(seq.seq_id, seq.tokens, n)
        if pairs is None:
            return False
        for src, dst in pairs:
            self.cache.copy_block(src, dst)
        return True

    def _schedule(self) -> SchedulerOutput:
        c = self.config
        budget, rows, preempted = c.max_num_batched_tokens, [], []
        # 1. Running sequences, oldest first: decodes (1 token) and unfinished chunked prefills.
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room for an older sequence
            want = len(seq.tokens) - seq.num_computed
            n = min(want, budget) if (want == 1 or c.enable_chunked_prefill) else want
            if n < 1 or n > budget:
                continue
            while not self._reserve(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq in self.running:
                rows.append(ScheduledRow.of(seq, n))
                budget -= n
        # 2. Waiting sequences in arrival order, while budget, rows and blocks allow.
        while self.waiting and budget > 0 and len(rows) < c.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.has(seq.seq_id):
                cached = self.blocks.allocate_prompt(  # prompt logprobs need every position
                    seq.seq_id, seq.tokens, lookup=seq.params.prompt_logprobs is None)
                seq.num_computed = cached
                if seq.cached_tokens is None:  # a preempted sequence re-finds its own blocks
                    seq.cached_tokens = cached
                self.stats.cached_prompt_tokens += cached
            want = len(seq.tokens) - seq.num_computed
            n = min(want, budget) if c.enable_chunked_prefill else want
            if n > budget or not self._reserve(seq, n):
                # FCFS: later requests wait for this one, which holds nothing while it waits
                # (else a queue of half-admitted requests could hold the whole pool).
                self.blocks.free(seq.seq_id)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.perf_counter()
            rows.append(ScheduledRow.of(seq, n))
            budget -= n
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return SchedulerOutput(rows, preempted)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Schedule, run the step's forwards, sample; return the sequences that finished.

        A failure ends only the requests it concerns. If a forward over several rows raises,
        its rows run again in halves until each failing row has raised alone; a request whose
        own rows' forward, or whose sampling, raises ends with finish_reason "error" and its
        blocks are freed. The step's other requests take their tokens as usual (the ones they
        would have taken alone), then `StepFailed` is raised naming the failed requests. If the
        scheduler itself raises, the requests it scheduled (every live one, if it got no plan
        out) fail that way. The engine stays usable."""
        self._scheduled, failures = None, {}
        try:
            done = self._step(failures)
        except Exception as error:
            seqs = self._scheduled if self._scheduled is not None else [*self.running, *self.waiting]
            failures.update((s.request_id, error) for s in seqs if s.request_id not in failures)
            done = []
        if not failures:
            return done
        self.fail(list(failures))
        raise StepFailed({rid: _reason(e) for rid, e in failures.items()}
                         ) from next(iter(failures.values()))

    @torch.no_grad()
    def _step(self, failures: dict[int, Exception]) -> list[Sequence]:
        """The step, with each request's failure put in `failures` (request id -> its
        exception) rather than raised; `step` ends those requests."""
        plan = self.last_plan = self._schedule()
        rows = plan.rows
        self._scheduled = [r.seq for r in rows]
        if not rows:
            if self.waiting and not self.running:
                self._scheduled = [self.waiting[0]]  # the request that can never run fails
                raise RuntimeError("the next request cannot be scheduled: the block pool or the "
                                   "token budget is too small for it")
            return []
        last_logits = self._logits(rows, failures)  # row index -> logits of its last new token
        self.stats.steps += 1
        reserved, used = self.blocks.slot_counts()
        self.stats.reserved_slot_steps += reserved
        self.stats.used_slot_steps += used
        # The greedy rows' tokens in one argmax and one transfer, not one per row.
        plain = [b for b, r in enumerate(rows) if b in last_logits and _plain_greedy(r.seq)]
        argmax = dict(zip(plain, torch.stack([last_logits[b] for b in plain]).argmax(-1).tolist()
                          if plain else []))
        done = []
        for b, row in enumerate(rows):
            if row.seq.request_id in failures:
                continue  # `step` ends its request (every sample of it) after this loop
            try:
                done += self._advance(row, last_logits[b], argmax.get(b))
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                failures[row.seq.request_id] = error
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return [s for s in done if s.request_id not in failures]

    def _logits(self, rows: list[ScheduledRow], failures: dict[int, Exception]
                ) -> dict[int, torch.Tensor]:
        """Each row's logits of its last new token, by row index; a row whose forward raises
        alone puts its request in `failures` and gets none."""
        last = {}
        scoring = [i for i, r in enumerate(rows) if _wants_prompt_logprobs(r)]
        for i in scoring:  # alone, with every position's logits
            try:
                logits = self._forward([rows[i]], every=True)[0]  # (num_new_tokens, V)
                record_prompt_logprobs(rows[i].seq, rows[i].start, logits)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                failures.setdefault(rows[i].seq.request_id, error)
                continue
            last[i] = logits[-1]
        others = [i for i in range(len(rows)) if i not in set(scoring)]
        for group in _forward_groups([rows[i].num_new_tokens for i in others]):
            self._forward_isolated([others[g] for g in group], rows, last, failures)
        return last

    def _forward_isolated(self, group: list[int], rows: list[ScheduledRow],
                          last: dict[int, torch.Tensor], failures: dict[int, Exception]) -> None:
        """One forward over rows `group` (indices into `rows`), their logits into `last`. If it
        raises, each half runs again, and so on down to single rows: a row that raises alone
        fails its request. Running a row again is safe: it rewrites the KV slots of exactly the
        new tokens that the failed forward may have written (with anything), and nothing else
        of the step (tokens, counts, the prefix cache) has changed before the forwards end."""
        group = [i for i in group if rows[i].seq.request_id not in failures]
        if not group:
            return
        try:
            logits = self._forward([rows[i] for i in group])  # (len(group), V)
        except Exception as error:  # noqa: BLE001 - find the rows it belongs to
            if len(group) == 1:
                failures.setdefault(rows[group[0]].seq.request_id, error)
                return
            log.warning("a forward over %d rows raised (%s); running them again in halves to "
                        "find the failing rows", len(group), _reason(error))
            half = len(group) // 2
            self._forward_isolated(group[:half], rows, last, failures)
            self._forward_isolated(group[half:], rows, last, failures)
            return
        last.update(zip(group, logits))

    def _advance(self, row: ScheduledRow, logits: torch.Tensor, greedy: int | None
                 ) -> list[Sequence]:
        """Account a row's computed tokens; once its prompt is in, fork its request's other
        samples (the first time) and sample the next token of each. Returns the sequences
        that finished."""
        seq, n = row.seq, row.num_new_tokens
        seq.num_computed = row.start + n
        if row.is_prefill:
            self.stats.prefill_tokens += n
        else:
            self.stats.decode_tokens += n
        self.blocks.commit(seq.seq_id, seq.tokens[: seq.num_computed])
        if seq.num_computed < len(seq.tokens):
            return []  # a chunk of a longer prompt: no token yet
        first = not seq.output and len(self.requests[seq.request_id]) < seq.params.n
        group = [seq, *self._fork(seq, logits)] if first else [seq]
        done = []
        for s in group:
            if s is not seq:
                self.running.append(s)
            if self._sample(s, logits, greedy):
                done.append(s)
        return done

    def _forward(self, rows: list[ScheduledRow], every: bool = False) -> torch.Tensor:
        """One ragged forward over the paged cache -> (rows, vocab) logits of each row's last
        new token, or (`every`) (rows, new tokens, vocab) at every position."""
        T = max(r.num_new_tokens for r in rows)
        pad = [[0] * (T - r.num_new_tokens) for r in rows]  # padding queries sit at position 0
        tokens = torch.tensor([r.seq.tokens[r.start : r.start + r.num_new_tokens] + p
                               for r, p in zip(rows, pad)], dtype=torch.long)
        positions = torch.tensor([[*range(r.start, r.start + r.num_new_tokens), *p]
                                  for r, p in zip(rows, pad)], dtype=torch.long)
        step = self.cache.step([self.blocks.block_table(r.seq.seq_id) for r in rows],
                               [r.start for r in rows], [r.num_new_tokens for r in rows])
        device = self.model.tok_emb.weight.device
        model = self._decode_model if step.decode_only else self.model
        if T == 1 and not every:  # one token per row: its logits are the step's only ones
            return model(tokens.to(device), positions.to(device), cache=step)[:, 0]
        last = None if every else torch.tensor([r.num_new_tokens - 1 for r in rows], device=device)
        return model(tokens.to(device), positions.to(device), cache=step, logits_at=last)

    def _sample(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """Append the next token (`greedy`: already taken, for a plain greedy sequence); finish
        the sequence if it stops. True when it finished."""
        p = seq.params
        stops = p.stops_at()
        if greedy is not None and _plain_greedy(seq):
            nxt = greedy
        else:
            scores = sampling_scores(logits, seq.prompt, seq.output, p)
            nxt = int(sample_next(scores[None], p.temperature, p.top_k_or_none,
                                  p.top_p if p.top_p < 1 else None, seq.generator, p.min_p)[0])
        if p.logprobs is not None:
            record_logprobs(seq, logits, nxt, p.logprobs)
        seq.output.append(nxt)
        self.stats.sampled_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        stopped = nxt in stops  # (masked while fewer than min_tokens were generated)
        if not stopped and len(seq.output) < self.max_new_tokens(len(seq.prompt), p):
            return False
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        if stopped and nxt in p.stop_token_ids:
            seq.stop_reason = nxt  # a stop token of the caller's (vLLM: None for the EOS)
        self._finish(seq, "stop" if stopped else "length")
        return True

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None
                 ) -> list[list[int]] | list[list[list[int]]]:
        """Run `prompts` to completion; return each one's generated token ids, in order
        (with n > 1, a list of n outputs per prompt). If requests fail, the others still run to
        the end; then `StepFailed` names the failed ones, its `outputs` holding the results
        (None for a failed one)."""
        ids = [self.add_request(p, params) for p in prompts]
        failed: dict[int, str] = {}
        cause = None
        while self.has_unfinished():
            try:
                self.step()
            except StepFailed as error:  # those requests ended; the others go on
                failed.update(error.reasons)
                cause = cause or error.__cause__
        outputs = [None if i in failed else [self.finished[s].output for s in self.requests[i]]
                   for i in ids]
        if not (params and params.n > 1):
            outputs = [o if o is None else o[0] for o in outputs]
        if failed:
            raise StepFailed(failed, outputs) from cause
        return outputs

    def snapshot(self, now: bool = True) -> EngineMetrics:
        """The engine's metrics at this moment. `now=False` skips the walk over every held block
        that the `*_now` fields need (they are None then): counters only, cheap enough to take
        after every step."""
        st = self.stats
        span = (st.last_finish - st.first_arrival) if st.finished else 0.0
        reserved = used = fragmentation = None
        if now:
            blocks = self.blocks.stats()
            slot_bytes = self.cache.block_bytes() // self.config.block_size
            reserved, used = blocks.reserved_slots * slot_bytes, blocks.used_slots * slot_bytes
            fragmentation = blocks.fragmentation
        return EngineMetrics(
            running=len(self.running), waiting=len(self.waiting),
            requests_finished=st.finished, output_tokens=st.output_tokens,
            output_tokens_per_s=st.output_tokens / span if span > 0 else None,
            ttft_mean_s=st.ttft_sum / st.ttft_count if st.ttft_count else None,
            tpot_mean_s=st.tpot_sum / st.tpot_count if st.tpot_count else None,
            steps=st.steps, preemptions=st.preemptions, peak_running=st.peak_running,
            prompt_tokens=st.prefill_tokens, generation_tokens=st.sampled_tokens,
            kv_blocks_used=self.blocks.num_used(), kv_blocks_total=self.config.num_blocks,
            kv_bytes_reserved_now=reserved, kv_bytes_used_now=used, fragmentation_now=fragmentation,
            fragmentation_mean=(1 - st.used_slot_steps / st.reserved_slot_steps
                                if st.reserved_slot_steps else 0.0),
            prefix_cache_hit_rate=self.blocks.hit_rate,
        )

    def metrics(self) -> dict[str, float | int | None]:
        """Run statistics as a dict (`snapshot()`'s fields): latency of finished requests,
        throughput, KV use, cache hits."""
        return dataclasses.asdict(self.snapshot())


def _forward_groups(lengths: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Split a step's rows (new-token counts) into forwards that waste little on padding: all
    decodes (1 token) together, prefill chunks grouped longest first while the padded size stays
    within (1 + max_padding) x their real tokens. A (B, T) forward computes B * T tokens, so one
    512-token chunk padded with 30 decodes would otherwise cost 31x."""
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    groups = [decodes] if decodes else []
    group: list[int] = []
    for i in sorted((i for i, n in enumerate(lengths) if n > 1), key=lambda i: -lengths[i]):
        real = sum(lengths[j] for j in group) + lengths[i]
        if group and (len(group) + 1) * lengths[group[0]] > (1 + max_padding) * real:
            groups.append(group)
            group = []
        group.append(i)
    return groups + ([group] if group else [])


_F32_MAX = torch.finfo(torch.float32).max


def penalize(logits: torch.Tensor, prompt: list[int], output: list[int],
             p: SamplingParams) -> torch.Tensor:
    """logits (V,) with vLLM's repetition, frequency and presence penalties applied (see
    SamplingParams): repetition over the prompt and output tokens, the other two over the
    output's counts."""
    scores = logits.float().clone()
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=scores.device)
        # In float64, where a penalty of 1e-300 or 1e300 is itself (in float32 it is 0 or inf:
        # x / 0 is inf, 0 * inf NaN); then clamped to float32's range, so a score pushed past it
        # ties at +-3.4e38 with the others pushed there and none is inf (inf - inf is NaN).
        picked, r = scores[seen].double(), p.repetition_penalty
        penalized = torch.where(picked > 0, picked / r, picked * r)
        scores[seen] = penalized.clamp(-_F32_MAX, _F32_MAX).float()
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=scores.device),
                                minlength=scores.shape[0]).to(scores.dtype)
        scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def sampling_scores(logits: torch.Tensor, prompt: list[int], output: list[int],
                    p: SamplingParams) -> torch.Tensor:
    """logits (V,) -> the scores a sample draws its next token from: the penalties
    (`penalize`), then the stop tokens masked to -inf while fewer than min_tokens were
    generated. At least one token stays finite: check_request refuses min_tokens when the stop
    tokens are the whole vocabulary."""
    scores = penalize(logits, prompt, output, p) if p.penalized() else logits
    stops = p.stops_at()
    if len(output) < p.min_tokens and stops:
        scores = scores.clone()
        scores[list(stops)] = float("-inf")
    return scores


def record_logprobs(seq: Sequence, logits: torch.Tensor, token: int, top: int) -> None:
    """Add this step's logprobs to `seq`: the `top` most likely tokens and the sampled one,
    each with (logprob, rank) under the raw distribution (rank 1: the most likely)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    mine = float(logprobs[token])
    entry = _ranked(logprobs, token, top)
    if seq.logprobs is None:
        seq.logprobs, seq.cumulative_logprob = [], 0.0
    seq.logprobs.append(entry)
    seq.cumulative_logprob += mine


def _plain_greedy(seq: Sequence) -> bool:
    """The next token is the argmax of the raw logits: temperature 0, no penalty, no stop token
    masked by min_tokens."""
    p = seq.params
    return (p.temperature == 0 and not p.penalized()
            and not (len(seq.output) < p.min_tokens and p.stops_at()))


def _wants_prompt_logprobs(row: ScheduledRow) -> bool:
    """A chunk of the prompt of a request that asked for prompt logprobs, not yet recorded."""
    seq = row.seq
    done = len(seq.prompt_logprobs or ())  # recorded so far (the first token's None counts)
    return (seq.params.prompt_logprobs is not None and done < len(seq.prompt)
            and row.start < len(seq.prompt) and row.start + row.num_new_tokens >= done)


def _ranked(logprobs: torch.Tensor, token: int, top: int) -> dict[int, tuple[float, int]]:
    """{token id: (logprob, rank)} of the `top` most likely tokens and `token` (rank 1: the
    most likely)."""
    entry = {}
    if top:
        values, ids = logprobs.topk(top)
        entry = {int(i): (float(v), r + 1) for r, (v, i) in enumerate(zip(values, ids))}
    if token not in entry:
        entry[token] = (float(logprobs[token]), int((logprobs > logprobs[token]).sum()) + 1)
    return entry


def record_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """Prompt logprobs of the tokens a prefill chunk predicts: logits (n, V) at positions
    start .. start + n - 1 score prompt tokens start + 1 .. (within the prompt). A chunk computed
    again (after a preemption) adds nothing already recorded."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first token has no context to be scored in
    top = seq.params.prompt_logprobs
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    for i in range(logits.shape[0]):
        target = start + i + 1  # the position this row of logits predicts
        if target < len(seq.prompt) and target == len(seq.prompt_logprobs):
            seq.prompt_logprobs.append(_ranked(logprobs[i], seq.prompt[target], top))


def _generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on the device whose logits it samples (a CUDA draw needs a CUDA generator)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)
