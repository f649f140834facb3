"""The upcycling measurements (studies.upcycling.quality) against direct computations, the recovery mixture
(egmla.data.recovery) keeps out what is evaluated, and the summary's statistics
(studies.upcycling.summary) against scipy and hand-worked cases."""

from __future__ import annotations

import json
import math

import pytest
import torch

from egmla.data.recovery import EVALUATED, recovery_documents, recovery_texts
from egmla.models import Transformer
from egmla.presets import preset
from eval import stats
from eval.stats import holm
from studies.upcycling.quality import context_curve, quality
from studies.upcycling.runs import ARMS, Arm, points
from studies.upcycling.summary import comparisons, markdown, write_summary


def test_quality_is_the_perplexity_and_kl_written_out():
    torch.manual_seed(0)
    a, b = Transformer(preset("tiny-mla")).eval(), Transformer(preset("tiny-gqa2")).eval()
    windows = torch.randint(0, 256, (5, 9), generator=torch.Generator().manual_seed(1))
    got = quality(a, b, windows, batch_size=2)
    with torch.no_grad():
        log_q = a(windows[:, :-1]).log_softmax(-1)
        log_p = b(windows[:, :-1]).log_softmax(-1)
    nll = -log_q.gather(-1, windows[:, 1:, None]).mean().item()
    assert got["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    assert got["kl"] == pytest.approx((log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
                                      rel=1e-5)
    assert quality(a, a, windows)["kl"] == pytest.approx(0.0, abs=1e-6)
    assert got["tokens"] == 40


def test_the_context_curve_averages_each_bucket_of_positions():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha")).eval()
    windows = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(2))
    curve = context_curve(model, windows, buckets=(0, 5, 12, 20))
    with torch.no_grad():
        losses = -model(windows[:, :-1]).log_softmax(-1).gather(-1, windows[:, 1:, None])[..., 0]
    assert [(c["from"], c["to"]) for c in curve] == [(0, 5), (5, 12), (12, 20)]
    assert curve[1]["loss"] == pytest.approx(losses[:, 5:12].mean().item(), rel=1e-5)


def test_the_recovery_mixture_holds_no_evaluated_text_and_holds_documents_out_whole():
    docs = recovery_documents()
    names = [d.name for d in docs]
    assert not any(n.split("/", 1)[1] in EVALUATED for n in names if n.startswith("metadata/"))
    assert not any("/test/" in n or "/idlelib/" in n or "/encodings/" in n for n in names)
    assert {d.kind for d in docs} == {"code", "prose"}
    train, val, fingerprint = recovery_texts(0.05)
    assert not set(train) & set(val) and len(val) < len(train)
    lines = ("And God said, Let there be light", "wherefore art thou Romeo")  # the corpus's
    assert not any(line.lower() in t.lower() for t in train + val for line in lines)
    assert fingerprint == recovery_texts(0.05)[2]


def test_installing_another_distribution_leaves_the_recovery_mixture_as_it_was(monkeypatch):
    """The prose comes from a fixed list: a test library installed mid-campaign (hypothesis,
    say) must not change the tokens that the remaining recovery runs see."""
    import importlib.metadata as md

    from egmla.data import recovery

    class NewTool:
        metadata = {"Name": "a-new-test-tool"}

        def read_text(self, name):
            return "Name: a-new-test-tool\n\n" + "A long description of a new tool. " * 20

    before = recovery.recovery_fingerprint()
    installed = list(md.distributions())
    monkeypatch.setattr(md, "distributions", lambda: [*installed, NewTool()])
    recovery.recovery_documents.cache_clear()
    try:
        assert recovery.recovery_fingerprint() == before
        assert not any(d.name == "metadata/a-new-test-tool" for d in recovery.recovery_documents())
        monkeypatch.setattr(recovery, "RECOVERY_DISTRIBUTIONS",
                            recovery.RECOVERY_DISTRIBUTIONS | {"a-new-test-tool"})
        recovery.recovery_documents.cache_clear()  # the list is what decides: listed, it enters
        assert any(d.name == "metadata/a-new-test-tool" for d in recovery.recovery_documents())
    finally:
        recovery.recovery_documents.cache_clear()


