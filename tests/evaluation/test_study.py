"""The gating study (studies/gating/): its plan, its statistics, and one real rehearsal."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import pytest
from scipy import stats as scipy_stats

from eval import stats
from studies import gating as study
from support import ROOT


def rows(phase: str, arm: str, losses: dict[tuple[float, int], float]) -> list[dict]:
    return [{"phase": phase, "arm": arm, "run": f"{arm}-lr{lr:g}-s{seed}-300", "lr": lr,
             "seed": seed, "val_loss": loss, "tokens": 1, "mqar_accuracy": None}
            for (lr, seed), loss in losses.items()]


def test_the_interval_is_students_t_over_the_seeds():
    ci = stats.interval([1.0, 2.0, 3.0])
    half = 4.302652729911275 * 1.0 / 3 ** 0.5  # t(0.975, 2) * sd / sqrt(n)
    assert ci["n"] == 3 and ci["mean"] == 2.0
    assert ci["low"] == pytest.approx(2 - half) and ci["high"] == pytest.approx(2 + half)
    assert stats.interval([5.0]) == {"n": 1, "mean": 5.0, "low": None, "high": None}


def test_a_speed_up_is_the_per_repeat_paired_ratio():
    """stats.paired_ratios: each repeat's ratio to its partner run, their median and the t
    interval of their mean; repeats that do not pair are refused."""
    r = stats.paired_ratios([2.0, 3.0, 4.5], [1.0, 2.0, 3.0])
    assert r["ratios"] == [2.0, 1.5, 1.5] and r["median"] == 1.5 and r["n"] == 3
    assert r["mean"] == pytest.approx(5 / 3) and r["low"] < r["mean"] < r["high"]
    with pytest.raises(ValueError, match="as many repeats"):
        stats.paired_ratios([1.0, 2.0], [1.0])


def test_the_learning_rate_is_the_best_of_a_complete_grid():
    setup = study.Setup(arms=("mla_dc32", "egmla_kv"), lrs=(1e-3, 2e-3, 4e-3))
    records = (rows("lr", "mla_dc32", {(1e-3, 0): 4.9, (2e-3, 0): 4.7, (4e-3, 0): 4.8})
               + rows("lr", "egmla_kv", {(1e-3, 0): 4.6, (2e-3, 0): 4.5}))  # grid not done
    assert study.choose_lrs(records, setup) == {"mla_dc32": 2e-3}
    with pytest.raises(study.StudyError, match="not yet chosen for: egmla_kv"):
        study.plan("seeds", records, setup)
    records += rows("lr", "egmla_kv", {(4e-3, 0): 4.55})
    seeds = study.plan("seeds", records, setup)
    assert {(r.arm, r.lr, r.seed) for r in seeds} == {
        (a, lr, s) for a, lr in (("mla_dc32", 2e-3), ("egmla_kv", 2e-3)) for s in (1, 2)}


def test_a_best_at_the_grids_edge_grows_the_grid_past_it_a_bounded_number_of_times():
    setup = study.Setup(arms=("mla",), lrs=(1e-3, 2e-3, 4e-3), lr_extensions=2)
    grid = lambda records: [r.lr for r in study.plan("lr", records, setup)]  # noqa: E731
    records = rows("lr", "mla", {(1e-3, 0): 4.74, (2e-3, 0): 4.62, (4e-3, 0): 4.54})
    assert grid(records) == [1e-3, 2e-3, 4e-3, 8e-3] and study.choose_lrs(records, setup) == {}
    records += rows("lr", "mla", {(8e-3, 0): 4.50})
    assert grid(records) == [1e-3, 2e-3, 4e-3, 8e-3, 16e-3]
    records += rows("lr", "mla", {(16e-3, 0): 4.49})  # still the edge, but the last extension
    assert grid(records) == [1e-3, 2e-3, 4e-3, 8e-3, 16e-3]
    assert study.choose_lrs(records, setup) == {"mla": 16e-3}
    # an interior minimum settles it; the low edge grows downward; a diverged run is the worst
    interior = rows("lr", "mla", {(1e-3, 0): 4.7, (2e-3, 0): 4.6, (4e-3, 0): float("nan")})
    assert grid(interior) == [1e-3, 2e-3, 4e-3] and study.choose_lrs(interior, setup) == {"mla": 2e-3}
    low = rows("lr", "mla", {(1e-3, 0): 4.5, (2e-3, 0): 4.6, (4e-3, 0): 4.7})
    assert grid(low) == [5e-4, 1e-3, 2e-3, 4e-3]
    fixed = study.Setup(arms=("mla",), lrs=(1e-3, 2e-3, 4e-3), lr_extensions=0)
    assert study.choose_lrs(low, fixed) == {"mla": 1e-3}


def test_paired_differences_pair_the_same_seed_and_say_when_they_exclude_zero():
    chosen = {"mla_dc32": 2e-3, "mla_param_matched": 2e-3, "egmla_kv": 1e-3}
    records = (rows("lr", "mla_dc32", {(2e-3, 0): 4.70}) + rows("seeds", "mla_dc32", {
        (2e-3, 1): 4.80, (2e-3, 2): 4.60})
        + rows("lr", "egmla_kv", {(1e-3, 0): 4.60}) + rows("seeds", "egmla_kv", {
            (1e-3, 1): 4.71, (1e-3, 2): 4.49}))
    arms = study.summarize(records, chosen)["arms"]
    diff = arms["egmla_kv"]["paired_differences"]["mla_dc32"]
    assert diff["n"] == 3 and diff["mean"] == pytest.approx(-0.1 + (0.01 - 0.01) / 3, abs=1e-12)
    assert diff["distinguishable_from_zero"]  # -0.10, -0.09, -0.11: tight around -0.1
    assert arms["egmla_kv"]["val_loss_by_seed"] == {0: 4.60, 1: 4.71, 2: 4.49}
    assert arms["egmla_kv"]["val_loss"]["low"] < 4.6 < arms["egmla_kv"]["val_loss"]["high"]
    assert "mla_dc32" not in arms["mla_dc32"]["paired_differences"]  # not against itself
    assert "egmla_kv" not in arms["mla_dc32"]["paired_differences"]
    ablation = study.summarize(records + rows("ablations", "egmla_kv_de16", {
        (1e-3, 0): 4.70, (1e-3, 1): 4.81, (1e-3, 2): 4.59}), chosen)["arms"]["egmla_kv_de16"]
    assert ablation["paired_differences"]["egmla_kv"]["mean"] == pytest.approx(0.1)
    # The summary is written as JSON: scipy's numbers must not leak in (a numpy bool did, and
    # stopped the study once an arm had two seeds)
    assert json.loads(json.dumps(arms))["egmla_kv"]["paired_differences"]["mla_dc32"][
        "distinguishable_from_zero"] is True
    noisy = records[:3] + rows("lr", "egmla_kv", {(1e-3, 0): 4.60}) + rows("seeds", "egmla_kv", {
        (1e-3, 1): 4.90, (1e-3, 2): 4.40})
    assert not study.summarize(noisy, chosen)["arms"]["egmla_kv"]["paired_differences"][
        "mla_dc32"]["distinguishable_from_zero"]
    # the same difference on every seed (one item of an accuracy): a zero-width interval
    same = stats.paired({0: 0.272, 1: 0.266}, {0: 0.270, 1: 0.264})
    assert same["low"] == pytest.approx(same["high"]) and not same["distinguishable_from_zero"]
    # nor has it a t-test (scipy's would be a rounding error's); with a spread it is scipy's
    assert stats.paired_p([0.272 - 0.270, 0.266 - 0.264]) is None and stats.paired_p([0.1]) is None
    assert stats.paired_p([0.1, 0.3]) == pytest.approx(scipy_stats.ttest_1samp([0.1, 0.3], 0).pvalue)


def test_each_declared_familys_p_values_are_holm_adjusted_within_it():
    """summary.json's `comparisons`: every declared comparison with data, its paired t-test p
    (scipy's, over the seed differences) and that p Holm-adjusted over its own family only; the
    committed record's families are the two-comparison headline, the 21 pairs with a baseline,
    the token-identity contrasts and the two post-hoc placement contrasts."""
    losses = {"mla_dc32": (4.70, 4.80, 4.60), "mla_param_matched": (4.69, 4.82, 4.58),
              "egmla_kv": (4.60, 4.71, 4.49), "mla_value_embed": (4.66, 4.70, 4.58)}
    records = [r for arm, seeds in losses.items()
               for r in rows("seeds", arm, {(2e-3, s): v for s, v in enumerate(seeds)})]
    comparisons = study.summarize(records, dict.fromkeys(losses, 2e-3))["comparisons"]
    by_family: dict[str, list[dict]] = {}
    for c in comparisons:
        by_family.setdefault(c["family"], []).append(c)
        diffs = [a - b for a, b in zip(losses[c["arm"]], losses[c["against"]])]
        assert c["mean"] == pytest.approx(sum(diffs) / 3)
        assert c["p"] == pytest.approx(stats.paired_p(diffs))
    assert {f: [(c["arm"], c["against"]) for c in cs] for f, cs in by_family.items()} == {
        "headline": [("egmla_kv", "mla_dc32"), ("egmla_kv", "mla_param_matched")],
        "baselines": [("mla_param_matched", "mla_dc32"), ("egmla_kv", "mla_dc32"),
                      ("mla_value_embed", "mla_dc32"), ("egmla_kv", "mla_param_matched"),
                      ("mla_value_embed", "mla_param_matched")],
        "token_identity": [("egmla_kv", "mla_value_embed")]}
    for family in by_family.values():
        adjusted = stats.holm([c["p"] for c in family])
        assert [c["p_holm"] for c in family] == pytest.approx(adjusted)
        assert all(c["family_size"] == len(family) for c in family)
    assert by_family["headline"][0]["p_holm"] != by_family["baselines"][1]["p_holm"]  # same pair
    record = json.loads((ROOT / "benchmarks/results/study/summary.json").read_text())
    sizes = {c["family"]: c["family_size"] for c in record["comparisons"] if c.get("measure",
                                                                                   "val_loss") == "val_loss"}
    assert sizes == {"headline": 2, "baselines": 21, "token_identity": 5, "placement_post_hoc": 2}
    # the fair MQAR families ask the headline's and the baselines' questions of recall
    assert study.MQAR_FAMILIES == {"mqar_headline": study.FAMILIES["headline"],
                                   "mqar_baselines": study.FAMILIES["baselines"]}


def test_lm_eval_scores_and_mqar_recall_are_summarized_over_seeds_and_paired(tmp_path):
    chosen = {"mla_dc32": 2e-3, "egmla_kv": 1e-3}
    records = []
    for arm, lr, acc, recall in (("mla_dc32", 2e-3, [0.30, 0.32, 0.31], [0.50, 0.40, 0.45]),
                                 ("egmla_kv", 1e-3, [0.35, 0.36, 0.37], [0.90, 0.80, 0.85])):
        for seed in range(3):
            records += [{**rows("lr" if seed == 0 else "seeds", arm, {(lr, seed): 4.5})[0],
                         "lm_eval": {"corpus_cloze/acc": acc[seed], "other/metric": 1.0}},
                        {**rows("mqar", arm, {(1e-3, seed): 1.0})[0], "lm_eval": {},
                         "mqar_accuracy": {"kv4": recall[seed] + 0.1, "kv16": recall[seed] - 0.1}}]
    arms = study.summarize(records, chosen)["arms"]
    kv = arms["egmla_kv"]
    assert kv["lm_eval_by_seed"][2]["corpus_cloze/acc"] == 0.37
    assert set(kv["lm_eval"]) == {"corpus_cloze/acc"}  # the study's metrics, not every one
    assert kv["lm_eval"]["corpus_cloze/acc"]["mean"] == pytest.approx(0.36)
    cloze = kv["paired_differences_lm_eval"]["corpus_cloze/acc"]["mla_dc32"]
    assert cloze["n"] == 3 and cloze["mean"] == pytest.approx(0.05)
    assert kv["mqar_mean_accuracy"]["mean"] == pytest.approx(0.85)  # the slices' mean, by seed
    recall = kv["paired_differences_mqar"]["mla_dc32"]
    assert recall["mean"] == pytest.approx(0.40) and recall["distinguishable_from_zero"]
    # records without kv bytes of their own (recovered ones) take the arm's, at the study's size
    for r in records:
        r.update(run=f"{r['phase']}-{r['arm']}-s{r['seed']}", steps=1, val_curve=[])
    written = study.write_figures(tmp_path, chosen, records)
    assert {"fig_accuracy_vs_kv_bytes.png", "fig_mqar_vs_kv_bytes.png"} <= set(written)
    mqar_rows = study.figure_rows([r for r in records if r["phase"] == "mqar"], study.MQAR_METRIC)
    assert sorted(r["metric_value"] for r in mqar_rows)[-1] == pytest.approx(0.90)


def test_the_fair_mqar_phases_give_each_arm_its_own_rate_then_its_seeds(tmp_path):
    """mqar_lr runs each arm's own grid on MQAR (2,000 steps at full scale, seed 0), grown past
    the edge its best validation loss is at; mqar_seeds waits for every arm's choice, then
    runs seeds 1 and 2 there; the summary reports recall at each arm's MQAR rate, not at
    egmla_kv's, and the table shows it."""
    from studies.gating.tables import ci, mqar_fair_table

    setup = study.Setup(arms=("mla_dc32", "egmla_kv"), lrs=(1e-3, 2e-3, 4e-3), lr_extensions=1)
    first = study.plan("mqar_lr", [], setup)
    assert {(r.arm, r.lr, r.seed, r.steps) for r in first} == {
        (a, lr, 0, 2000) for a in setup.arms for lr in setup.lrs}
    assert all("experiment=mqar_sweep" in r.base for r in first)
    assert all("trainer.val_every_n_steps=250" in r.command(tmp_path) for r in first)
    with pytest.raises(study.StudyError, match="mqar_lr"):
        study.plan("mqar_seeds", [], setup)
    loss = {"mla_dc32": {1e-3: 1.2, 2e-3: 1.1, 4e-3: 1.0, 8e-3: 0.9},  # best at the top edge
            "egmla_kv": {1e-3: 0.9, 2e-3: 0.7, 4e-3: 0.8}}
    recall = {"mla_dc32": {8e-3: 0.4, 4e-3: 0.3}, "egmla_kv": {2e-3: 0.9, 4e-3: 0.5}}

    def record(arm, lr, seed, phase):
        acc = recall[arm].get(lr, 0.1) + (0.01 if arm == "egmla_kv" else 0.02) * seed
        return {**rows(phase, arm, {(lr, seed): loss[arm].get(lr, 1.0)})[0],
                "mqar_accuracy": {"kv4": acc + 0.05, "kv16": acc - 0.05}}

    records = [record(r.arm, r.lr, 0, "mqar_lr") for r in first]
    grown = study.plan("mqar_lr", records, setup)
    assert {(r.arm, r.lr) for r in grown} - {(r.arm, r.lr) for r in first} == {("mla_dc32", 8e-3)}
    records.append(record("mla_dc32", 8e-3, 0, "mqar_lr"))
    seeds = study.plan("mqar_seeds", records, setup)
    assert {(r.arm, r.lr, r.seed) for r in seeds} == {
        ("mla_dc32", 8e-3, 1), ("mla_dc32", 8e-3, 2), ("egmla_kv", 2e-3, 1), ("egmla_kv", 2e-3, 2)}
    assert all(r.val_every == study.MQAR_VAL_EVERY for r in seeds)
    records += [record(r.arm, r.lr, r.seed, "mqar_seeds") for r in seeds]
    summary = study.summarize(records, {}, setup, study.choose_lrs(records, setup, "mqar_lr"))
    fair = summary["arms"]["egmla_kv"]["mqar_fair"]
    assert fair["lr"] == 2e-3 and sorted(fair["accuracy_by_seed"]) == [0, 1, 2]
    assert fair["mean_accuracy"]["mean"] == pytest.approx(0.91)
    assert fair["by_slice"]["kv4"]["mean"] == pytest.approx(0.96)
    assert summary["arms"]["mla_dc32"]["mqar_fair"]["lr"] == 8e-3
    for r in records:
        r.update(run=f"{r['phase']}-{r['arm']}-{r['lr']}-s{r['seed']}", steps=1, val_curve=[])
    on_mqar = study.choose_lrs(records, setup, "mqar_lr")
    written = study.write_figures(tmp_path, {}, records, on_mqar)
    assert written == ["fig_mqar_fair_vs_kv_bytes.png"]  # each arm at its own MQAR rate
    shown = [r for r in records if study.at_chosen_lr(r, {}, on_mqar)]
    assert {(r["arm"], r["lr"]) for r in shown} == {("mla_dc32", 8e-3), ("egmla_kv", 2e-3)}
    assert len(shown) == 6  # three seeds each, the grid's other rates left out
    table = mqar_fair_table(json.loads(json.dumps(summary))).split("\n")
    assert table[2].startswith("| `mla_dc32` | 0.001: 1.200 / 0.002: 1.100 / 0.004: 1.000 / "
                               "0.008: 0.900 | 0.008 | 0.400 / 0.420 / 0.440 |")
    # recall is nearly two-valued (a plateau, then the lookup): the seeds past 0.5 are counted
    assert fair["learned_seeds"] == 3 and summary["arms"]["mla_dc32"]["mqar_fair"]["learned_seeds"] == 0
    assert "| seeds past 0.5 |" in table[0] and "| 3 of 3 |" in table[3] and "| 0 of 3 |" in table[2]
    # each slice's mean in the order of its pairs (it was kv16 before kv4, by spelling)
    assert "| by slice (4 / 16 pairs) |" in table[0] and "| 0.960 / 0.860 |" in table[3]
    # paired by seed, each arm at its own MQAR rate: egmla_kv 0.90 + 0.01 s, mla_dc32 0.40 + 0.02 s
    against = fair["paired_differences"]["mla_dc32"]
    assert against == pytest.approx(stats.paired({0: 0.9, 1: 0.91, 2: 0.92}, {0: 0.4, 1: 0.42, 2: 0.44}))
    assert against["mean"] == pytest.approx(0.49) and against["distinguishable_from_zero"]
    assert table[0].endswith("| vs `mla_dc32` | vs `mla_param_matched` |")
    assert table[3].endswith(f"| {ci(against, 3, signed=True)} | - |")  # none of its own: "-"
    # the declared MQAR families, over the recall means at each arm's MQAR rate
    mqar = [c for c in summary["comparisons"] if c["measure"] == "mqar_recall"]
    assert [(c["family"], c["arm"], c["against"]) for c in mqar] == [
        ("mqar_headline", "egmla_kv", "mla_dc32"), ("mqar_baselines", "egmla_kv", "mla_dc32")]
    assert all(c["mean"] == pytest.approx(0.49) for c in mqar)
    assert all(c["p"] == pytest.approx(stats.paired_p([0.5, 0.49, 0.48])) for c in mqar)
    assert not any(c["family"] == "headline" for c in summary["comparisons"])  # no val-loss seeds


def test_an_arm_added_later_leaves_the_others_runs_in_the_record():
    """Before an added arm's grid has run, a phase that needs every arm's rate refuses to train
    (naming the arm), but reading the record (`ready_only`: --summarize, --dry-run) still plans
    the ready arms' runs, so their records stay in the summary."""
    setup = study.Setup(arms=("mla_dc32", "mla_kv_embed"), lrs=(1e-3, 2e-3, 4e-3),
                        lr_extensions=0)
    records = rows("lr", "mla_dc32", {(1e-3, 0): 4.7, (2e-3, 0): 4.6, (4e-3, 0): 4.65})
    with pytest.raises(study.StudyError, match="mla_kv_embed"):
        study.plan("seeds", records, setup)
    ready = study.plan("seeds", records, setup, ready_only=True)
    assert {(r.arm, r.lr, r.seed) for r in ready} == {("mla_dc32", 2e-3, 1), ("mla_dc32", 2e-3, 2)}
    assert study.plan("long", records, setup) == study.plan("long", records, setup, ready_only=True)
    assert study.plan("mqar", records, setup, ready_only=True) == []  # needs egmla_kv's rate


def test_the_param_matched_arm_has_egmla_kvs_parameters_lookup_tables_included():
    d_ff = study.param_matched_d_ff()
    matched = study.model_of("small_mla_dc32", [f"model.d_ff={d_ff}"])
    egmla = study.model_of("small_egmla")
    per_unit = 3 * matched.d_model * matched.n_layers
    assert abs(matched.num_params() - egmla.num_params(include_gate_tables=True)) <= per_unit / 2
    assert d_ff > study.model_of("small_mla_dc32").d_ff  # widened, as the arm says


@pytest.mark.slow
def test_a_rehearsal_runs_records_and_resumes(tmp_path):
    """Three real train.py runs (one arm, a two-point LR grid that grows once past the edge its
    best is at, a few steps of a tiny model), the record written; the second invocation trains
    nothing."""
    cmd = [sys.executable, "-m", "studies.gating", "--runs-dir", str(tmp_path / "runs"),
           "--results", str(tmp_path / "results"), "--phase", "lr", "--arms", "mla_dc32",
           "--lrs", "1e-3", "3e-3", "--lr-extensions", "1", "--scale", "0.01", "--extra", "model=tiny",
           "data.seq_len=32", "data.batch_size=4", "data.tokenizer.vocab_size=512",
           "trainer.limit_val_batches=2", "trainer.final_val_batches=2", "export=false"]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    arm = summary["arms"]["mla_dc32"]
    grid = {float(lr): loss for lr, loss in arm["lr_grid_val_loss"].items()}
    first_best = min((1e-3, 3e-3), key=grid.get)
    assert set(grid) == {1e-3, 3e-3, first_best * 2 if first_best == 3e-3 else first_best / 2}
    assert arm["lr"] == min(grid, key=grid.get)
    assert len(list((tmp_path / "results" / "runs").glob("*.json"))) == 3
    assert not list((tmp_path / "runs").glob("*/*/checkpoints"))  # finished: export only
    # the KV-bytes figure (the chosen learning rate's run); the others wait for their phases
    assert sorted(p.name for p in (tmp_path / "results").glob("*.png")) == ["fig_loss_vs_kv_bytes.png"]
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0 and " ..." not in again.stdout  # nothing trained again

    # the notebook shows the record: the arms' table and the figure
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(ROOT / "notebooks" / "study.ipynb", as_version=4)
    assert all(c.outputs == [] for c in notebook.cells if c.cell_type == "code")  # stored clean
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EGMLA_STUDY", str(tmp_path / "results"))
        NotebookClient(notebook, timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    table = next(o.data["text/markdown"] for o in outputs if "| arm |" in o.get("data", {}).get(
        "text/markdown", ""))
    assert "| mla_dc32 |" in table
    shown = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert (tmp_path / "results" / "tables.md").read_text() in shown  # every table
    assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.slow
def test_how_often_a_run_validates_does_not_change_what_it_trains(tmp_path):
    """The fair MQAR runs validate every 250 steps where the first five arms' grids validated
    every 50 (protocol.MQAR_VAL_EVERY): the trained weights must not depend on it (the data
    order is a function of the step, and validating draws nothing the training uses)."""
    tiny = ("model=tiny", "data.batch_size=4", "data.mqar.train_examples=64",
            "data.mqar.val_examples=8", "trainer.log_every_n_steps=1", "optim.warmup_steps=2")
    weights = {}
    for every in (2, 6):
        run = study.Run("mqar_lr", "egmla_kv", "small_egmla", 3e-3, 0, 6, (), study.MQAR_BASE,
                        tiny, val_every=every)
        out = subprocess.run(run.command(tmp_path / str(every)), capture_output=True, text=True,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        directory = run.directory(tmp_path / str(every))
        with (directory / "metrics.csv").open() as f:
            validated = {row["step"] for row in csv.DictReader(f) if row.get("val/loss")}
        assert len(validated) == 6 // every + 1  # that often, and the final pass
        weights[every] = (directory / "export" / "model.safetensors").read_bytes()
    assert weights[2] == weights[6]


TINY = ["--scale", "0.01", "--extra", "model=tiny", "data.seq_len=128", "data.batch_size=4",
        "data.tokenizer.vocab_size=512", "trainer.limit_val_batches=2",
        "trainer.final_val_batches=2"]


def study_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "studies.gating", "--runs-dir", str(tmp_path / "runs"),
                           "--results", str(tmp_path / "results"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_a_run_in_the_record_is_finished_without_its_run_directory(tmp_path):
    """A fresh clone has the committed record and no run directories: what the record holds is
    not planned again, and the phases after it plan from its learning rates."""
    results = tmp_path / "results" / "runs"
    results.mkdir(parents=True)
    for record in rows("lr", "mla_dc32", {(1e-3, 0): 4.7, (2e-3, 0): 4.6, (4e-3, 0): 4.65}):
        run = study.Run("lr", "mla_dc32", "small_mla_dc32", record["lr"], 0, 300)
        (results / f"lr-{run.name}.json").write_text(json.dumps({**record, "run": run.name}))
    out = study_cli(tmp_path, "--arms", "mla_dc32", "--dry-run")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert {line.split()[0] for line in lines if line.split()[1] == "lr"} == {"kept"}
    assert "todo  seeds     mla_dc32-lr0.002-s1-300" in lines  # planned at the kept grid's best
    (results / "broken.json").write_text("{")
    out = study_cli(tmp_path, "--arms", "mla_dc32", "--dry-run")
    assert out.returncode == 2 and "broken.json: not a study run record" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_run_known_only_from_the_record_is_trained_again_to_be_scored(tmp_path):
    """The eval phase needs an export: a run whose directory is gone is trained again (same
    seed, same data order, so the same loss) and scored; the figures redraw from the record."""
    one = ["--arms", "mla_dc32", "--lrs", "1e-3", "--lr-extensions", "0", "--seeds", "0", *TINY]
    first = study_cli(tmp_path, "--phase", "lr", *one)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "results" / "fig_loss_vs_kv_bytes.png").unlink()
    again = study_cli(tmp_path, "--phase", "lr", *one)
    assert again.returncode == 0 and " ..." not in again.stdout, again.stderr[-3000:]
    assert (tmp_path / "results" / "fig_loss_vs_kv_bytes.png").is_file()  # from the record alone
    scored = study_cli(tmp_path, "--phase", "eval", "--eval-limit", "3", *one)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "trained again for its export" in scored.stdout
    record = json.loads((tmp_path / "results" / "runs" / "lr-mla_dc32-lr0.001-s0-3.json").read_text())
    assert record["remade"]["recorded_val_loss"] == pytest.approx(record["val_loss"], rel=1e-6)
    assert {k.split("/")[0] for k in record["lm_eval"]} == set(study.LM_EVAL_TASKS)
    # the study invoked again builds the record anew from the run directory: it keeps both
    for args in (("--summarize",), ("--phase", "eval", "--eval-limit", "3")):
        rerun = study_cli(tmp_path, *args, *one)
        assert rerun.returncode == 0 and " ..." not in rerun.stdout, rerun.stderr[-3000:]
        kept = json.loads((tmp_path / "results" / "runs" / "lr-mla_dc32-lr0.001-s0-3.json").read_text())
        assert kept["remade"] == record["remade"] and kept["lm_eval"] == record["lm_eval"], args
    # a fresh clone again: the record holds the scores, so nothing is trained again for them
    shutil.rmtree(tmp_path / "runs")
    fresh = study_cli(tmp_path, "--phase", "eval", "--eval-limit", "3", *one)
    assert fresh.returncode == 0 and " ..." not in fresh.stdout, fresh.stderr[-3000:]
    kept = json.loads((tmp_path / "results" / "runs" / "lr-mla_dc32-lr0.001-s0-3.json").read_text())
    assert kept["lm_eval"] == record["lm_eval"]


def test_a_record_from_before_a_remake_is_carried_and_an_ordinary_one_is_not():
    recovered = {"val_loss": 4.61, "git": None, "recovered": "from summary.json"}
    assert study._before(recovered) == {"remade": {"recorded_val_loss": 4.61, "recorded_git": None,
                                                   "recovered": "from summary.json"}}
    assert study._before({"val_loss": 4.61, "remade": {"recorded_val_loss": 4.6}}) == {
        "remade": {"recorded_val_loss": 4.6}}  # already remade: as it was, not the new loss
    ordinary = {"val_loss": 4.61, "git": "abc"}
    assert study._before(ordinary) == {} and study._before(None) == {}
    assert study._before(ordinary, remade=True)["remade"]["recorded_git"] == "abc"


@pytest.mark.parametrize("args, named", [
    (["--lrs", "0"], "learning rates must be finite numbers > 0"),
    (["--lrs", "inf"], "learning rates must be finite numbers > 0"),  # was a run of NaNs
    (["--scale", "inf"], "--scale inf: must be a finite number > 0"),  # was an OverflowError
    (["--seeds", "-1"], "seeds are from 0 to 2**32 - 1"),  # train.py refused each run, later
])
def test_bad_arguments_are_one_clear_line(tmp_path, args, named):
    out = study_cli(tmp_path, "--dry-run", *args)
    assert out.returncode == 2 and named in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "results").exists()


def test_the_tables_mark_intervals_that_exclude_zero_and_cut_an_accuracys_at_its_range():
    from studies.gating.tables import ci, mqar_table, seeds_table

    chosen = {"mla_dc32": 2e-3, "egmla_kv": 1e-3}
    records = (rows("lr", "mla_dc32", {(2e-3, 0): 4.70}) + rows("seeds", "mla_dc32", {
        (2e-3, 1): 4.80, (2e-3, 2): 4.60}) + rows("lr", "egmla_kv", {(1e-3, 0): 4.60})
        + rows("seeds", "egmla_kv", {(1e-3, 1): 4.71, (1e-3, 2): 4.49}))
    for arm, recall in (("mla_dc32", (0.05, 0.04, 0.06)), ("egmla_kv", (0.93, 0.54, 0.14))):
        records += [{**rows("mqar", arm, {(1e-3, s): 1.0})[0], "params": 100 + s,
                     "kv_bytes_per_token_bf16": 212, "mqar_accuracy": {"kv4": r, "kv8": r}}
                    for s, r in enumerate(recall)]
    summary = json.loads(json.dumps(study.summarize(records, chosen)))  # as read back
    table = seeds_table(summary).split("\n")
    assert table[2].startswith("| `egmla_kv` | 0.001 | 4.6000 / 4.7100 / 4.4900 | 4.6000 [")
    assert table[2].endswith("| -0.1000 [-0.1248, -0.0752] * | - |")  # tight: excludes zero
    assert table[3].startswith("| `mla_dc32` |") and table[3].endswith("| - | - |")
    recall = mqar_table(summary).split("\n")[2]
    assert recall.startswith("| `egmla_kv` | 212 | 100 | 0.930 / 0.540 / 0.140 | 0.537 [0.000, 1.000] |")
    assert ci({"n": 1, "mean": 0.5, "low": None, "high": None}) == "0.5000 (n=1)"
    assert ci(None) == "-"


def test_the_committed_tables_and_the_docs_quotes_are_the_records():
    """benchmarks/results/study/tables.md is what its summary.json renders, and every table
    docs/study.md quotes (after a `<!-- study table: NAME -->` line) is the record's: a re-run
    that moves a figure fails here until `python -m studies.gating.tables` has rewritten them."""
    from studies.gating.tables import MARKER, SECTIONS, quote, render

    results = ROOT / "benchmarks" / "results" / "study"
    summary = json.loads((results / "summary.json").read_text())
    assert (results / "tables.md").read_text() == render(summary)
    docs = (ROOT / "docs" / "study.md").read_text()
    quoted = {m[1] for line in docs.split("\n") if (m := MARKER.match(line))}
    assert {"lr", "seeds", "comparisons", "long", "ablations", "mqar"} <= quoted <= set(SECTIONS)
    assert quote(docs, summary) == docs


def test_the_tables_command_rewrites_only_the_quoted_tables(tmp_path, capsys):
    from studies.gating import tables as study_tables

    summary = ROOT / "benchmarks" / "results" / "study" / "summary.json"
    doc = tmp_path / "doc.md"
    doc.write_text("Intro.\n\n<!-- study table: long -->\n| stale |\n|---|\n| `x` |\n\nAfter.\n")
    assert study_tables.main([str(doc), "--summary", str(summary)]) == 0
    text = doc.read_text()
    assert "| stale |" not in text and text.startswith("Intro.\n\n<!-- study table: long -->\n| arm")
    assert text.endswith("|\n\nAfter.\n")
    doc.write_text("<!-- study table: nope -->\n")
    assert study_tables.main([str(doc), "--summary", str(summary)]) == 2
    assert "unknown study table 'nope'" in capsys.readouterr().err
    assert doc.read_text() == "<!-- study table: nope -->\n"  # untouched


def test_a_remade_run_does_not_reopen_the_learning_rate_it_was_chosen_at():
    """Trained again on another machine, mla_dc32's best rate came out 0.008 worse, above the
    next rate's loss recorded on the first machine: the choice stands (the grid shows the losses
    that made it), and the seeds use the new loss, the model lm-eval scored."""
    setup = study.Setup(arms=("mla_dc32",), lrs=(1e-3, 2e-3, 4e-3))
    records = rows("lr", "mla_dc32", {(1e-3, 0): 4.66, (2e-3, 0): 4.61, (8e-3, 0): 4.5258})
    records += [{**rows("lr", "mla_dc32", {(4e-3, 0): 4.5271})[0],
                 "remade": {"recorded_val_loss": 4.5195, "recorded_git": None}}]
    assert study.choose_lrs(records, setup) == {"mla_dc32": 4e-3}
    assert [r.lr for r in study.plan("lr", records, setup)] == [1e-3, 2e-3, 4e-3, 8e-3]
    arm = study.summarize(records, study.choose_lrs(records, setup), setup)["arms"]["mla_dc32"]
    assert arm["lr_grid_val_loss"]["0.004"] == 4.5195 and arm["val_loss_by_seed"] == {0: 4.5271}
    # an arm whose grid is not settled has no rate yet: its tables say so, they do not fail
    from studies.gating.tables import render

    open_grid = study.summarize(records[:3], {}, setup)
    (row,) = [line for line in render(json.loads(json.dumps(open_grid))).split("\n")
              if line.startswith("| `mla_dc32` |")]  # the grid's row, and no seeds yet
    assert row.endswith("| 4.5258 | - |")  # 8e-3 best, at the edge: no rate chosen


def test_the_summary_says_how_far_the_runs_trained_again_moved():
    """Each remade run with its loss then and now, largest change first; the table states their
    number, mean and largest change, and names the runs that moved most."""
    from studies.gating.tables import remakes_table

    records = rows("lr", "mla_dc32", {(4e-3, 0): 4.5271, (2e-3, 0): 4.61})
    records[0]["remade"] = {"recorded_val_loss": 4.5195}
    records += [{**rows("seeds", "mha", {(2e-3, 1): 4.6321})[0],
                 "remade": {"recorded_val_loss": 4.6332}}]
    summary = json.loads(json.dumps(study.summarize(records, {})))
    assert [(r["run"], round(r["difference"], 4)) for r in summary["remakes"]] == [
        ("lr-mla_dc32-lr0.004-s0-300", 0.0076), ("seeds-mha-lr0.002-s1-300", -0.0011)]
    table = remakes_table(summary, most=1).split("\n")
    assert table[2:] == ["| `lr-mla_dc32-lr0.004-s0-300` | 4.5195 | 4.5271 | +0.0076 |",
                         "| all 2: mean (mean size) |  |  | +0.0032 (0.0044) |"]
    assert remakes_table(study.summarize(records[1:2], {})) == ""  # none remade: no table


def test_the_docs_reading_quotes_the_record():
    """The figures docs/study.md's prose quotes (the seeds reading, the longer budget, the
    conclusion) are the committed record's: a re-run that moves one fails here until the text
    follows (the tables are checked above)."""
    arms = json.loads((ROOT / "benchmarks/results/study/summary.json").read_text())["arms"]
    docs = " ".join((ROOT / "docs" / "study.md").read_text().split())  # lines joined

    def section(start: str, end: str) -> str:
        return docs.split(start, 1)[1].split(end, 1)[0]

    def quoted(arm: str) -> str:
        d = arms[arm]["paired_differences"]["mla_dc32"]
        return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"

    seeds = section("What these runs support", "What they do not support:")
    kv = arms["egmla_kv"]["paired_differences"]
    dc32, matched = kv["mla_dc32"], kv["mla_param_matched"]
    assert f"{-dc32['mean']:.3f} nats below `mla_dc32`" in seeds
    assert f"interval [{dc32['low']:.3f}, {dc32['high']:.3f}], and {-matched['mean']:.3f} below" in seeds
    assert f"[{matched['low']:.3f}, {matched['high']:.3f}], which also excludes zero" in seeds
    assert dc32["distinguishable_from_zero"] and matched["distinguishable_from_zero"]
    spread = arms["mla_param_matched"]["val_loss_by_seed"].values()
    assert f"({min(spread):.3f} to {max(spread):.3f} at 8e-3)" in seeds
    for arm in ("egmla_const_gate", "mla_value_embed", "egmla_latent", "egmla_hidden_gate", "mla"):
        assert quoted(arm) in seeds, arm
    long = section("### Longer budget", "### Ablations")
    at_4x = {n: a["long"][0]["val_loss"] for n, a in arms.items() if a["long"]}
    seed0 = {n: a["val_loss_by_seed"]["0"] for n, a in arms.items() if a["val_loss_by_seed"]}
    gain = {n: (at_4x[n] - at_4x["mla_dc32"], seed0[n] - seed0["mla_dc32"])
            for n in ("egmla_kv", "mla_value_embed")}
    assert f"({gain['egmla_kv'][0]:+.3f}, against {gain['egmla_kv'][1]:+.3f} for the same seed" in long
    assert f"({gain['mla_value_embed'][1]:+.3f} to {gain['mla_value_embed'][0]:+.3f})" in long
    record = json.loads((ROOT / "benchmarks/results/study/summary.json").read_text())
    holm = {(c["family"], c["arm"], c["against"]): c for c in record["comparisons"]}
    sizes = {c["family"]: c["family_size"] for c in record["comparisons"]}
    conclusion = section("## Conclusion", "### Provenance")

    def ci(c: dict) -> str:
        return f"{c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"

    headline = [holm["headline", "egmla_kv", b] for b in ("mla_dc32", "mla_param_matched")]
    wide = [holm["baselines", "egmla_kv", b] for b in ("mla_dc32", "mla_param_matched")]
    within = f"Holm-adjusted within the family {headline[0]['p_holm']:.3f} and {headline[1]['p_holm']:.3f}"
    assert within in seeds
    assert (f"all {sizes['baselines']} comparisons with a baseline in the table above, Holm-adjusted "
            f"they are {wide[0]['p_holm']:.3f} and {wide[1]['p_holm']:.3f}") in seeds
    assert all(c["p_holm"] > 0.05 for c in wide) and all(c["p_holm"] < 0.05 for c in headline)
    value = holm["token_identity", "egmla_kv", "mla_value_embed"]
    assert (f"`egmla_kv` is {value['mean']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}] against it"
            in seeds and f"{value['p_holm']:.3f} Holm-adjusted over the five token-identity" in seeds)
    assert sizes["token_identity"] == 5 and sizes["placement_post_hoc"] == 2
    gated = [holm["token_identity", a, b] for a, b in (("egmla_kv", "mla_kv_embed"),
                                                       ("egmla_v_gate", "mla_value_embed"))]
    for c, placement in zip(gated, ("`mla_kv_embed`", "`mla_value_embed`")):
        assert f"{ci(c)} against {placement}" in seeds, placement
        assert f"{ci(c)} on {'K and V' if c is gated[0] else 'V only'}" in conclusion
        assert c["p_holm"] < 0.05  # "multiplying the token id in beat adding it"
    assert f"p {gated[0]['p_holm']:.3f} and {gated[1]['p_holm']:.3f}" in seeds
    assert f"Holm-adjusted {gated[0]['p_holm']:.3f} and {gated[1]['p_holm']:.3f}" in conclusion
    assert f"the embedding gains {quoted('mla_kv_embed')} over `mla_dc32`" in seeds
    placed = [holm["placement_post_hoc", a, b] for a, b in (("egmla_kv", "egmla_v_gate"),
                                                            ("mla_kv_embed", "mla_value_embed"))]
    assert f"(`egmla_kv` against `egmla_v_gate`) is {ci(placed[0])}" in seeds
    assert f"added to K and V against V only is {ci(placed[1])}: no effect detected" in seeds
    assert not any(c["distinguishable_from_zero"] for c in placed)
    assert f"no difference detected, {ci(placed[0])} (a contrast chosen" in conclusion
    v_gate = arms["egmla_v_gate"]
    assert (f"`egmla_v_gate` is {-v_gate['paired_differences']['mla_dc32']['mean']:.3f} below `mla_dc32` "
            f"([{v_gate['paired_differences']['mla_dc32']['low']:+.3f}, "
            f"{v_gate['paired_differences']['mla_dc32']['high']:+.3f}]) at "
            f"{v_gate['kv_bytes_per_token_bf16']} KV bytes") in seeds
    assert (v_gate["kv_bytes_per_token_bf16"] - arms["mla_dc32"]["kv_bytes_per_token_bf16"] == 4
            and arms["egmla_kv"]["kv_bytes_per_token_bf16"] - v_gate["kv_bytes_per_token_bf16"] == 32)
    latent = holm["token_identity", "egmla_latent", "egmla_hidden_gate"]
    assert f"is {latent['mean']:+.3f} [{latent['low']:+.3f}, {latent['high']:+.3f}]: not" in seeds
    assert not latent["distinguishable_from_zero"]
    assert (f"Holm-adjusted p {headline[0]['p_holm']:.3f} and {headline[1]['p_holm']:.3f} within these "
            f"two, the headline family, and {wide[0]['p_holm']:.3f} and {wide[1]['p_holm']:.3f} among all "
            f"{sizes['baselines']} comparisons") in conclusion
    assert (f"{-dc32['mean']:.3f} nats below `mla_dc32` and {-matched['mean']:.3f} below "
            "`mla_param_matched`") in conclusion
    wide = arms["egmla_kv"]["val_loss"]["mean"] - arms["mla"]["val_loss"]["mean"]
    assert f"it is {-wide:.3f} lower at 64% less cache" in conclusion
    scores = section("### lm-eval", "## Conclusion")
    scored = {n: a["lm_eval"] for n, a in arms.items() if a["lm_eval"]}
    for metric, low, high in (("corpus_cloze/acc", 0.26, 0.28), ("mqar_recall/acc", 0.05, 0.09)):
        means = [s[metric]["mean"] for s in scored.values()]
        assert f"between {low:.2f} and {high:.2f}" in scores
        assert low - 0.005 <= min(means) and max(means) < high + 0.005, (metric, means)
        starred = [(n, b, d) for n in scored
                   for b, d in arms[n]["paired_differences_lm_eval"][metric].items()
                   if d["distinguishable_from_zero"]]
        for n, b, d in starred:  # each named, with its interval
            assert (f"`{n}`'s MQAR-task accuracy against `{b}`, {d['mean']:+.3f} "
                    f"[{d['low']:+.3f}, {d['high']:+.3f}]") in scores, (metric, n, b)
        assert len(starred) <= (1 if metric == "mqar_recall/acc" else 0), (metric, starred)
    bits = {n: s["corpus_perplexity/bits_per_byte"]["mean"] for n, s in scored.items()}
    assert f"`egmla_kv` lowest ({bits['egmla_kv']:.3f})" in scores and min(bits, key=bits.get) == "egmla_kv"
    assert f"`mla_dc32` at {bits['mla_dc32']:.3f}" in scores
    by_loss = sorted(bits, key=lambda n: arms[n]["val_loss"]["mean"])
    assert set(sorted(bits, key=bits.get)[-2:]) == {"mha", "gqa2"}  # "MHA and GQA highest"
    rank = {n: i for i, n in enumerate(sorted(bits, key=bits.get))}
    shift = sum((rank[n] - i) ** 2 for i, n in enumerate(by_loss))
    spearman = 1 - 6 * shift / (len(bits) * (len(bits) ** 2 - 1))
    assert spearman > 0.9, spearman  # "orders the arms much as the loss does"
    assert "exclude zero are exactly the paired loss differences that do" in scores
    for base in ("mla_dc32", "mla_param_matched"):
        by_bits = {n for n in scored if arms[n]["paired_differences_lm_eval"][
            "corpus_perplexity/bits_per_byte"].get(base, {}).get("distinguishable_from_zero")}
        by_loss_diff = {n for n in scored if arms[n]["paired_differences"].get(base, {}).get(
            "distinguishable_from_zero")}
        assert by_bits == by_loss_diff, (base, by_bits, by_loss_diff)
    remade = json.loads((ROOT / "benchmarks/results/study/summary.json").read_text())["remakes"]
    assert f"average and {max(abs(r['difference']) for r in remade):.3f} at most" in docs


def test_the_record_written_while_a_phase_trains_keeps_every_run_it_held(tmp_path, monkeypatch):
    """The summary is rewritten after each run trains; the stored runs of phases the pass has
    not reached yet (here mla_dc32's seeds, while the lr phase trains a new arm) stay in it. (It
    once held only what the pass had read so far, so a record committed mid-study was cut.)"""
    from studies.gating import cli

    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    grid = {(1e-3, 0): 4.7, (2e-3, 0): 4.6, (4e-3, 0): 4.65}
    def full(r):  # the fields a real record has beside the loss (runner.record)
        return {**r, "steps": 300, "val_curve": [], "params": 1, "kv_bytes_per_token_bf16": 192,
                "fit_seconds": 1.0, "lm_eval": {}, "git": None}

    stored = rows("lr", "mla_dc32", grid) + rows("seeds", "mla_dc32", {(2e-3, 1): 4.61,
                                                                       (2e-3, 2): 4.62})
    for r in map(full, stored):
        (results / "runs" / f"{r['phase']}-{r['run']}.json").write_text(json.dumps(r))
    seen = []

    def train(run, runs_dir, log):  # stands in for train.py: what the record holds is tested
        if run.lr != 1e-3:
            seen.append(json.loads((results / "summary.json").read_text()))
        return full(rows(run.phase, run.arm, {(run.lr, run.seed): 4.5 + run.lr})[0])

    monkeypatch.setattr(cli, "execute", train)
    code = cli.main(["--runs-dir", str(tmp_path / "runs"), "--results", str(results),
                     "--phase", "lr", "--arms", "mla_dc32", "mla_kv_embed", "--lr-extensions", "0"])
    assert code == 0 and len(seen) == 2  # mla_kv_embed at 2e-3 and 4e-3 saw the record so far
    for summary in seen:
        assert summary["arms"]["mla_dc32"]["val_loss_by_seed"] == {"0": 4.6, "1": 4.61, "2": 4.62}
    final = json.loads((results / "summary.json").read_text())
    assert final["arms"]["mla_dc32"]["val_loss_by_seed"] == {"0": 4.6, "1": 4.61, "2": 4.62}
    assert set(final["arms"]["mla_kv_embed"]["lr_grid_val_loss"]) == {"0.001", "0.002", "0.004"}


def test_a_whole_pass_scores_the_seeds_before_it_trains_the_later_phases(tmp_path, monkeypatch):
    """lm-eval scores the seeds phase's runs as soon as they are in, before the long, ablation
    and MQAR phases train (hours), so their exports are still on the machine: a run directory
    lost in between would have to be trained again to be scored."""
    from studies.gating import cli

    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    grid = {(1e-3, 0): 4.7, (2e-3, 0): 4.6, (4e-3, 0): 4.65}
    stored = [r for arm in ("mla_dc32", "egmla_kv") for r in
              rows("lr", arm, grid) + rows("seeds", arm, {(2e-3, 1): 4.61, (2e-3, 2): 4.62})]
    for r in stored:
        r.update(steps=300, val_curve=[], params=1, kv_bytes_per_token_bf16=192, fit_seconds=1.0,
                 lm_eval={}, git=None)
        (results / "runs" / f"{r['phase']}-{r['run']}.json").write_text(json.dumps(r))
    events = []

    def train(run, runs_dir, log):  # stands in for train.py; the order of the phases is tested
        events.append(("train", run.phase))
        raise cli.StudyError("stop after the first run this pass trains")

    def score(args, stored, records, log):  # stands in for lm-eval: called with what was read
        events.append(("score", sorted({r["phase"] for r in records.values()})))

    monkeypatch.setattr(cli, "execute", train)
    monkeypatch.setattr(cli, "_score", score)
    base = ["--runs-dir", str(tmp_path / "runs"), "--results", str(results),
            "--arms", "mla_dc32", "egmla_kv", "--lr-extensions", "0"]
    assert cli.main(base) == 2  # the stand-in stops the pass at its first training run
    assert events == [("score", ["lr", "seeds"]), ("train", "long")]
    events.clear()
    assert cli.main([*base, "--phase", "eval"]) == 0  # scoring alone trains nothing
    assert events == [("score", ["lr", "seeds"])]
    events.clear()
    assert cli.main([*base, "--summarize"]) == 0 and events == []
