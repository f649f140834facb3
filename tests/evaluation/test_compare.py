"""python -m eval.compare on real runs: three tiny train.py runs (MHA, MLA, EG-MLA kv), one of
them scored for real by `python -m eval.lm_eval` on a local task; outputs checked against the
runs' own files, wandb offline, bad input, and the notebook executed."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.image
import nbformat
import pytest
from nbclient import NotebookClient

from egmla.config import ModelConfig
from eval import compare
from support.tasks import write_local_task
from support.training import ROOT, TINY, run_train

# run name -> (model/attention option, seed, the variant eval.compare must name it)
RUNS = {"mha": ("small_mha", 0, "mha"), "mla": ("small_mla", 1, "mla"),
        "egmla": ("small_egmla", 0, "egmla-kv")}
# Cheap runs: the final validation covers the whole held-out split, so keep it small (0.5% of the
# corpus) and take it in large batches.
STEPS, BATCH, HELD_OUT = 2, 128, 0.005


def train_args(parent: Path, name: str) -> list[str]:
    attention, seed, _ = RUNS[name]
    return [*TINY, f"data.batch_size={BATCH}", f"data.val_fraction={HELD_OUT}",
            f"trainer.max_steps={STEPS}", f"model/attention={attention}", f"seed={seed}",
            f"name={name}", f"hydra.run.dir={parent / name}"]


def lm_eval_capitals(run_dir: Path, tasks: Path) -> subprocess.CompletedProcess:
    """The real lm-eval command on the run's export, results saved in the run's eval/."""
    return subprocess.run(
        [sys.executable, "-m", "eval.lm_eval", "--model", "egmla", "--model_args",
         f"pretrained={run_dir / 'export'}", "--tasks", "capitals", "--include_path", str(tasks),
         "--output_path", str(run_dir / "eval")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A parent directory holding three finished runs; mha also has real lm-eval results."""
    parent = tmp_path_factory.mktemp("runs")
    tasks = tmp_path_factory.mktemp("tasks") / "local"
    write_local_task(tasks)  # a plain multiple-choice YAML + JSONL, the adapter tests' own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EGMLA_CACHE", str(tmp_path_factory.mktemp("egmla-cache")))
        first = run_train(train_args(parent, "mha"))  # trains the tokenizer the others reuse
        assert first.returncode == 0, first.stderr[-3000:]
        with ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(run_train, train_args(parent, n)) for n in ("mla", "egmla")]
            jobs.append(pool.submit(lm_eval_capitals, parent / "mha", tasks))
            for job in jobs:
                result = job.result()
                assert result.returncode == 0, result.stderr[-3000:]
    return parent


def run_compare(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m eval.compare ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "eval.compare", *args], cwd=cwd,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=180,
                          check=False)


def read_csv(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def run_json(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / name).read_text())


@pytest.mark.slow
def test_command_writes_table_csv_plot_and_json(runs, tmp_path):
    out, wandb_dir = tmp_path / "cmp", tmp_path / "wandb"
    done = run_compare(str(runs), "--out", str(out), cwd=tmp_path, WANDB_DIR=str(wandb_dir))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "comparison.csv", "comparison.json", "comparison.md", "comparison.png"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
    assert not wandb_dir.exists()  # no wandb without --wandb-project

    rows = read_csv(out / "comparison.csv")
    assert sorted(rows) == sorted(RUNS)
    for name, (_, seed, variant) in RUNS.items():
        row, run_dir = rows[name], runs / name
        summary, info = run_json(run_dir, "summary.json"), run_json(run_dir, "run_info.json")
        assert row["variant"] == variant and int(row["seed"]) == seed
        assert float(row["val_loss"]) == summary["val_loss"]
        assert row["metric"] == "val_loss" and float(row["metric_value"]) == summary["val_loss"]
        assert int(row["kv_bytes_per_token"]) == info["kv_bytes_per_token_bf16"]
        assert int(row["kv_elements_per_token"]) == info["kv_elements_per_token"]
        assert int(row["params"]) == info["params"]
        assert int(row["params_without_gate_tables"]) == info["params_without_gate_tables"]
        assert int(row["steps"]) == STEPS and int(row["tokens"]) == STEPS * BATCH * 32
    # The real lm-eval results of the mha run, read from the file lm-eval wrote.
    (results,) = (runs / "mha" / "eval").rglob("results_*.json")
    capitals = json.loads(results.read_text())["results"]["capitals"]
    assert float(rows["mha"]["capitals/acc"]) == capitals["acc,none"]
    assert float(rows["mha"]["capitals/acc_stderr"]) == capitals["acc_stderr,none"]
    assert rows["mla"]["capitals/acc"] == rows["egmla"]["capitals/acc"] == ""

    report = json.loads((out / "comparison.json").read_text())
    assert [r["run"] for r in report["rows"]] == sorted(RUNS)  # subdirectories, sorted
    assert report["provenance"]["command"][3:] == [str(runs), "--out", str(out)]
    assert report["provenance"]["git"]["sha"] and report["kv_dtype"] == "bf16"
    md = (out / "comparison.md").read_text()
    assert report["provenance"]["git"]["sha"] in md and f"`python -m eval.compare {runs}" in md
    # two tables: the groups (three arms of one seed each), then the runs
    assert sum(line.startswith("| ") for line in md.splitlines()) == 2 * (2 + len(RUNS))
    image = matplotlib.image.imread(out / "comparison.png")
    assert image.shape == (600, 960, 4) and image[..., :3].std() > 0.05  # 8x5 in at 120 dpi


