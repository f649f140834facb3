"""Serving: paged-KV engine and OpenAI-compatible server (to come; see the serving issue)."""
