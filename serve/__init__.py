"""Serving: a paged-KV engine for every attention variant, with a vLLM-shaped Python API.

    from serve import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct")
    print(llm.generate("The capital of France is")[0].outputs[0].text)

The OpenAI-compatible HTTP server: `python -m serve --model ...` (serve/api.py, docs/serving.md).
"""

from __future__ import annotations

import importlib

# Imported on first use, so that `serve.sandbox` and the self-debug reports start without torch.
_LAZY = {"EngineConfig": "serve.engine", "LLMEngine": "serve.engine",
         "SamplingParams": "serve.engine", "LLM": "serve.llm", "CompletionOutput": "serve.llm",
         "RequestOutput": "serve.llm"}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'serve' has no attribute {name!r}")