def test_kv_bytes_follow_the_dtype(runs):
    """fp32 doubles and fp8 halves the K/V fields; EG-MLA kv's int32 token ids and its float32
    norm statistics (mean and 1/sigma per layer) do not change."""
    by = {d: {r["run"]: r["kv_bytes_per_token"] for r in compare.load_rows([runs], d)}
          for d in ("bf16", "fp32", "fp8")}
    for name in ("mha", "mla"):
        assert by["fp32"][name] == 2 * by["bf16"][name] == 4 * by["fp8"][name]
    layers = run_json(runs / "egmla", "config.json")["model"]["n_layers"]
    fixed = 4 + layers * 2 * 4  # one int32 id per token; (mu, 1/sigma) per layer in float32
    egmla = {d: by[d]["egmla"] - fixed for d in by}
    assert egmla["fp32"] == 2 * egmla["bf16"] == 4 * egmla["fp8"]
    # A run given on its own and inside its parent is one row.
    assert len(compare.load_rows([runs, runs / "mha"])) == len(RUNS)


def write_results(run_dir: Path, stamp: str, results: dict) -> None:
    """A results file where `lm_eval --output_path RUN_DIR/eval` puts it."""
    path = run_dir / "eval" / "runs__egmla__export" / f"results_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": results, "config": {"model": "egmla"}}))