def test_holm_adjusts_like_the_step_down_procedure():
    # worked: p = (0.01, 0.04, 0.03) -> sorted 0.01*3, 0.03*2, 0.04*1 -> 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def _record(arm: Arm, kl: float, steps=(0, 244)) -> dict:
    point = {"tokens": 0, "kv_elements_per_token": 1440, "kv_bytes_per_token_bf16": 2880,
             "params": 1, "params_without_lookup_tables": 1}
    return {"arm": {"seed": arm.seed}, "name": arm.name, "family": arm.family,
            "points": {str(s): {**point, "tokens": s * 4096,
                                **{d: {"kl": kl + s / 1000, "loss": kl, "ppl": math.exp(kl)}
                                   for d in ("corpus", "recovery")}} for s in steps}}


def test_the_paired_comparison_equals_scipys_paired_test(tmp_path):
    from statistics import stdev

    from scipy.stats import t, ttest_rel

    mla = {0: 1.00, 1: 1.10, 2: 0.95}
    kv = {0: 0.90, 1: 1.02, 2: 0.91}
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed in (0, 1, 2):
        for arm, kl in ((Arm("mla", 24, seed=seed), mla[seed]),
                        (Arm("egmla", 24, "kv", seed=seed), kv[seed])):
            (runs / f"{arm.name}.json").write_text(json.dumps(_record(arm, kl)))
    summary = write_summary(tmp_path, lambda m: None)
    row = next(c for c in summary["comparisons"] if c["arm"] == "egmla-kv-dc24"
               and (c["domain"], c["metric"]) == ("corpus", "kl"))
    assert row["mean"] == pytest.approx(sum(kv[s] - mla[s] for s in mla) / 3)
    assert row["p"] == pytest.approx(ttest_rel(list(kv.values()), list(mla.values())).pvalue)
    assert row["p_holm"] == pytest.approx(row["p"])  # alone in its family here
    text = (tmp_path / "summary.md").read_text()
    assert (tmp_path / "quality_vs_kv.png").stat().st_size > 1000
    # the table's row, written out here from scipy's figures
    diffs = [kv[s] - mla[s] for s in mla]
    half = t.ppf(0.975, 2) * stdev(diffs) / math.sqrt(3)
    mean, p = sum(diffs) / 3, row["p"]
    assert (f"| egmla-kv-dc24 | corpus kl | 3 | {mean:.4f} [{mean - half:.4f}, {mean + half:.4f}] "
            f"| {p:.3f} | {p:.3f} |") in text.splitlines()


def test_the_arms_cover_the_issue():
    names = {a.name for a in ARMS}
    for size in (96, 48, 24):
        assert f"mla-dc{size}-s0" in names
    for size in (48, 24):
        for position in ("kv", "latent"):
            assert f"egmla-{position}-dc{size}-s0" in names
    assert "egmla-paper-dc24-s0" in names
    for seed in (1, 2):
        assert {f"mla-dc24-s{seed}", f"egmla-kv-dc24-s{seed}", f"egmla-latent-dc24-s{seed}"} <= names


def test_one_run_of_each_arm_is_measured_in_depth_and_a_lost_one_is_named(tmp_path):
    """Context curves and lm-eval take one run per arm (its last seed: 2 for the smallest
    cache's three, 0 for the rest), right after it trains; a complete record of such a run
    without them (its exports gone with an earlier machine) is named."""
    from studies.upcycling.runs import depth_jobs, measured_in_depth, unmeasured

    deep = [a for a in ARMS if measured_in_depth(a)]
    assert sorted(a.family for a in deep) == sorted({a.family for a in ARMS})  # one per arm
    assert {a.name for a in deep if a.d_c == 24 and a.gate_form == "identity"
            and not a.transfer_steps} == {"mla-dc24-s2", "egmla-kv-dc24-s2",
                                          "egmla-latent-dc24-s2"}
    assert all(a.seed == 0 for a in deep if a.family not in
               ("mla-dc24", "egmla-kv-dc24", "egmla-latent-dc24"))

    runs_dir, results = tmp_path / "runs", tmp_path / "results"
    arm, other = Arm("mla", 24, seed=2), Arm("mla", 24, seed=1)
    for a in (arm, other):
        (runs_dir / a.name).mkdir(parents=True)
        (runs_dir / a.name / "config.json").write_text(json.dumps({"trainer": {"max_steps": 244},
                                                                   "export_steps": [24]}))
    assert depth_jobs([arm, other], runs_dir) == [
        ("original", "0", None), (arm.name, "0", runs_dir / arm.name / "init"),
        (arm.name, "244", runs_dir / arm.name / "export")]  # seed 1 is not measured in depth
    (results / "runs").mkdir(parents=True)
    for a in (arm, other):
        (results / "runs" / f"{a.name}.json").write_text(json.dumps(
            {**_record(a, 1.0), "complete": True}))
    assert unmeasured([arm, other], results) == [arm.name]
    (results / "context.json").write_text(json.dumps({"curves": {f"{arm.name}@244": []}}))
    (results / "lm_eval.json").write_text(json.dumps({"scores": {f"{arm.name}@244": {}}}))
    assert unmeasured([arm, other], results) == []


