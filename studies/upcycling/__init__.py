"""Upcycling: SmolLM2-135M-Instruct converted to MLA and EG-MLA (egmla.upcycle), recovered by
distillation, and measured (issue 38; the protocol and the results are in docs/upcycling.md).

    python -m studies.upcycling                    # every phase (hours; resumable)
    python -m studies.upcycling --phases step0     # the training-free table only

The package: quality (what a converted model has kept: held-out perplexity, KL to the
original, perplexity against context length), runs (the phases: step0, train, context,
lm_eval, summary; the runner and its record under benchmarks/results/upcycle) and summary
(the tables, the paired statistics with Holm's adjustment, the plots).
"""
