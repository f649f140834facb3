"""Serving: a paged-KV engine for every attention variant, with a vLLM-shaped Python API.

    from serve import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct")
    greedy = SamplingParams(temperature=0, max_tokens=8)   # vLLM's default temperature is 1.0
    print(llm.generate("The capital of France is", greedy)[0].outputs[0].text)

The OpenAI-compatible HTTP server: `python -m serve --model ...` (serve/server.py, docs/serving.md).
"""

from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.inputs import TextPrompt, TokensPrompt
from serve.llm import LLM, CompletionOutput, Logprob, RequestOutput
from serve.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "Logprob", "RequestOutput",
           "SamplingParams", "TextPrompt", "TokensPrompt"]
