"""The study's protocol: its arms (variants and the controls that separate gating, token
identity and extra parameters), its phases, budgets, learning-rate grid and seeds; a `Setup`
(what one study covers) and a `Run` (one train.py process). docs/study.md says why each is
what it is."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from eval.local_tasks import group_tasks


ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "study"
BASE = ["experiment=quickstart"]
BASE_STEPS = 300  # 300 x 16 x 128 = 614,400 tokens, as benchmarks/train_variants.py
LONG_FACTOR = 4
MQAR_STEPS = 500  # the first MQAR phase: every arm at egmla_kv's rate (kept as it ran)
# The fair MQAR phases: each arm's own rate from a grid on MQAR itself (its validation loss,
# seed 0, grown past an edge as the lr phase's), then seeds 1 and 2 there, 2,000 steps a run
MQAR_FAIR_STEPS = 2000
MQAR_BASE = ("experiment=mqar_sweep",)
LRS = (1e-3, 2e-3, 4e-3)
LR_EXTENSIONS = 2  # a best LR at the grid's edge adds the next doubling (halving), at most twice
SEEDS = (0, 1, 2)
VAL_EVERY = 50  # periodic validations: the loss-against-tokens curve (Fig. 1a)
# The fair MQAR runs validate (and checkpoint) every 250 steps: their curves are recorded but
# no figure draws them, and a validation of MQAR's three slices with its checkpoint costs about
# 4 s on the AMD EPYC, 14% of a run at every 50 steps. The weights trained do not depend on it
# (tests/evaluation/test_study.py). The runs before egmla_kv's grid validated every 50.
MQAR_VAL_EVERY = 250
LM_EVAL_TASKS = group_tasks("egmla_loglikelihood")  # eval/tasks/egmla_loglikelihood.yaml
EVAL_BATCH_SIZE = 64  # continuations a forward: about 2x lm-eval's default of 1 here, same scores
LM_EVAL_METRICS = ("corpus_cloze/acc", "corpus_cloze/acc_norm", "corpus_perplexity/word_perplexity",
                   "corpus_perplexity/bits_per_byte", "mqar_recall/acc")  # summarized per arm


@dataclass(frozen=True)
class Arm:
    name: str
    attention: str  # the configs/model/attention file
    overrides: tuple[str, ...] = ()
    what: str = ""


ARMS = [
    Arm("mha", "small_mha", what="multi-head attention"),
    Arm("gqa2", "small_gqa2", what="grouped-query, 2 KV heads"),
    Arm("mla", "small_mla", what="MLA, d_c 128"),
    Arm("mla_dc32", "small_mla_dc32", what="MLA at EG-MLA's latent width (d_c 32)"),
    Arm("mla_param_matched", "small_mla_dc32",
        what="MLA d_c 32, FFN widened to EG-MLA kv's total parameters (tables included)"),
    Arm("egmla_kv", "small_egmla", what="EG-MLA, gate on the up-projected K/V"),
    Arm("egmla_latent", "small_egmla_latent", what="EG-MLA, gate on the latent"),
    Arm("egmla_const_gate", "small_egmla_const_gate",
        what="control: EG-MLA kv with one gate row for every token (no token identity)"),
    Arm("mla_value_embed", "small_mla_value_embed",
        what="control: MLA d_c 32 plus a token-id embedding added to V (identity, no gating)"),
    Arm("egmla_hidden_gate", "small_egmla_hidden_gate",
        what="control: the latent gated by sigmoid(W h) from the hidden state"),
    Arm("mla_kv_embed", "small_mla_kv_embed",
        what="control: MLA d_c 32 plus a token-id embedding added to K and V (identity where "
             "egmla_kv gates, added)"),
    Arm("egmla_v_gate", "small_egmla_v_gate",
        what="control: egmla_kv's token-id gate on V only (multiplied where mla_value_embed "
             "adds)"),
]
ARM = {a.name: a for a in ARMS}
# Arms added after the first MQAR phase had run: that phase (every arm at egmla_kv's rate) stays
# as it ran, and they are measured on MQAR by the fair phases only.
LATER_ARMS = ("mla_kv_embed", "egmla_v_gate")
LONG_ARMS = ("mla_dc32", "mla_param_matched", "egmla_kv", "egmla_latent", "mla_value_embed")
BASELINES = ("mla_dc32", "mla_param_matched")  # the paired differences are taken against these
# The comparisons the study states, in families: each reports its p-values raw and Holm-adjusted
# within its family (summary.json's `comparisons`). headline, baselines and token_identity's
# first three were declared after their runs were in (to adjust what the text already compared);
# token_identity's last two before their controls ran; placement_post_hoc after (below).
# - headline: the two the conclusion rests on, EG-MLA kv against MLA at its latent width and
#   against MLA given its parameters;
# - baselines: every arm against each baseline (the seeds table), each pair once;
# - token_identity: the direct contrasts that separate token identity from gating (a gate that
#   carries no token id; token ids added, not multiplied, on V and on K and V; a gate from the
#   hidden state);
# - placement_post_hoc: declared after reading the two controls' seeds, so exploratory: whether
#   the token id on K as well as V changes the loss, gated (egmla_kv against egmla_v_gate) and
#   added (mla_kv_embed against mla_value_embed). Its p-values are not evidence for a claim.
FAMILIES = {
    "headline": (("egmla_kv", "mla_dc32"), ("egmla_kv", "mla_param_matched")),
    "baselines": tuple((a.name, base) for i, base in enumerate(BASELINES) for a in ARMS
                       if a.name != base and a.name not in BASELINES[:i]),
    "token_identity": (("egmla_kv", "egmla_const_gate"), ("egmla_kv", "mla_value_embed"),
                       ("egmla_latent", "egmla_hidden_gate"), ("egmla_kv", "mla_kv_embed"),
                       ("egmla_v_gate", "mla_value_embed")),
    "placement_post_hoc": (("egmla_kv", "egmla_v_gate"), ("mla_kv_embed", "mla_value_embed")),
}
# The same questions asked of MQAR recall (the mean over the slices) in the fair MQAR phases,
# each arm at its own MQAR rate, paired by seed: the headline pair and every arm against each
# baseline. Declared on 2026-12-06, when only `mha`'s grid had run (no EG-MLA or MLA fair run).
MQAR_FAMILIES = {"mqar_headline": FAMILIES["headline"], "mqar_baselines": FAMILIES["baselines"]}
ABLATIONS = {
    **{f"egmla_kv_de{d}": ("small_egmla", (f"model.attention.d_e={d}",)) for d in (16, 32, 128)},
    **{f"egmla_kv_group{g}": ("small_egmla", (f"model.attention.gate_group_size={g}",))
       for g in (2, 4)},
}
# MQAR recall is a phase transition (a run sits near 0.13, answering with one of the context's
# values at random, until it finds the lookup, then rises past 0.9): a run "learned the lookup"
# when its recall, the mean over the slices, passes this; the fair table counts such seeds.
LEARNED_RECALL = 0.5
PHASES = ("lr", "seeds", "long", "ablations", "mqar", "mqar_lr", "mqar_seeds", "eval")


@dataclass(frozen=True)
class Setup:
    """What a study covers: the defaults are the protocol; narrower ones are for a rehearsal or
    a user's own question (`extra`: train.py overrides added to every run)."""

    arms: tuple[str, ...] = tuple(a.name for a in ARMS)
    lrs: tuple[float, ...] = LRS
    lr_extensions: int = LR_EXTENSIONS
    seeds: tuple[int, ...] = SEEDS
    scale: float = 1.0
    extra: tuple[str, ...] = ()

    def steps(self, base: int) -> int:
        return max(2, round(base * self.scale))


