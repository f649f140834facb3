"""The prompt forms `LLM.generate` takes, under vLLM's names (`vllm.inputs`):

    from serve.inputs import TextPrompt, TokensPrompt
    llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[1, 2, 3])])

Both are plain dicts at run time, so `{"prompt": ...}` and `{"prompt_token_ids": [...]}` work
alike; a bare string or a list of token ids is a prompt too.
"""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, encoded by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, passed to the model as they are."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
