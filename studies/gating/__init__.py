"""What the gate buys: EG-MLA against MLA and MHA with the controls that separate gating, token
identity and extra parameters (issue 17; the protocol and the results are in docs/study.md).

    python -m studies.gating --runs-dir runs/study                 # every phase, resumable
    python -m studies.gating --runs-dir runs/study --phase lr      # one phase
    python -m studies.gating --runs-dir runs/study --dry-run       # list the runs and what is done
    python -m studies.gating --runs-dir runs/study --summarize     # only rebuild summary.json

Every run is a real `train.py` process on the quickstart recipe (the small model, the embedded
corpus, its BPE tokenizer, AdamW with warmup and cosine decay), or on MQAR for the `mqar` phase.
The phases, in the order they run (except eval, which runs right after seeds, while the runs it
scores still have their exports on this machine):

  lr         each arm at every learning rate of the grid, seed 0; the best by final validation
             loss (the whole held-out split) is the arm's learning rate ("best over LR"); while
             the best is at an edge of the grid, the grid grows by a factor of 2 past that edge
             (at most --lr-extensions times), so a chosen rate is a minimum, not an edge
  seeds      each arm at its learning rate, the other seeds
  long       the five arms that decide the question, 4x the tokens, at their learning rates
  ablations  EG-MLA kv's d_e and gate_group_size, at egmla_kv's learning rate
  mqar       every arm on MQAR (the recall task), at egmla_kv's learning rate, 500 steps (the
             first MQAR comparison, kept as it ran: it favours egmla_kv)
  mqar_lr    the fair one: each arm's own grid on MQAR, 2,000 steps, seed 0, the best by MQAR's
             validation loss, grown past an edge as lr's
  mqar_seeds each arm at its MQAR rate, the other seeds
  eval       the offline lm-eval tasks on the final checkpoints of the seeds phase

Re-running skips finished runs and resumes an interrupted one from its last checkpoint, so the
study can be stopped and continued. A run is finished when its run directory holds summary.json
or when the record under --results holds it (the record is committed; run directories are not),
so a study continues on a fresh clone or another machine. The eval phase needs a run's export:
a run known only from the record, and not yet scored there, is trained again for it (same seed
and data order), and the record keeps the loss it had before beside the new one. After every
run the record under --results (default benchmarks/results/study) is rewritten: one JSON per
run (its summary and configuration, not its checkpoints) and summary.json with every arm's
parameters, KV bytes, learning-rate grid, chosen learning rate, per-seed losses with their mean
and 95% interval, and the paired differences against mla_dc32 and mla_param_matched.

The package, one concern a module: protocol (the arms, phases, Setup, Run), arms (their
configurations), plan (the runs a phase needs, the LR grid), runner (train, record, remake,
score), summary (the statistics and the record), plots (the figures), tables (the markdown
tables, `python -m studies.gating.tables`) and cli (`python -m studies.gating`).
"""

from studies.gating.arms import arm_overrides, describe, model_of, param_matched_d_ff
from studies.gating.plan import choose_lrs, eval_runs, lr_grid, plan, selection_loss
from studies.gating.plots import FIGURES, MQAR_METRIC, at_chosen_lr, figure_rows, metric_value, write_figures
from studies.gating.protocol import (ABLATIONS, ARM, ARMS, BASE, BASE_STEPS, BASELINES, FAMILIES,
                                     LM_EVAL_METRICS, LM_EVAL_TASKS, LONG_ARMS, LRS, MQAR_BASE,
                                     MQAR_FAMILIES, MQAR_VAL_EVERY, PHASES, RESULTS, ROOT, SEEDS, Arm,
                                     Run, Setup, StudyError)
from studies.gating.runner import _before, execute, record, remake, score, stored_records
from studies.gating.summary import mqar_mean, remakes, summarize, write_results

__all__ = ["ABLATIONS", "ARM", "ARMS", "BASE", "BASE_STEPS", "BASELINES", "FAMILIES", "FIGURES",
           "LM_EVAL_METRICS", "LM_EVAL_TASKS", "LONG_ARMS", "LRS", "MQAR_BASE", "MQAR_FAMILIES",
           "MQAR_METRIC", "MQAR_VAL_EVERY", "PHASES", "RESULTS", "ROOT", "SEEDS",
           "Arm", "Run", "Setup", "StudyError", "_before", "arm_overrides", "at_chosen_lr",
           "choose_lrs", "describe", "eval_runs", "execute", "figure_rows", "lr_grid",
           "metric_value", "model_of", "mqar_mean", "param_matched_d_ff", "plan", "record",
           "remake", "remakes", "score", "selection_loss", "stored_records", "summarize",
           "write_figures", "write_results"]
