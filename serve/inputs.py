"""The prompt forms `LLM.generate` takes, under vLLM's names (`vllm.inputs`):

    from serve.inputs import TextPrompt, TokensPrompt
    llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[1, 2, 3])])

Both are plain dicts at run time, so `{"prompt": ...}` and `{"prompt_token_ids": [...]}` work
alike; a bare string or a list of token ids is a prompt too. `content_text` reads a chat
message's content as vLLM's string content format does, for `LLM.chat` and the server alike.
"""

from __future__ import annotations

from typing import Any, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, encoded by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, passed to the model as they are."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def content_text(content: Any, where: str = "content") -> Any:
    """A chat message's content as text: a string as it is, OpenAI's list of content parts as
    their texts joined by newlines (vLLM's string content format); a part of another type, or
    one without a string 'text', is a ValueError naming it. Anything else is returned as it is,
    for the caller's own type check."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}[{i}]: only parts of type 'text' are supported, got {kind!r}"
                             if kind else f"{where}[{i}]: expected a content part object with a "
                             "'type'")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}].text: expected a string, got "
                             f"{type(part.get('text')).__name__}")
        texts.append(part["text"])
    return "\n".join(texts)
