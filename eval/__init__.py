"""Evaluation: KV-bytes report, lm-eval adapter and run comparison."""
