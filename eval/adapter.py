"""The lm-eval model adapter, registered as `egmla`.

    python -m eval.lm_eval --model egmla --model_args pretrained=runs/quickstart/export \\
        --tasks egmla_offline --limit 50 --output_path results/

or from Python: `lm_eval.simple_evaluate(model=EgmlaLM("SmolLM2-135M-Instruct"), tasks=[...])`.

- `loglikelihood`: context and continuation are encoded together and split where the context's
  own encoding ends (lm-eval's `_encode_pair`), so a token straddling the boundary goes to the
  continuation. Requests that share a context (the choices of a multiple-choice question) run
  the context once and every continuation from its KV cache; the rest run in batches of similar
  length. The LM head runs only where a continuation token is predicted, and log-probabilities
  are summed in float32.
- `loglikelihood_rolling`: perplexity over windows of the model's context (lm-eval's disjoint
  rolling windows, the first predicted from the prefix token).
- `generate_until`: through the serving engine (`serve.LLM`): every request of a batch is in
  flight at once, with the task's stop strings.

`model_args` are strict: an unknown key fails with its name and the accepted keys, a count
(batch_size, max_length, ...) that is not a whole number of at least 1 with its value, and a
key that lm-eval's flags also pass (--batch_size, --device) with the flag to use. `device`
(lm-eval's `--device`) is where the model runs: the weights move there before the engine's KV
cache is allocated, and a device this machine lacks (`cuda` without a GPU) is refused.
`get_model_info` adds `model_device`, where the weights really are, to lm-eval's results config.
`quantization` (q8_0, q4_0, q4_1, gguf: serve.LLM's) scores the model with block-quantized
weights, on the CPU: `--model_args pretrained=SmolLM2-135M-Instruct,quantization=gguf`.

Tokenization follows lm-eval's `hf` model: the tokenizer's default special tokens unless
`add_bos_token` says otherwise, and BOS (else EOS) as the prefix of an empty context, so
the two models score the same tokens on the same weights.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from egmla.devices import parse_device
from egmla.dtypes import WEIGHT_DTYPES, parse_dtype
from egmla.imports import load_pretrained
from serve import LLM, SamplingParams
from serve.engine import DEFAULT_KV_CACHE_MEMORY


def _count(name: str, value: Any, low: int = 1, high: int | None = None) -> int:
    """A whole-number model_args value (lm-eval parses `8` as 8, `8.0` as 8.0 and `x` as 'x')
    between `low` and `high`, or a ValueError naming the key."""
    number = None
    if not isinstance(value, bool):
        try:
            number = int(value) if float(value) == int(float(value)) else None
        except (TypeError, ValueError, OverflowError):  # 'x', None, nan, inf
            pass
    if number is None or number < low or (high is not None and number > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ValueError(f"{name}={value!r}: expected a whole number {bound}")
    return number


# What lm-eval's command line passes beside --model_args (its --batch_size defaults to 1).
FROM_FLAGS = {"batch_size": "--batch_size", "max_batch_size": "--max_batch_size", "device": "--device"}


@register_model("egmla")
class EgmlaLM(TemplateLM):
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> EgmlaLM:
        """lm-eval's constructor path: model_args and the flags it passes beside them, a key
        given both ways refused by name (lm-eval's own is a TypeError traceback)."""
        flags = {k: v for k, v in (additional_config or {}).items() if v is not None}
        twice = sorted(set(arg_dict) & set(flags))
        if twice:
            raise ValueError("model_args: " + "; ".join(
                f"{k} is also given by lm-eval's {FROM_FLAGS.get(k, k)} ({flags[k]!r}, its "
                f"value or default): pass it once, as {FROM_FLAGS.get(k, k)}" for k in twice))
        return cls(**arg_dict, **flags)

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> EgmlaLM:
        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string),
                                       additional_config)

    def __init__(
        self,
        pretrained: str | LLM = "SmolLM2-135M-Instruct",
        dtype: str | None = None,
        batch_size: int | str = 8,
        max_batch_size: int | None = None,  # lm-eval's --max_batch_size: caps batch_size=auto
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        device: str | None = None,  # lm-eval's --device; None: where the weights load (the CPU)
        quantization: str | None = None,  # serve.LLM's: q8_0, q4_0, q4_1, gguf (CPU)
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:  # a misspelled model_args key must not be dropped silently
            accepted = [k for k in inspect.signature(EgmlaLM.__init__).parameters
                        if k not in ("self", "unknown")]
            raise ValueError(f"model_args: unknown key(s) {', '.join(sorted(unknown))}; "
                             f"accepted keys: {', '.join(accepted)}")
        wanted = parse_device(device)  # checked before minutes of loading
        if not str(batch_size).startswith("auto"):
            batch_size = _count("batch_size", batch_size)
        if max_batch_size is not None:
            max_batch_size = _count("max_batch_size", max_batch_size)
        kv_cache_memory = _count("kv_cache_memory", kv_cache_memory)
        if max_length is not None:
            max_length = _count("max_length", max_length)
        if isinstance(pretrained, LLM):
            self.llm = pretrained
            where = self.llm.model.tok_emb.weight.device
            if wanted is not None and wanted != where:
                raise ValueError(
                    f"device={device!r}: this LLM was built on {where} and its KV cache lives "
                    f"there; build it from a model on {wanted}, or pass pretrained=<name or path>")
        else:
            if dtype not in (*WEIGHT_DTYPES, "auto", None):
                raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}, auto")
            weights = None if dtype in ("auto", None) else parse_dtype(dtype)
            if quantization not in (None, "", "none"):  # (LLM checks the value before loading)
                if wanted is not None and wanted.type != "cpu":
                    raise ValueError(f"quantization={quantization!r}: quantized weights run on "
                                     f"the CPU, not device={device!r}")
                # the engine loads it (a GGUF's own blocks need the model's name)
                self.llm = LLM(str(pretrained), dtype=weights, quantization=quantization,
                               kv_cache_memory=kv_cache_memory)
            else:
                model, tokenizer = load_pretrained(str(pretrained), dtype=weights)
                if wanted is not None:
                    model.to(wanted)  # before the engine allocates its KV cache beside the weights
                self.llm = LLM(model, tokenizer, kv_cache_memory=kv_cache_memory)
        if self.llm.tokenizer is None:
            raise ValueError(f"{pretrained}: has no tokenizer; lm-eval tasks need one")
        self.model, self.tokenizer = self.llm.model, self.llm.tokenizer
        self._device = self.model.tok_emb.weight.device
        if str(batch_size).startswith("auto"):
            self._batch_size = min(8, max_batch_size) if max_batch_size else 8
        else:
            self._batch_size = batch_size
        longest = self.model.config.max_seq_len
        if max_length is not None and max_length > longest:
            raise ValueError(f"max_length={max_length}: longer than the model's context "
                             f"(max_seq_len {longest})")
        self._max_length = max_length or longest
        self.add_bos_token = add_bos_token
        self.pretrained = str(pretrained) if not isinstance(pretrained, LLM) else self.llm.name

    def get_model_info(self) -> dict[str, Any]:
        """Merged by lm-eval into its results' config: where the model really ran."""
        return {"model_device": str(self._device)}

    # ---- what TemplateLM asks for -------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None and self.add_bos_token is not None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None:
            bos = self.tokenizer.decode([self.prefix_token_id])
            if bos and string.startswith(bos):  # already carries its BOS
                add_special_tokens = False
        if add_special_tokens is None:
            return list(self.tokenizer.encode(string))
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ---- scoring ----------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding would produce it."""
        shared: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise ValueError("a loglikelihood request with an empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit "
                                 f"max_length={self.max_length}")
            # Sharing pays where the context is the bulk of the work (the choices of a question),
            # not for a rolling window, whose one-token context precedes a whole text.
            fits = len(context) + len(continuation) <= self.max_length + 1  # untruncated
            if fits and len(context) >= len(continuation):
                shared[tuple(context)].append(i)
        groups = [g for g in shared.values() if len(g) > 1]
        grouped = {i for g in groups for i in g}
        rest = [i for i in range(len(requests)) if i not in grouped]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="egmla loglikelihood")
        for group in groups:
            scores = self._score_shared_context(requests[group[0]][1],
                                                [requests[i][2] for i in group])
            for i, score in zip(group, scores):
                results[i] = score
            bar.update(len(group))
        self._score_batched(requests, rest, results, bar)
        bar.close()
        for request, result in zip(requests, results):
            if request[0] != (None, None):
                self.cache_hook.add_partial("loglikelihood", request[0], result)
        return results  # type: ignore[return-value]

    def _score_shared_context(self, context: list[int], continuations: list[list[int]]
                              ) -> list[tuple[float, bool]]:
        """One forward over the context into a KV cache, then all continuations from copies of it.

        context [c0 .. cm] and continuations [x0 .. xn]: p(x0) comes from the context's last
        position; x1 .. xn from a batch of the continuations without their last token, right
        padded (padding comes after every real token, so causal attention never sees it).
        """
        device = self.model.tok_emb.weight.device
        cache = self.model.new_cache(1, len(context) + max(map(len, continuations)) - 1)
        ids = torch.tensor([context], device=device)
        last = torch.tensor([len(context) - 1], device=device)
        first = F.log_softmax(self.model(ids, cache=cache, logits_at=last).float(), dim=-1)  # (1, V)
        scores = []
        for start in range(0, len(continuations), self.batch_size):  # bounded memory per forward
            chunk = continuations[start : start + self.batch_size]
            k, longest = len(chunk), max(map(len, chunk))
            logprobs = first.expand(k, 1, -1)  # (k, 1, vocab)
            if longest > 1:
                ids = torch.zeros(k, longest - 1, dtype=torch.long)
                for b, continuation in enumerate(chunk):
                    ids[b, : len(continuation) - 1] = torch.tensor(continuation[:-1])
                later = self.model(ids.to(device), cache=cache.repeat(k))  # (k, longest - 1, V)
                logprobs = torch.cat([logprobs, F.log_softmax(later.float(), dim=-1)], dim=1)
            scores += [self._pick(logprobs[b, : len(c)], c) for b, c in enumerate(chunk)]
        return scores

    @staticmethod
    def _pick(logprobs: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        """(sum of log p of the continuation's tokens, whether each is the argmax): logprobs (n, V)."""
        target = torch.tensor(continuation, device=logprobs.device)
        picked = logprobs.gather(1, target[:, None])[:, 0]
        return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())

    def _score_batched(self, requests, indices: list[int], results: list, bar: tqdm) -> None:
        """Score requests[indices] in right-padded batches, one forward each, into `results`."""
        device = self.model.tok_emb.weight.device
        # Longest first: a batch pads to its first row, and a too-large batch fails early.
        order = sorted(indices, key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            rows = []
            for i in batch:
                _, context, continuation = requests[i]
                # The model sees at most max_length tokens: the last ones before the final token.
                rows.append(((context + continuation)[-(self.max_length + 1):][:-1], len(continuation)))
            width = max(len(tokens) for tokens, _ in rows)
            k = max(n for _, n in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            at = torch.zeros(len(rows), k, dtype=torch.long)  # the positions predicting a target
            for b, (tokens, n) in enumerate(rows):
                ids[b, : len(tokens)] = torch.tensor(tokens)  # right padding: no effect before it
                at[b] = torch.arange(len(tokens) - n, len(tokens) - n + k).clamp(max=len(tokens) - 1)
            # The LM head and softmax only where a continuation token is predicted: (B, k, vocab).
            logits = self.model(ids.to(device), logits_at=at.to(device))
            logprobs = F.log_softmax(logits.float(), dim=-1)
            for b, i in enumerate(batch):
                n = rows[b][1]
                results[i] = self._pick(logprobs[b, :n], requests[i][2][-n:])
            bar.update(len(batch))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, target in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), context, target))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if the task asks) generation through the serving engine, all
        requests with the same generation settings in flight together."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[repr(sorted(req.args[1].items()))].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="egmla generate_until")
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(kwargs.pop("max_gen_toks", 256))
            sample = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                    top_p=kwargs.pop("top_p", None), top_k=kwargs.pop("top_k", None),
                                    seed=kwargs.pop("seed", None), stop=until)
            room = self.max_length - max_tokens
            if room < 1:
                raise ValueError(f"max_gen_toks={max_tokens} leaves no room for a context in "
                                 f"max_length={self.max_length}")
            prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in indices]
            for step in range(0, len(indices), 64):  # bounded batches keep memory in check
                chunk = range(step, min(step + 64, len(indices)))
                replies = self.llm.generate([prompts[j] for j in chunk], params, use_tqdm=False)
                for j, reply in zip(chunk, replies):
                    out[indices[j]] = reply.outputs[0].text
                    self.cache_hook.add_partial("generate_until", requests[indices[j]].args,
                                                reply.outputs[0].text)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]
