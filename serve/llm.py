"""A Python API shaped like vLLM's, over the engine:

    from serve import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct", block_size=16)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].outputs[0].text, out[0].outputs[0].finish_reason)
    llm.chat([{"role": "user", "content": "Write a Python function that adds two numbers."}])

`model` is a training export directory or a known imported model name (see egmla.imports).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from egmla.imports import load_pretrained
from egmla.models import Transformer
from serve.engine import EngineConfig, LLMEngine, SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | Transformer,
        tokenizer: Any = None,
        block_size: int = 16,
        kv_cache_memory: int = 512 * 2**20,  # bytes for the paged KV pool
        num_blocks: int | None = None,  # overrides kv_cache_memory
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(model, Transformer):
            self.model, self.tokenizer = model, tokenizer
        else:
            self.model, loaded_tokenizer = load_pretrained(model, dtype=dtype)
            self.tokenizer = tokenizer or loaded_tokenizer
        self.model.eval()
        self.name = getattr(model, "name", None) or str(model)
        if num_blocks is None:
            per_block = self.model.cache_spec().bytes_per_token(
                self.model.tok_emb.weight.dtype) * block_size
            num_blocks = max(1, kv_cache_memory // per_block)
        self.engine = LLMEngine(self.model, EngineConfig(
            block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill))

    # ---- text <-> tokens ----------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, not text")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | None = None,
        stop: list[str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); stop strings end a sample early and are
        cut from its text."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        eos = getattr(self.tokenizer, "eos_token_id", None) or self.model.config.eos_token_id
        if eos is not None and eos not in params.stop_token_ids:
            params = SamplingParams(**{**vars(params), "stop_token_ids": (*params.stop_token_ids, eos)})
        requests = [(p, self._encode(p)) for p in prompts]
        ids = [self.engine.add_request(tokens, params) for _, tokens in requests]
        stopped: dict[int, str] = {}  # seq id -> text cut at a stop string
        while self.engine.has_unfinished():
            self.engine.step()
            if stop:
                self._check_stop_strings(ids, stop, stopped)
        return [self._output(rid, p, tokens, stopped) for rid, (p, tokens) in zip(ids, requests)]

    def _check_stop_strings(self, ids: list[int], stop: list[str], stopped: dict[int, str]) -> None:
        live = {s.seq_id: s for s in (*self.engine.running, *self.engine.waiting)}
        for rid in ids:
            for seq_id in self.engine.requests[rid]:
                seq = live.get(seq_id)
                if seq is None or not seq.output:
                    continue
                text = self._decode(seq.output)
                cut = min((text.find(s) for s in stop if s in text), default=-1)
                if cut >= 0:
                    stopped[seq_id] = text[:cut]
                    self.engine.finish_early(seq_id, "stop")

    def _output(self, rid: int, prompt, tokens: list[int], stopped: dict[int, str]) -> RequestOutput:
        out = RequestOutput(rid, prompt if isinstance(prompt, str) else None, tokens)
        for i, seq_id in enumerate(self.engine.requests[rid]):
            seq = self.engine.finished[seq_id]
            text = stopped.get(seq_id, self._decode(seq.output))
            out.outputs.append(CompletionOutput(i, text, list(seq.output), seq.finish_reason))
        return out

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | None = None, stop: list[str] | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the assistant prompt) and generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.name}: its tokenizer has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys")
                                else ids))
        return self.generate(prompts, params, stop)