def test_points_follow_the_run_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"trainer": {"max_steps": 10},
                                                      "export_steps": [3, 12]}))
    assert sorted(points(tmp_path)) == [0, 3, 10]
    assert points(tmp_path)[3] == tmp_path / "exports" / "step3"


def test_comparisons_skip_what_has_no_partner():
    assert comparisons({"mla-dc24": {}}, "244") == []


def test_gate_rows_trained_counts_the_rows_that_changed(tmp_path):
    from egmla.checkpoint import save_export
    from studies.upcycling.runs import table_rows_trained

    torch.manual_seed(0)
    model = Transformer(preset("tiny-egmla", attention={
        "type": "egmla", "d_c": 8, "d_e": 4, "d_nope": 16, "d_rope": 8, "d_v": 16,
        "gate_group_size": 2})).eval()
    before = save_export(model, tmp_path / "a")
    with torch.no_grad():
        model.layers[0].attn.gate_table.weight[[3, 7, 200]] += 1.0  # one shared table
    after = save_export(model, tmp_path / "b")
    rows = table_rows_trained(before, after)
    assert rows["tables"] == 1 and rows["rows_per_table"] == 256
    assert rows["rows_changed_total"] == 3
    assert table_rows_trained(before, before)["rows_changed_total"] == 0
    mla = save_export(Transformer(preset("tiny-mla")), tmp_path / "mla")
    assert table_rows_trained(mla, mla) is None


def test_transfer_is_compared_with_kl_alone_only_when_both_ran():
    from studies.upcycling.summary import transfer_comparison

    plain, transfer = _record(Arm("mla", 24), 1.0), _record(Arm("mla", 24, transfer_steps=24), 0.9)
    plain["arm"]["transfer_steps"], transfer["arm"]["transfer_steps"] = 0, 24
    # the training time over all starts: recorded as such, or the one start's; else unknown
    plain.update(fit_seconds=100.0, starts=[{}])
    transfer.update(fit_seconds=30.0, fit_seconds_all_starts=90.0, starts=[{}, {}])
    assert transfer_comparison([plain]) == {}
    both = transfer_comparison([plain, transfer])
    assert both["transfer, then KL (mla-dc24-transfer24-s0)"]["fit_seconds"] == 90.0
    assert both["KL alone (mla-dc24-s0)"]["fit_seconds"] == 100.0
    assert both["KL alone (mla-dc24-s0)"]["corpus_kl"] == pytest.approx(1.0 + 0.244)
    plain["starts"] = [{}, {}]  # resumed before the clock: its earlier starts' time is lost
    assert transfer_comparison([plain, transfer])["KL alone (mla-dc24-s0)"]["fit_seconds"] is None


def test_a_perplexitys_interval_is_the_loss_intervals_exponentiated(tmp_path):
    """Two seeds at perplexity 711 and 596 (losses 6.567 and 6.390): a t-interval of the
    perplexities themselves runs below zero; the summary gives the geometric mean and the
    interval of the mean loss, exponentiated, which stays positive."""
    from scipy import stats as scipy_stats

    runs = tmp_path / "runs"
    runs.mkdir()
    losses = {0: math.log(711.1), 1: math.log(596.0)}
    for seed, loss in losses.items():
        (runs / f"mla-dc24-s{seed}.json").write_text(json.dumps(_record(Arm("mla", 24, seed=seed),
                                                                          loss)))
    summary = write_summary(tmp_path, lambda m: None)
    row = next(r for r in summary["arms"] if r["arm"] == "mla-dc24" and r["step"] == 244)
    mean = sum(losses.values()) / 2
    low, high = scipy_stats.t.interval(0.95, 1, loc=mean, scale=scipy_stats.sem(list(losses.values())))
    ppl = row["corpus_ppl"]
    assert ppl["mean"] == pytest.approx(math.sqrt(711.1 * 596.0))  # the geometric mean
    assert (ppl["low"], ppl["high"]) == pytest.approx((math.exp(low), math.exp(high)))
    assert ppl["low"] > 0 and row["corpus_loss"]["low"] == pytest.approx(low)
    with pytest.raises(ValueError, match="positive"):
        stats.log_interval([3.0, 0.0])


