"""A Python API shaped like vLLM's, over the engine:

    from serve import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct", block_size=16)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].outputs[0].text, out[0].outputs[0].finish_reason)
    llm.chat([{"role": "user", "content": "Write a Python function that adds two numbers."}])

`model` is a training export directory or a known imported model name (see egmla.imports).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from egmla.checkpoint import read_metadata, read_weights
from egmla.devices import parse_device
from egmla.dtypes import parse_model_dtype
from egmla.imports import KNOWN_MODELS, gguf_source, load_pretrained
from egmla.models import Transformer
from egmla.models.sparse_ffn import check_settings as check_sparsity
from egmla.models.sparse_ffn import layer_thresholds, predictors_from_tensors, sparsify
from egmla.quant import QUANTIZATIONS, load_gguf_weights, quantize_model
from serve.config import EngineConfig, accept_vllm_no_ops
from serve.engine import LLMEngine, StepFailed
from serve.inputs import content_text
from serve.sampling import InvalidRequest, SamplingParams
from serve.outputs import OutputProcessor


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model's raw distribution, its rank (1: the most
    likely) and its text, as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # with logprobs requested: the sampled tokens' sum
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the top-N and the sampled one
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or string; None for EOS or length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with prompt_logprobs=N
    metrics: dict[str, float | None] = field(default_factory=dict)  # ttft, tpot of sample 0 (s)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_text(text: object, field: str, param: str | None = None) -> None:
    """`text` is a string that encodes as UTF-8 (JSON can carry lone surrogates, which no
    tokenizer takes); else InvalidRequest naming `field`."""
    if not isinstance(text, str):
        raise InvalidRequest(f"{field}: expected a string, got {type(text).__name__}",
                             param or field)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(f"{field}: not valid Unicode text ({error.reason} at character "
                             f"{error.start})", param or field) from None


def resolve_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer=` as vLLM takes it: a tokenizer object (kept), None (the model's own), or a
    name or path to load one from: a directory with tokenizer files (an export, a transformers
    model), a known model name (egmla.imports.KNOWN_MODELS), else a hub id through transformers
    (which needs the network). ValueError, naming the value, when none of these has one."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from egmla.checkpoint import tokenizer_or_none
    from egmla.imports import _known_name

    path = Path(tokenizer)
    if path.is_dir():
        found = tokenizer_or_none(path)
        if found is None:
            raise ValueError(f"tokenizer={str(tokenizer)!r}: that directory holds no tokenizer "
                             "files")
        return found
    if _known_name(tokenizer):
        return load_pretrained(str(tokenizer))[1]
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    except (OSError, ValueError) as error:
        raise ValueError(f"tokenizer={str(tokenizer)!r}: not a directory with tokenizer files, "
                         f"not a known model name ({', '.join(KNOWN_MODELS)}), and not loadable "
                         f"from the hub ({str(error).splitlines()[0]})") from None


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | Transformer,
        tokenizer: Any = None,
        dtype: torch.dtype | str | None = None,
        ffn_sparsity: str | None = None,
        ffn_threshold: float | list[float] = 0.0,
        ffn_predictors: str | os.PathLike | None = None,
        *,
        quantization: str | None = None,
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        seed: int | None = None,
        **engine_args: Any,
    ) -> None:
        """`model`: a Transformer (with `tokenizer`), an export directory or a known name, loaded
        in `dtype`: "auto" or None (the export's), a name as vLLM takes it ("bfloat16", "bf16",
        "float16", "half", "float32", "float") or a torch.dtype. `engine_args` are
        `EngineConfig`'s fields (block_size, num_blocks, kv_cache_memory, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, cache_dtype:
        the KV cache's dtype, by default the weights', attention_backend: how MHA/GQA layers
        attend, one of serve.attention.BACKENDS, "auto" by default; enforce_eager: False
        compiles decode steps, True by default; gpu_memory_utilization: a CUDA device's share
        that sizes the KV pool), with its defaults. As vLLM's:
        `device` is where the weights, the KV cache and the sampling live ("cpu", "cuda",
        "cuda:N"; default: where the model is, the CPU for a loaded one),
        `max_model_len` caps a request's prompt + output (default: the model's context),
        `seed` seeds the sampling of every request that brings no seed of its own (one
        generator for the engine, so a run is reproducible). vLLM's arguments that change
        nothing here at the values given (`trust_remote_code`, `tensor_parallel_size=1`, ...:
        serve.config.VLLM_NO_OPS) are accepted with a log line each, other values refused.

        `ffn_sparsity` decodes the MLPs over only the neurons that fire
        (egmla.models.sparse_ffn): "gate" (exact for ReLU-family MLPs; SwiGLU needs
        `ffn_threshold` > 0, an approximation: one number, or a list of one per layer),
        "oracle" (exact, slower: a check) or "predicted" (a hot block of neurons always, the
        rest where per-layer predictors say they fire: an approximation as good as their
        recall), which takes `ffn_predictors`, the predictors.safetensors that `python -m
        studies.locality predictors` wrote for this model, and their thresholds; loading them
        reorders the model's neurons in place, as they were trained (the function is
        unchanged). None, the default, is dense.

        `quantization` (vLLM's argument): "q8_0", "q4_0" or "q4_1" quantizes every linear layer
        of the blocks and the LM head at load into llama.cpp's blocks of that format (a 4-bit
        method's head in Q8_0, as llama.cpp keeps its output tensor finer; egmla.quant);
        "gguf" (vLLM's name) keeps a GGUF model's quantized tensors as the file stores them
        (for a model in egmla.imports.KNOWN_MODELS: the shipped SmolLM2 is Q4_1, its head
        Q8_0), checked to decode to the converted model's weights exactly. Activations
        are quantized per block in each product as llama.cpp does. None, the default, keeps
        the float weights. A decode step's blocks run in the fused quantized block kernel on
        the CPU."""
        dtype = parse_model_dtype(dtype)  # a bad dtype fails before loading, naming itself
        where = parse_device(device)  # and so does a device this machine does not have
        check_sparsity(ffn_sparsity, ffn_threshold, ffn_predictors)
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r}: expected one of "
                             f"{', '.join(QUANTIZATIONS)} or None")
        gguf_file = None
        if quantization == "gguf":
            gguf_file = None if isinstance(model, Transformer) else gguf_source(model)
            if gguf_file is None:
                what = repr(str(model)) if isinstance(model, (str, Path)) else "a model object"
                raise ValueError(f"quantization='gguf': {what} is not a GGUF model; those are "
                                 f"{', '.join(KNOWN_MODELS)}")
        if quantization is not None and ffn_sparsity is not None:
            raise ValueError(f"quantization={quantization!r} with ffn_sparsity={ffn_sparsity!r}: "
                             "the sparse MLP decodes float weights only, choose one")
        if ffn_predictors is not None:  # a missing or unreadable file fails before loading
            predictor_file = (read_weights(Path(ffn_predictors)), read_metadata(Path(ffn_predictors)))
        engine_args = accept_vllm_no_ops(engine_args)  # tensor_parallel_size=1 and the like
        if "cache_dtype" in engine_args:
            engine_args["cache_dtype"] = parse_model_dtype(engine_args["cache_dtype"])
        tokenizer = resolve_tokenizer(tokenizer)  # a name or directory: loaded before the model
        config = EngineConfig.from_args(max_model_len=max_model_len, seed=seed, **engine_args)
        if isinstance(model, Transformer):
            self.model, self.tokenizer = model, tokenizer
            if dtype is not None:
                self.model.to(dtype)
            if where is not None:
                self.model.to(where)
        else:
            self.model, loaded_tokenizer = load_pretrained(model, dtype=dtype, device=where)
            self.tokenizer = tokenizer or loaded_tokenizer
        self.model.eval()
        predictors = None
        if ffn_predictors is not None:
            cfg = self.model.config
            predictors, trained_at = predictors_from_tensors(*predictor_file, cfg.n_layers, cfg.d_ff)
            given = layer_thresholds(ffn_threshold, cfg.n_layers, "ffn_threshold")
            if any(given) and given != layer_thresholds(trained_at, cfg.n_layers):
                raise ValueError(f"ffn_threshold={ffn_threshold!r}: {ffn_predictors} were trained "
                                 f"for the threshold {trained_at!r}, which predicted mode uses")
            ffn_threshold = trained_at
        sparsify(self.model, ffn_sparsity, ffn_threshold, predictors)
        if gguf_file is not None:
            load_gguf_weights(self.model, gguf_file)
        elif quantization is not None:
            quantize_model(self.model, quantization)
        self.name = str(model) if not isinstance(model, Transformer) else "egmla"
        self.engine = LLMEngine(self.model, config)
        self.outputs = OutputProcessor(self.engine, self.decode)

    # ---- text <-> tokens ----------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text -> token ids (token ids pass through; the engine checks their range)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: pass token ids, not text", "prompt")
            check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequest(f"prompt: expected text or a list of token ids, got "
                                 f"{type(prompt).__name__}", "prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, str]], **template: Any) -> list[int]:
        """A conversation -> token ids, through the tokenizer's chat template with the assistant
        turn opened (`template`: render_chat's arguments)."""
        return self.render_chat(messages, **template)[1]

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """A conversation -> (the rendered prompt, its token ids), through the tokenizer's chat
        template or `chat_template`, as vLLM's `LLM.chat` takes them: the assistant turn opened
        (`add_generation_prompt`), or the last message left open to be continued
        (`continue_final_message`; not both), `chat_template_kwargs` passed to the template."""
        if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
            raise InvalidRequest("add_generation_prompt and continue_final_message: must be true "
                                 "or false", "messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequest("add_generation_prompt and continue_final_message: choose one "
                                 "(a new assistant turn, or the last message continued)", "messages")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise InvalidRequest("chat_template_kwargs: expected a dict", "chat_template_kwargs")
        if chat_template is not None and not isinstance(chat_template, str):
            raise InvalidRequest("chat_template: expected the template's text", "chat_template")
        if self.tokenizer is None or not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise InvalidRequest(f"{self.name}: its tokenizer has no chat template", "messages")
        messages = [self._message(i, message) for i, message in enumerate(messages)]
        options = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "chat_template": chat_template}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as error:  # a template's own error (jinja2's), a bad final message
            raise InvalidRequest(f"the chat template failed: {error}", "messages") from None
        # rendered once: its tokens as apply_chat_template(tokenize=True) makes them (the text,
        # no special tokens added: the template writes its own)
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def _message(i: int, message: object) -> dict[str, Any]:
        """One chat message checked, its content as text (OpenAI's content parts joined by
        newlines, as vLLM's string content format)."""
        if isinstance(message, dict):
            try:
                content = content_text(message.get("content"), f"messages[{i}].content")
            except ValueError as error:
                raise InvalidRequest(str(error), "messages") from None
            if isinstance(content, str):
                check_text(content, f"messages[{i}].content", param="messages")
                return {**message, "content": content}
        raise InvalidRequest(f"messages[{i}]: expected a dict with a string 'content' (or a list "
                             "of text parts)", "messages")

    def get_tokenizer(self) -> Any:
        """The tokenizer this LLM encodes and decodes with, as vLLM's `get_tokenizer()`: a
        transformers tokenizer (`encode`, `decode`, `apply_chat_template`, `eos_token_id`), or
        None for a model that came without one."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` uses when given none, as vLLM's method of this name:
        vLLM's defaults (temperature 1.0; the models here carry no generation config)."""
        return SamplingParams()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return (self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
                if self.tokenizer else "")

    def with_eos(self, params: SamplingParams) -> SamplingParams:
        """`params` that also stop at the model's end-of-sequence token (unless ignore_eos)."""
        eos = getattr(self.tokenizer, "eos_token_id", None) or self.model.config.eos_token_id
        if eos is None or params.eos_token_id is not None:
            return params
        return dataclasses.replace(params, eos_token_id=eos)

    # ---- generation ---------------------------------------------------------------------------

    def prompt_ids(self, prompt: object, index: int | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt as vLLM takes it: text, {"prompt": text},
        {"prompt_token_ids": [...]} or (ours) a list of token ids."""
        where = "prompts" if index is None else f"prompts[{index}]"
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or len(prompt) != 1:
                raise InvalidRequest(f"{where}: a prompt dict holds exactly one of 'prompt' or "
                                     f"'prompt_token_ids'" + (f", not {', '.join(unknown)}"
                                                              if unknown else ""), "prompts")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self.encode(list(prompt))
        raise InvalidRequest(f"{where}: expected text, token ids or a prompt dict, got "
                             f"{type(prompt).__name__}", "prompts")

    def generate(
        self,
        prompts: object,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, as vLLM's `LLM.generate`: `prompts` is one prompt or a
        list (text, {"prompt": text}, {"prompt_token_ids": ids}, or a list of token ids);
        `sampling_params` one for all or one per prompt (default SamplingParams(): vLLM's
        defaults, temperature 1.0); `use_tqdm` shows a progress bar over the requests. Stop
        strings (SamplingParams.stop) end a sample early and are cut from its text.

        If computing a request fails (an exception in its forward or its sampling), that request
        alone ends: the others run to the end, then `StepFailed` is raised naming the failed
        ones (`reasons`), with `outputs` holding every prompt's RequestOutput in order, None for
        a failed one. `lora_request` is vLLM's, accepted as None only (no adapters here)."""
        _no_lora(lora_request)
        single = (isinstance(prompts, (str, dict))
                  or (isinstance(prompts, (list, tuple)) and prompts and _is_token(prompts[0])))
        prompts = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidRequest(f"{len(sampling_params)} sampling params for {len(prompts)} "
                                     "prompts", "sampling_params")
            per_prompt = [self.with_eos(p) for p in sampling_params]
        else:
            per_prompt = [self.with_eos(sampling_params or self.get_default_sampling_params())
                          ] * len(prompts)
        for p in per_prompt:
            for i, text in enumerate(p.stop):
                check_text(text, f"stop[{i}]", "stop")
        requests = [self.prompt_ids(p, i if not single else None) for i, p in enumerate(prompts)]
        for (_, tokens), p in zip(requests, per_prompt):  # refuse a bad batch before queueing
            self.engine.check_request(tokens, p)
        ids = [self.engine.add_request(tokens, p) for (_, tokens), p in zip(requests, per_prompt)]
        for rid in ids:
            self.outputs.add(rid)
        results, failed, cause = {}, {}, None
        bar = tqdm(total=len(ids), desc="generate", unit="prompt", disable=not use_tqdm)
        try:
            while len(results) + len(failed) < len(ids):
                if self.engine.has_unfinished():
                    try:
                        self.engine.step()
                    except StepFailed as error:  # those requests ended; the others go on
                        self.outputs.discard(error.request_ids)
                        failed.update(error.reasons)
                        cause = cause or error.__cause__
                        bar.update(sum(rid in error.reasons for rid in ids))
                done = [u for u in self.outputs.process() if u.finished]
                results.update((u.request_id, u) for u in done)
                bar.update(len(done))
        except BaseException:  # an interrupt: leave nothing of this call behind
            self.outputs.discard([rid for rid in ids if rid not in results])
            raise
        finally:
            bar.close()
        outputs = [None if rid in failed else self._output(rid, text, tokens, results[rid])
                   for rid, (text, tokens) in zip(ids, requests)]
        if any(rid in failed for rid in ids):
            raise StepFailed({rid: failed[rid] for rid in ids if rid in failed}, outputs) from cause
        return outputs

    def _output(self, rid: int, prompt: str | None, tokens: list[int], update) -> RequestOutput:
        outputs = [CompletionOutput(o.index, o.text, o.token_ids, o.cumulative_logprob,
                                    self._logprobs(o.logprobs), o.finish_reason, o.stop_reason)
                   for o in update.outputs]
        first = update.outputs[0]
        return RequestOutput(str(rid), prompt, tokens, outputs, True, update.cached_tokens,
                             self._logprobs(update.prompt_logprobs),
                             metrics={"ttft": first.ttft, "tpot": first.tpot})

    def _logprobs(self, steps) -> list[dict[int, Logprob] | None] | None:
        if steps is None:
            return None
        return [None if step is None else
                {t: Logprob(lp, rank, self.decode([t], skip_special_tokens=False))
                 for t, (lp, rank) in step.items()} for step in steps]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, lora_request: None = None,
             chat_template_content_format: str = "auto", tools: list | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template (the tokenizer's, or `chat_template`) to each conversation and
        generate, as vLLM's `LLM.chat` (its template arguments: render_chat); each output's
        `prompt` is the rendered conversation. A message's content is text, or OpenAI's list of
        text parts, joined by newlines (vLLM's "string" content format, which "auto" means
        here); vLLM's `lora_request` and `tools` are accepted when they ask for nothing."""
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise InvalidRequest(f"chat_template_content_format={chat_template_content_format!r}: "
                                 "only 'auto' or 'string' (the template gets each message's "
                                 "content as text)", "chat_template_content_format")
        if tools:
            raise InvalidRequest("tools: tool calling is not supported by this engine", "tools")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.render_chat(c, add_generation_prompt, chat_template,
                                     continue_final_message, chat_template_kwargs)
                    for c in conversations]
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for output, (text, _) in zip(outputs, rendered):
            output.prompt = text
        return outputs


def _no_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise InvalidRequest("lora_request: LoRA adapters are not supported by this engine",
                             "lora_request")