def test_metric_from_lm_eval_results(runs, tmp_path, capsys):
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy, ignore=shutil.ignore_patterns("export", "checkpoints", "eval"))
    ppl = {"alias": "corpus_perplexity", "word_perplexity,none": 812.5,
           "word_perplexity_stderr,none": "N/A", "bits_per_byte,none": 2.25}
    write_results(copy / "egmla", "2026-01-01T10-00-00.000001", {"corpus_perplexity": ppl})
    write_results(copy / "egmla", "2026-01-02T09-00-00.000001", {  # newer: wins for its task
        "corpus_perplexity": {**ppl, "word_perplexity,none": 640.25},
        "gsm8k_offline": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": 0.05}})
    write_results(copy / "mla", "2026-01-01T10-00-00.000001", {"corpus_perplexity": ppl})

    out = tmp_path / "out"
    assert compare.main([str(copy), "--out", str(out),
                         "--metric", "corpus_perplexity/word_perplexity,none"]) == 0
    rows = read_csv(out / "comparison.csv")
    assert {n: rows[n]["metric_value"] for n in rows} == {"egmla": "640.25", "mla": "812.5", "mha": ""}
    assert rows["egmla"]["corpus_perplexity/bits_per_byte"] == "2.25"
    assert rows["egmla"]["gsm8k_offline/exact_match,strict-match"] == "0.125"
    assert "corpus_perplexity/word_perplexity_stderr" not in rows["egmla"]  # "N/A" is no number
    md = (out / "comparison.md").read_text()
    assert "No value for corpus_perplexity/word_perplexity, not plotted: mha." in md
    assert "| 0.1250 ± 0.0500 |" in md

    plain = compare.select_metric(compare.load_rows([copy]), "corpus_perplexity/word_perplexity")
    assert [r["metric_value"] for r in plain] == [640.25, None, 812.5]  # ",none" is optional

    assert compare.main([str(copy), "--out", str(out), "--metric",
                         "gsm8k_offline/exact_match,strict-match"]) == 0
    assert read_csv(out / "comparison.csv")["egmla"]["metric_value"] == "0.125"
    capsys.readouterr()


@pytest.mark.slow
def test_wandb_offline_run_holds_the_table(runs, tmp_path):
    done = run_compare(str(runs), "--out", str(tmp_path / "out"), "--wandb-project", "egmla-test",
                       cwd=tmp_path, WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"))
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("run-*.wandb"))
    (table_file,) = (run_dir / "files" / "media" / "table").glob("comparison_*.table.json")
    table = json.loads(table_file.read_text())
    with (tmp_path / "out" / "comparison.csv").open() as f:
        assert table["columns"] == next(csv.reader(f))
    names = [row[table["columns"].index("run")] for row in table["data"]]
    assert names == sorted(RUNS)
    assert list((run_dir / "files" / "media" / "images").glob("comparison_plot_*.png"))


def bad_inputs(runs: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """case -> (arguments, a piece of the one error line)."""
    (tmp / "empty" / "notes").mkdir(parents=True)
    for case, missing in (("no_summary", "summary.json"), ("no_config", "config.json")):
        shutil.copytree(runs / "mha", tmp / case, ignore=shutil.ignore_patterns(
            missing, "export", "checkpoints", "eval"))
    return {
        "missing path": ([str(tmp / "nowhere")], "no such path"),
        "no run inside": ([str(tmp / "empty")], "no run directory in it"),
        "no summary.json": ([str(tmp / "no_summary")], "missing summary.json"),
        "no config.json": ([str(runs), str(tmp / "no_config")], "missing config.json"),
        "unknown metric": ([str(runs), "--metric", "capitals/f1"],
                           "'capitals/f1' is in no run; available: val_loss, capitals/acc"),
        "unknown dtype": ([str(runs), "--dtype", "int4"], "unknown dtype 'int4'"),
        "no path at all": ([], "required: RUN_DIR"),
    }


CASES = ["missing path", "no run inside", "no summary.json", "no config.json", "unknown metric",
         "unknown dtype", "no path at all"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, capsys, case):
    args, named = bad_inputs(runs, tmp_path)[case]
    out = tmp_path / "out"
    assert compare.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err, err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def seeded_copies(runs: Path, parent: Path, losses: list[float]) -> Path:
    """Copies of the real mha run as seeds 0, 1, 2 of one arm (only the seed, the name, the final
    loss and the periodic validations differ), in `parent`."""
    for seed, loss in enumerate(losses):
        run = parent / f"mha-s{seed}"
        shutil.copytree(runs / "mha", run, ignore=shutil.ignore_patterns("eval", "checkpoints"))
        config = run_json(run, "config.json")
        (run / "config.json").write_text(json.dumps({**config, "seed": seed, "name": run.name}))
        summary = run_json(run, "summary.json")
        (run / "summary.json").write_text(json.dumps({**summary, "name": run.name,
                                                      "val_loss": loss}))
        (run / "metrics.csv").write_text(
            # as Lightning logs them: periodic validations at steps 0 and 1 (after one and two
            # optimizer steps), then the final, whole-split one at step 2 (the run's loss)
            f"step,train/loss,val/loss\n0,6.0,{loss + 1}\n1,5.0,\n1,,{loss + 0.1}\n2,,{loss}\n")
    return parent


def test_seeds_of_one_arm_form_a_group_with_a_t_interval(runs, tmp_path):
    parent = seeded_copies(runs, tmp_path / "seeds", [4.0, 4.2, 4.4])
    shutil.copytree(runs / "egmla", parent / "egmla")
    rows = compare.select_metric(compare.load_rows([parent]), "val_loss")
    assert [r["group"] for r in rows] == ["egmla", "mha", "mha", "mha"]
    groups = {g["group"]: g for g in compare.aggregate(rows)}
    mha = groups["mha"]
    half = 4.302652729911275 * 0.2 / 3 ** 0.5  # t(0.975, 2) * sd / sqrt(3)
    assert mha["n"] == 3 and mha["seeds"] == [0, 1, 2] and mha["mean"] == pytest.approx(4.2)
    assert (mha["low"], mha["high"]) == (pytest.approx(4.2 - half), pytest.approx(4.2 + half))
    assert groups["egmla"]["n"] == 1 and groups["egmla"]["low"] is None
    (curve,) = [c for c in compare.curves(rows) if c["group"] == "mha"]
    per_step = STEPS * BATCH * 32 / STEPS
    assert curve["tokens"] == [per_step, 2 * per_step]
    assert [p["mean"] for p in curve["points"]] == [pytest.approx(5.2), pytest.approx(4.3)]


def sweep_copies(runs: Path, sweep: Path, lrs: list[float]) -> Path:
    """The real mha run as the jobs of `train.py -m name=mha optim.lr=...`, laid out as Hydra's
    multirun puts them (configs/train.yaml: runs/<name>-multirun/<job number>/, multirun.yaml
    beside them): each job's config.json differs in optim.lr and in the wandb name and group that
    train.py gives a sweep's jobs. The runs keep their export/ (its own config.json) and .hydra/."""
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    for job, lr in enumerate(lrs):
        run = sweep / str(job)
        shutil.copytree(runs / "mha", run, ignore=shutil.ignore_patterns("eval", "checkpoints"))
        config = run_json(run, "config.json")
        wandb = {**config["wandb"], "group": sweep.name, "name": f"mha[optim.lr={lr}]"}
        (run / "config.json").write_text(json.dumps(
            {**config, "optim": {**config["optim"], "lr": lr}, "wandb": wandb}, indent=2))
    return sweep


def test_a_sweep_is_found_at_any_depth_and_its_rows_show_the_keys_that_differ(runs, tmp_path,
                                                                               capsys):
    parent = tmp_path / "runs"
    lrs = [round(1e-3 * (job + 1), 4) for job in range(11)]
    sweep = sweep_copies(runs, parent / "mha-multirun", lrs)
    shutil.copytree(runs / "mla", parent / "mla", ignore=shutil.ignore_patterns("checkpoints"))

    found = compare.find_runs([parent])  # two levels down; never into a run's export/ or .hydra/
    assert found == [*(sweep / str(job) for job in range(11)), parent / "mla"]  # 0, 1, ..., 10

    rows = compare.load_rows([sweep])
    assert [r["run"] for r in rows] == [f"mha/{job}" for job in range(11)]  # one name, 11 jobs
    assert [r["differs"] for r in rows] == [f"optim.lr={lr}" for lr in lrs]  # nothing equal
    assert len({r["group"] for r in rows}) == len(lrs)  # an arm per learning rate

    out = tmp_path / "out"
    assert compare.main([str(parent), "--out", str(out)]) == 0
    capsys.readouterr()
    table = read_csv(out / "comparison.csv")
    assert table["mha/10"]["differs"].startswith("model.attention.type=mha, ")
    assert table["mha/10"]["differs"].endswith(", optim.lr=0.011")
    assert table["mla"]["differs"].startswith("model.attention.type=mla, ")
    assert "optim.lr=0.001" in table["mla"]["differs"]  # the mla run's own rate, 1e-3
    assert not any(k in table["mla"]["differs"] for k in ("seed=", "name=", "wandb."))
    md = (out / "comparison.md").read_text()
    assert "| run | variant | seed | differs | params (w/o gate tables) |" in md
    assert "| mha/10 | mha | 0 | model.attention.type=mha, " in md

    alone = compare.render_table(compare.load_rows([sweep / "0"]))  # nothing to differ from
    assert "differs" not in alone.splitlines()[0]


@pytest.mark.slow
def test_the_command_on_a_real_sweep_shows_its_learning_rates(tmp_path):
    """`train.py -m` launched in a fresh folder, as its configs lay the jobs out, then
    `python -m eval.compare runs/` there: the table's rows name each job's learning rate. The
    jobs' 2 steps end inside the default warmup (optim.warmup_steps=100): each job says so."""
    short = [a for a in TINY if not a.startswith("optim.warmup_steps=")]
    cache = {**os.environ, "EGMLA_CACHE": str(tmp_path / "cache")}
    sweep = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", *short, f"data.batch_size={BATCH}",
         f"data.val_fraction={HELD_OUT}", f"trainer.max_steps={STEPS}", "name=lrs",
         "optim.lr=1e-3,2e-3"], cwd=tmp_path, env=cache, capture_output=True, text=True,
        timeout=300, check=False)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    note = ("note: trainer.max_steps=2 ends inside the warmup (optim.warmup_steps=100): the "
            "learning rate never reaches its peak, it rises to 2% of optim.lr={} at the last step")
    lines = sweep.stderr.splitlines()
    assert [note.format(lr) in lines for lr in ("0.001", "0.002")] == [True, True]

    done = run_compare("runs/", "--out", "cmp", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| lrs/0 | egmla-kv | 0 | optim.lr=0.001 |" in md
    assert "| lrs/1 | egmla-kv | 0 | optim.lr=0.002 |" in md
    rows = read_csv(tmp_path / "cmp" / "comparison.csv")
    assert {n: r["run_dir"] for n, r in rows.items()} == {
        f"lrs/{job}": str((tmp_path / "runs" / "lrs-multirun" / str(job)).resolve())
        for job in (0, 1)}


def test_other_x_axes_and_curves_from_the_command(runs, tmp_path, capsys):
    """The command's main() in this process (the subprocess path is tested above)."""
    parent = seeded_copies(runs, tmp_path / "seeds", [4.0, 4.2, 4.4])
    shutil.copytree(runs / "egmla", parent / "egmla")
    for x in ("d_e", "params", "tokens"):
        out = tmp_path / f"out-{x}"
        assert compare.main([str(parent), "--out", str(out), "--x", x]) == 0
        report = json.loads((out / "comparison.json").read_text())
        assert report["x"] == x and {g["group"] for g in report["groups"]} == {"mha", "egmla"}
        image = matplotlib.image.imread(out / "comparison.png")
        assert image[..., :3].std() > 0.05
    groups = {g["group"]: g for g in json.loads((tmp_path / "out-d_e" / "comparison.json")
                                                 .read_text())["groups"]}
    assert groups["egmla"]["x"] == 64 and groups["mha"]["x"] is None  # MHA has no gate width
    capsys.readouterr()
    only_mha = compare.main([str(tmp_path / "seeds" / "mha-s0"), "--out", str(tmp_path / "none"),
                             "--x", "d_e"])
    assert only_mha == 2 and "--x d_e: no run has a value" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_labels_of_coincident_points_do_not_collide():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    compare._place_labels(ax, [(5, 5, "mla-dc32"), (5.05, 5.02, "egmla-kv"), (1, 1, "mha")])
    offsets = {a.get_text(): a.xyann for a in ax.texts}
    assert offsets["mla-dc32"] != offsets["egmla-kv"]  # the second moved
    assert offsets["mha"] == (6, 4)  # a lone point keeps its place


def synthetic_rows() -> list[dict]:
    """Two MLA groups (one variant) and an MHA group, two seeds each, with their curves; the
    last curve point is the final, whole-split validation (logged at the last step)."""
    rows = []
    for group, variant, kv, loss in (("mla_dc32", "mla", 136, 4.5), ("mla", "mla", 520, 4.6),
                                     ("mha", "mha", 4096, 4.7)):
        for seed in (0, 1):
            final = loss + 0.01 * seed
            rows.append({"run": f"{group}-s{seed}", "group": group, "variant": variant,
                         "seed": seed, "params": 1000, "kv_dtype": "bf16",
                         "kv_bytes_per_token": kv, "steps": 100, "tokens": 1000,
                         "metric": "val_loss", "metric_value": final,
                         "curve": {"val/loss": {49: final + 1, 99: final, 100: final + 0.3}}})
    return rows


def test_curves_leave_out_the_final_whole_split_validation():
    (curve, *_) = compare.curves(synthetic_rows())
    assert curve["tokens"] == [500, 1000]  # after 50 and 100 steps; not the final one at 100
    assert [p["mean"] for p in curve["points"]] == [pytest.approx(5.505), pytest.approx(4.505)]


def test_groups_of_one_variant_share_its_colour_and_differ_in_marker():
    rows = synthetic_rows()
    styles = compare._styles(compare.aggregate(rows), [r["variant"] for r in rows])
    assert styles["mla_dc32"][0] == styles["mla"][0] != styles["mha"][0]
    assert styles["mla_dc32"][1] != styles["mla"][1]
    fig = compare.plot(rows)
    (ax,) = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["mla_dc32 (n=2)", "mla (n=2)", "mha (n=2)"]  # the groups, not "mla" twice
    assert not ax.texts  # the legend names them; no labels by the points
    one_each = [r for r in rows if r["group"] != "mla"]  # a group per variant: variant legend
    (ax,) = compare.plot(one_each).axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mla", "mha"]
    assert {t.get_text() for t in ax.texts} == {"mla_dc32 (n=2)", "mha (n=2)"}


def test_twelve_variants_each_keep_a_style_of_their_own():
    """The study has twelve arms, each its own variant: past tab10's ten colours, a group must
    still differ from every other in colour or marker (mha and mla_value_embed once shared
    tab10's blue and the same marker)."""
    import matplotlib

    variants = [f"arm{i}" for i in range(12)]
    groups = [{"group": v, "variant": v} for v in variants]
    styles = compare._styles(groups, variants)
    assert len(set(styles.values())) == 12
    tab10 = matplotlib.colormaps["tab10"]
    mha = compare._styles([{"group": "mha", "variant": "mha"}], ["mha"])["mha"]
    assert mha == (tab10(0), "o")  # the first ten variants keep tab10's colours


def test_a_fractions_interval_stays_in_its_range_and_the_seeds_are_drawn():
    """Recall of 0.93 / 0.54 / 0.14 over three seeds: the t-interval runs from -0.45 to 1.52;
    drawn, it is cut at 0 and 1, the axis stays near [0, 1], and each seed has a tick."""
    rows = [{**r, "metric": "mqar_recall/acc", "metric_value": v} for r, v in zip(
        [r for r in synthetic_rows() if r["group"] != "mla"] + [
            {**synthetic_rows()[0], "run": "mla_dc32-s2", "seed": 2}], [0.93, 0.54, 0.1, 0.1, 0.14])]
    (group, _) = compare.aggregate(rows)
    assert group["low"] < -0.4 and group["high"] > 1.5 and group["values"] == [0.93, 0.54, 0.14]
    (ax,) = compare.plot(rows).axes
    low, high = ax.get_ylim()
    assert -0.1 < low < 0 and 1 < high < 1.1
    bars = [c for c in ax.collections if c.__class__.__name__ == "LineCollection"]
    ends = sorted(y for bar in bars for segment in bar.get_segments() for _, y in segment)
    assert ends[0] >= 0 and ends[-1] <= 1
    ticks = [c.get_offsets()[:, 1].tolist() for c in ax.collections
             if c.__class__.__name__ == "PathCollection" and len(c.get_offsets()) > 1]
    assert sorted(map(sorted, ticks)) == [[0.1, 0.1], [0.14, 0.54, 0.93]]
    assert compare.bounds("val_loss") is None  # a loss is not cut


def test_variant_names():
    def named(**attention) -> str:
        return compare.variant(ModelConfig.from_dict(
            {"vocab_size": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "attention": attention}))

    assert named(type="mha") == "mha" and named(type="mha", n_kv_heads=4) == "mha"
    assert named(type="mha", n_kv_heads=2) == "gqa" and named(type="mha", n_kv_heads=1) == "mqa"
    assert named(type="mla", d_c=16) == "mla"
    assert named(type="egmla", d_c=16, gate_position="kv") == "egmla-kv"
    assert named(type="egmla", d_c=16, gate_position="latent") == "egmla-latent"


@pytest.mark.slow
def test_notebook_runs_clean_from_notebooks_dir(runs, monkeypatch):
    path = ROOT / "notebooks" / "compare.ipynb"
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)  # stored clean
    monkeypatch.setenv("EGMLA_RUNS", str(runs))
    NotebookClient(committed, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in committed.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    table = next(o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    assert all(f"| {name} |" in table for name in RUNS)