@dataclass(frozen=True)
class Run:
    phase: str
    arm: str
    attention: str
    lr: float
    seed: int
    steps: int
    overrides: tuple[str, ...] = field(default=())
    base: tuple[str, ...] = tuple(BASE)
    extra: tuple[str, ...] = ()
    val_every: int = VAL_EVERY  # steps between periodic validations (and checkpoints)

    @property
    def name(self) -> str:
        return f"{self.arm}-lr{self.lr:g}-s{self.seed}-{self.steps}"

    def directory(self, runs_dir: Path) -> Path:
        return runs_dir / self.phase / self.name

    def command(self, runs_dir: Path) -> list[str]:
        return [sys.executable, str(ROOT / "train.py"), *self.base,
                f"model/attention={self.attention}", *self.overrides, *self.extra,
                f"optim.lr={self.lr}", f"seed={self.seed}", f"trainer.max_steps={self.steps}",
                f"trainer.val_every_n_steps={min(self.val_every, self.steps)}",
                f"trainer.checkpoint_every_n_steps={min(self.val_every, self.steps)}",
                "wandb.mode=disabled", "sample_prompt=null", f"name={self.name}",
                f"hydra.run.dir={self.directory(runs_dir)}"]


class StudyError(ValueError):
    """Bad input or a failed run; printed as one line, exit status 2."""
