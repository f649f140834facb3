"""Serving: a paged-KV engine for every attention variant (the API and HTTP server come next).

    from serve.engine import LLMEngine, EngineConfig, SamplingParams
"""
