"""How a request samples: `SamplingParams` (vLLM's names and defaults, checked once at
construction), the ranges it accepts, the fields it refuses, and the whole sampler the engine
runs on a step's logits:

    scores = sampling_scores(logits, prompt, output, params)   # penalties, the min_tokens mask
    token = sample_token(logits, prompt, output, params, generator)
    entry, logprob = token_logprobs(logits, token, params.logprobs)

The draw itself (temperature, min_p, top_k, top_p, the greedy argmax) is `egmla.generate.draw`,
the one implementation that `egmla.generate.generate` uses too; this module decides what it is
given. Plain greedy rows skip all of it: `is_plain_greedy`, then one argmax over the step's
rows (`greedy_tokens`). Adding a sampling parameter touches this module, the HTTP protocol
(serve/protocol.py, which takes the shared fields from `SamplingParams`) and tests.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from egmla.generate import draw

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
# max_tokens]. The sampler gives a valid draw for every value here (egmla.generate.draw).
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


# Fields of vLLM's SamplingParams and of OpenAI's and vLLM's HTTP requests that this engine does
# not implement, each with the values that mean "off" (() : none; any value but null is refused).
# SamplingParams refuses each by name; the HTTP server (serve/protocol.py) refuses the ones its
# request schemas lack unless they hold an "off" value, which clients often send by default.
NOT_IMPLEMENTED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1), "use_beam_search": (False,), "length_penalty": (1,),
    "early_stopping": (False,), "bad_words": ([],), "allowed_token_ids": (),
    "logits_processors": ([],), "truncate_prompt_tokens": (), "guided_decoding": (),
    "structured_outputs": (), "logit_bias": ({},), "output_kind": (),
    "include_stop_str_in_output": (False,), "spaces_between_special_tokens": (True,),
    "detokenize": (True,), "extra_args": (), "flat_logprobs": (False,),
    "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}


def is_neutral(value: object, neutral: object) -> bool:
    """Whether `value` is the "off" value `neutral` (a bool only as itself; 1 and 1.0 alike)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def asks_nothing(value: object, neutrals: tuple[object, ...]) -> bool:
    """Whether `value` is null or one of a refused field's "off" values (NOT_IMPLEMENTED's)."""
    return value is None or any(is_neutral(value, off) for off in neutrals)


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
        # vLLM's fields this engine lacks, at a value that asks for nothing (detokenize=True):
        # accepted, as the HTTP server accepts them
        fields = {k: v for k, v in fields.items()
                  if not (k in NOT_IMPLEMENTED and asks_nothing(v, NOT_IMPLEMENTED[k]))}
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            known = [k for k in unknown if k in NOT_IMPLEMENTED]
            other = [k for k in unknown if k not in NOT_IMPLEMENTED]
            said = [f"{', '.join(known)}: vLLM's or OpenAI's, not implemented here"] if known else []
            raise InvalidRequest(
                "; ".join([*said, *([f"unknown field(s) {', '.join(other)}"] if other else [])])
                + f" (SamplingParams takes {', '.join(_FIELDS)})", unknown[0])
        for name, f in _FIELDS.items():
            setattr(self, name, fields[name] if name in fields else f.default)
        self.__post_init__()

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's `SamplingParams.clone()`."""
        return copy.deepcopy(self)

    def __post_init__(self) -> None:
        if self.top_p is None:  # as vLLM: None is the default, no cut
            self.top_p = 1.0
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs", "eos_token_id"):
            value = getattr(self, name)
            if not (value is None and name not in ("n", "min_tokens")) and not is_int(value):
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
        if not isinstance(ids, (tuple, list)) or not all(is_int(t) for t in ids):
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


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def new_generator(seed: int | None, device: torch.device | str = "cpu"
                  ) -> torch.Generator | None:
    """A generator on the device whose logits it samples (a CUDA draw needs a CUDA generator)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


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


def is_plain_greedy(p: SamplingParams, generated: int) -> bool:
    """The next token of a sample that has `generated` tokens is the argmax of the raw logits:
    temperature 0, no penalty, no stop token masked by min_tokens."""
    return (p.temperature == 0 and not p.penalized()
            and not (generated < p.min_tokens and p.stops_at()))


def greedy_tokens(rows: list[torch.Tensor]) -> list[int]:
    """The argmax of each (V,) logits row, in one argmax and one transfer, not one per row."""
    return torch.stack(rows).argmax(-1).tolist() if rows else []


def sample_token(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """The next token of a sample from its logits (V,): `sampling_scores`, then the draw."""
    scores = sampling_scores(logits, prompt, output, p)
    return int(draw(scores[None], p.temperature, p.top_k_or_none,
                    p.top_p if p.top_p < 1 else None, generator, p.min_p)[0])


def ranked(logprobs: torch.Tensor, token: int, top: int) -> dict[int, tuple[float, int]]:
    """{token id: (logprob, rank)} of the `top` most likely tokens and `token` (rank 1: the
    most likely)."""
    entry = {}
    if top:
        values, ids = logprobs.topk(top)
        entry = {int(i): (float(v), r + 1) for r, (v, i) in enumerate(zip(values, ids))}
    if token not in entry:
        entry[token] = (float(logprobs[token]), int((logprobs > logprobs[token]).sum()) + 1)
    return entry


def token_logprobs(logits: torch.Tensor, token: int, top: int
                   ) -> tuple[dict[int, tuple[float, int]], float]:
    """One step's logprobs under the raw distribution (before penalties and temperature, as
    vLLM's default): the `top` most likely tokens and the sampled `token` with (logprob, rank),
    and the sampled token's logprob."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return ranked(logprobs, token, top), float(logprobs[token])


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], start: int, recorded: int,
                    top: int) -> list[dict[int, tuple[float, int]]]:
    """The prompt logprobs a prefill chunk adds: logits (n, V) at positions start .. start +
    n - 1 score prompt tokens start + 1 .. (within the prompt); the first `recorded` prompt
    positions have theirs already (a chunk computed again after a preemption adds nothing
    twice)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    added = []
    for i in range(logits.shape[0]):
        target = start + i + 1  # the position this row of logits predicts
        if target < len(prompt) and target == recorded + len(added):
            added.append(ranked(logprobs[i], prompt[target], top))
    return added