def test_the_summary_names_the_precisions_each_arm_trained_in(tmp_path):
    """Under trainer.precision: auto the machine decides; an arm whose seeds (or starts) trained
    in different precisions says so in its row."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed, precisions in ((0, ["bf16-mixed"]), (1, ["bf16-mixed", "32-true"]), (2, [None])):
        record = _record(Arm("mla", 24, seed=seed), 1.0 + seed / 10)
        record["starts"] = [{"precision": p} for p in precisions]
        (runs / f"{record['name']}.json").write_text(json.dumps(record))
    summary = write_summary(tmp_path, lambda m: None)
    row = next(r for r in summary["arms"] if r["arm"] == "mla-dc24" and r["step"] == 244)
    assert row["precision"] == ["32-true", "bf16-mixed", "unrecorded"]
    assert "| 32-true, bf16-mixed, unrecorded |" in (tmp_path / "summary.md").read_text()


def test_the_runs_of_a_seed_train_in_one_precision(tmp_path):
    """--precision seed (the default): a started run keeps its first start's precision, a new
    run takes its seed's, and a run that needs bf16 waits on a CPU without native bf16; the
    other policies say what every run trains in."""
    from studies.upcycling.runs import run_precision

    runs_dir, results = tmp_path / "runs", tmp_path / "results"
    (results / "runs").mkdir(parents=True)

    def started(arm, precision, where="record"):
        if where == "record":
            (results / "runs" / f"{arm.name}.json").write_text(json.dumps(
                {**_record(arm, 1.0), "starts": [{"precision": precision}]}))
        else:  # a run in progress: only its run directory knows
            (runs_dir / arm.name).mkdir(parents=True)
            (runs_dir / arm.name / "run_info.json").write_text(json.dumps(
                {"starts": [{"precision": precision}, {"precision": "32-true"}]}))

    kv1, latent1, kv2, mla2 = (Arm("egmla", 24, "kv", seed=1), Arm("egmla", 24, "latent", seed=1),
                               Arm("egmla", 24, "kv", seed=2), Arm("mla", 24, seed=2))
    assert run_precision(kv1, "seed", runs_dir, results, native_bf16=False) == "auto"  # none yet
    started(Arm("mla", 24, seed=1), "bf16-mixed")
    assert run_precision(kv1, "seed", runs_dir, results, native_bf16=True) == "bf16-mixed"
    assert run_precision(kv1, "seed", runs_dir, results, native_bf16=False) is None  # waits
    assert run_precision(kv2, "seed", runs_dir, results, native_bf16=False) == "auto"  # seed 2
    started(mla2, "32-true", where="run directory")
    assert run_precision(kv2, "seed", runs_dir, results, native_bf16=True) == "32-true"
    started(latent1, "32-true", where="run directory")  # its own first start decides
    assert run_precision(latent1, "seed", runs_dir, results, native_bf16=True) == "32-true"
    assert run_precision(kv1, "machine", runs_dir, results, native_bf16=False) == "auto"
    assert run_precision(kv1, "32-true", runs_dir, results, native_bf16=True) == "32-true"


def test_a_seed_whose_two_runs_trained_in_different_precisions_is_not_paired(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed in (0, 1, 2):
        for arm, kl in ((Arm("mla", 24, seed=seed), 1.0), (Arm("egmla", 24, "kv", seed=seed),
                                                            0.9 + seed / 100)):
            record = _record(arm, kl)
            mixed = seed == 1 and arm.to == "egmla"
            record["starts"] = [{"precision": "32-true" if mixed else "bf16-mixed"}]
            (runs / f"{arm.name}.json").write_text(json.dumps(record))
    summary = write_summary(tmp_path, lambda m: None)
    row = next(c for c in summary["comparisons"] if c["arm"] == "egmla-kv-dc24"
               and (c["domain"], c["metric"]) == ("corpus", "kl"))
    assert row["seeds"] == [0, 2] and row["left_out_mixed_precision"] == [1]
    assert row["mean"] == pytest.approx(-0.09)  # seeds 0 and 2 only: -0.10, -0.08
    assert "| 2 (seed 1 left out: trained in two precisions) |" in (
        tmp_path / "summary.md").read_text()


def test_a_run_that_must_wait_for_bf16_is_named_and_nothing_is_converted(tmp_path, monkeypatch,
                                                                         capsys):
    import egmla.devices
    from studies.upcycling.runs import main

    monkeypatch.setattr(egmla.devices, "native_bf16", lambda: False)
    results, runs_dir = tmp_path / "results", tmp_path / "runs"
    (results / "runs").mkdir(parents=True)
    mla = Arm("mla", 24, seed=1)
    (results / "runs" / f"{mla.name}.json").write_text(json.dumps(
        {**_record(mla, 1.0), "complete": True, "starts": [{"precision": "bf16-mixed"}]}))
    assert main(["--phases", "train", "--arms", "mla-dc24-s1", "egmla-kv-dc24-s1",
                 "--results", str(results), "--runs-dir", str(runs_dir)]) == 0
    out = capsys.readouterr().out
    assert "waiting for a CPU with native bf16" in out and "egmla-kv-dc24-s1" in out
    assert "mla-dc24-s1 " not in out.split("native bf16")[-1]  # complete: not waiting
    assert not (runs_dir / "egmla-kv-dc24-s1").exists()


def test_a_corrupt_record_is_named_and_left_as_it_is(tmp_path, capsys):
    """A record that cannot be read is not taken for a missing one (which would train the arm
    again and write over it): the pipeline stops naming the file, which stays as it was."""
    from studies.upcycling.runs import main

    results, runs_dir = tmp_path / "results", tmp_path / "runs"
    (results / "runs").mkdir(parents=True)
    broken = results / "runs" / "mla-dc24-s0.json"
    for text in ('{"name": "mla-dc24-s0", "complete": tr', "[1, 2]"):
        broken.write_text(text)
        for phases in (["train"], ["summary"]):
            assert main(["--phases", *phases, "--arms", "mla-dc24-s0", "--results", str(results),
                         "--runs-dir", str(runs_dir)]) == 1
            err = capsys.readouterr().err
            assert f"{broken}: " in err and "repair or delete it" in err and "Traceback" not in err
            assert broken.read_text() == text and not runs_dir.exists()


def test_the_lm_eval_limit_is_a_positive_count(capsys):
    from studies.upcycling.runs import main

    for bad in ("0", "-5", "ten"):
        with pytest.raises(SystemExit) as exit_:
            main(["--lm-eval-limit", bad])
        assert exit_.value.code == 2 and "--lm-eval-limit" in capsys.readouterr().err


def test_the_summary_tables_the_context_curves_and_lm_eval_scores(tmp_path):
    (tmp_path / "runs").mkdir()
    arm = Arm("mla", 24, seed=2)
    (tmp_path / "runs" / f"{arm.name}.json").write_text(json.dumps(
        {**_record(arm, 1.0), "starts": [{"precision": "32-true"}]}))
    (tmp_path / "context.json").write_text(json.dumps({"curves": {
        "original@0": [{"from": 0, "to": 512, "ppl": 12.34}, {"from": 512, "to": 4096, "ppl": 9.5}],
        f"{arm.name}@244": [{"from": 0, "to": 512, "ppl": 20.0}]}}))
    (tmp_path / "lm_eval.json").write_text(json.dumps({"limit": None, "scores": {
        f"{arm.name}@244": {"cloze/acc": 0.4321, "cloze/acc_stderr": 0.0123, "ppl/word": 55.5},
        "original@0": {"cloze/acc": 0.5}}}))
    write_summary(tmp_path, lambda m: None)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert "| run | step | precision | 0-512 | 512-4,096 |" in lines
    assert "| original | 0 | - | 12.3 | 9.5 |" in lines
    assert f"| {arm.name} | 244 | 32-true | 20.0 | - |" in lines
    assert "| run | step | precision | cloze/acc | ppl/word |" in lines
    assert f"| {arm.name} | 244 | 32-true | 0.432 ± 0.012 | 55.500 |" in lines
    assert "| original | 0 | - | 0.500 | - |" in lines


def test_the_summary_states_the_gate_rows_trained_per_table():
    summary = {"arms": [], "comparisons": [], "precision": {}, "gate_rows": {
        "egmla-kv-dc24-s0": {"rows_changed_per_table_min_max": [16155, 16155], "rows_per_table": 49152,
                             "tables": 15},
        "egmla-latent-dc24-s0": {"rows_changed_per_table_min_max": [900, 1200], "rows_per_table": 49152,
                                 "tables": 15}}}
    lines = markdown(summary).splitlines()
    assert "- egmla-kv-dc24-s0: 16,155 of 49,152 rows changed in each of its 15 tables" in lines
    assert "- egmla-latent-dc24-s0: 900 to 1,200 of 49,152 rows changed in each of its 15 tables" in lines
