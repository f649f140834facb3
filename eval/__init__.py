"""Measurement tools: the KV-bytes report, the lm-eval adapter and its task YAMLs, run
comparison, the statistics every report uses (eval.stats), and the self-debug code evaluation.
The research programs built on them live in studies/."""
