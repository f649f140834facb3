"""Training for real: Lightning fast_dev_run per variant, resume after a crash, two processes
against one, the submitit launcher, and bad input that must not crash or overwrite."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from egmla.training.config import TrainConfig
from egmla.training.data import build_datamodule
from egmla.training.module import LanguageModel, lr_lambda, warmup_note
from egmla.training.run import train
from support.training import TINY, compose_config, run_train


@pytest.fixture(scope="module", autouse=True)
def egmla_cache(tmp_path_factory):
    """One tokenizer/token cache for the module (and its subprocesses), never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("egmla-cache")
        mp.setenv("EGMLA_CACHE", str(path))
        mp.setenv("WANDB_MODE", "offline")
        yield path


def export_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "export" / "model.safetensors"))


ATTENTIONS = ["small_mha", "small_gqa2", "small_mla", "small_egmla", "small_egmla_latent"]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_fast_dev_run(attention):
    config = TrainConfig.from_dict(compose_config([*TINY, f"model/attention={attention}"]))
    datamodule = build_datamodule(config.data, seed=0, max_steps=1)
    module = LanguageModel(model=config.model_config().to_dict(), optim=vars(config.optim),
                           max_steps=1)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1
    changed = [k for k, v in module.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every parameter (gate tables too) got an update


def fast_dev_run(overrides: list[str]) -> L.Trainer:
    config = TrainConfig.from_dict(compose_config(overrides))
    datamodule = build_datamodule(config.data, seed=0, max_steps=1)
    module = LanguageModel(model=config.model_config().to_dict(), optim=vars(config.optim),
                           max_steps=1)
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, datamodule=datamodule)
    return trainer


def test_local_files_through_datasets(tmp_path):
    """data=hf with local JSONL files: the path a cluster run takes with ClimbMix or FineWeb."""
    lines = [json.dumps({"text": f"Document {i}: " + "the quick brown fox " * (20 + i % 7)})
             for i in range(200)]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    trainer = fast_dev_run([*TINY, "data=hf", "data.tokenizer.kind=bpe", "data.hf.path=json",
                            f"data.hf.data_files={tmp_path / 'train.jsonl'}"])
    assert trainer.global_step == 1 and float(trainer.callback_metrics["val/loss"]) > 0


@pytest.mark.slow
def test_smollm2_tokenizer_run():
    """The real 49,152-token vocabulary: the model's vocabulary follows the tokenizer."""
    trainer = fast_dev_run([*TINY, "data=corpus_smollm2", "data.tokenizer.vocab_size=49152",
                            "data.batch_size=2"])
    assert trainer.lightning_module.model.config.vocab_size == 49152


def test_mqar_fast_dev_run_reports_accuracy_by_slice():
    config = TrainConfig.from_dict(compose_config([
        "experiment=mqar_sweep", "data.mqar.train_examples=256", "data.mqar.val_examples=32",
        "data.batch_size=16", "data.seq_len=64"]))
    datamodule = build_datamodule(config.data, seed=0, max_steps=1)
    datamodule.setup("fit")
    module = LanguageModel(model=config.model_config().to_dict(), optim=vars(config.optim),
                           max_steps=1, val_slices=datamodule.val_slices)
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, datamodule=datamodule)
    logged = trainer.callback_metrics
    assert {f"val/mqar_acc/kv{k}" for k in (4, 8, 16)} <= set(logged)
    assert all(0.0 <= float(logged[f"val/mqar_acc/kv{k}"]) <= 1.0 for k in (4, 8, 16))


def test_lr_schedules():
    from egmla.training.config import OptimConfig

    cos = lr_lambda(OptimConfig(warmup_steps=10, min_lr_ratio=0.1), max_steps=110)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    wsd = lr_lambda(OptimConfig(schedule="wsd", warmup_steps=10, min_lr_ratio=0.0,
                                decay_fraction=0.2), max_steps=100)
    assert wsd(50) == 1.0 and wsd(79) == 1.0 and wsd(90) == pytest.approx(0.5)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_a_run_that_ends_inside_the_warmup_says_so(schedule):
    """The note's share of the peak is the highest rate the optimizer uses, stepped as Lightning
    steps the module's scheduler (once per optimizer step); a run as long as its warmup or
    longer reaches the peak and says nothing."""
    from egmla.training.config import OptimConfig

    optim = OptimConfig(lr=2e-3, warmup_steps=50, schedule=schedule)
    assert warmup_note(optim, 5) == (
        "note: trainer.max_steps=5 ends inside the warmup (optim.warmup_steps=50): the learning "
        "rate never reaches its peak, it rises to 10% of optim.lr=0.002 at the last step")
    for max_steps, share in ((1, "2%"), (49, "98%")):
        assert f"rises to {share} of" in warmup_note(optim, max_steps)
    assert warmup_note(optim, 50) is None and warmup_note(optim, 51) is None
    assert warmup_note(OptimConfig(warmup_steps=0), 1) is None

    for max_steps in (5, 50):
        weight = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.AdamW([weight], lr=optim.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, max_steps))
        used = []
        for _ in range(max_steps):
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert max(used) == pytest.approx(optim.lr * (0.1 if max_steps == 5 else 1.0))


def test_no_weight_decay_on_norms_biases_embeddings():
    from egmla.models import Transformer
    from egmla.presets import preset
    from egmla.training.module import param_groups

    model = Transformer(preset("tiny-egmla"))
    decay, no_decay = param_groups(model, 0.1)
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.tok_emb.weight) in no_decay_ids
    assert id(model.layers[0].attn.gate_table.weight) in no_decay_ids
    assert id(model.layers[0].attn_norm.weight) in no_decay_ids
    assert id(model.layers[0].attn.wkv_b.weight) not in no_decay_ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


class SimulatedCrash(RuntimeError):
    pass


class CrashAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise SimulatedCrash(f"crash at step {self.step}")


class BarProbe(L.Callback):
    """What the progress bar shows at every step: (description, position, total)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int | None]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        bar = trainer.progress_bar_callback.train_progress_bar
        self.seen.append((bar.desc, bar.n, bar.total))


def test_the_training_clock_adds_the_checkpoints_seconds_to_this_starts():
    """FitClock: a fresh run's time is its one start's; a resumed one adds what its checkpoint
    carried; resumed from a checkpoint without the clock (or whose clock did not know), unknown.
    The real resume: test_resume_after_crash_equals_uninterrupted."""
    from egmla.training.callbacks import FitClock

    assert FitClock().total(3.0) == 3.0 and FitClock().state_dict() == {"seconds": 0.0}
    resumed = FitClock(resumed=True)
    assert resumed.total(3.0) is None and resumed.state_dict() == {"seconds": None}
    resumed.load_state_dict({"seconds": 5.0})
    assert resumed.total(3.0) == 8.0
    resumed.load_state_dict({"seconds": None})
    assert resumed.total(3.0) is None


@pytest.mark.parametrize("all_starts, took", [(8.0, "8.0 s over all starts (3.0 s this start)"),
                                              (3.0, "3.0 s"), (None, "3.0 s")])
def test_the_final_line_gives_the_time_over_all_starts(capsys, all_starts, took):
    from egmla.training.report import print_summary

    print_summary({"name": "r", "global_step": 6, "fit_seconds": 3.0, "run_dir": "runs/r",
                   "fit_seconds_all_starts": all_starts, "val_loss": 4.0}, None)
    assert capsys.readouterr().out.splitlines()[1] == f"run r: 6 steps in {took} -> runs/r"


@pytest.mark.slow
def test_resume_after_crash_equals_uninterrupted(tmp_path):
    overrides = [*TINY, "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=6",
                 "trainer.val_every_n_steps=6", "trainer.deterministic=true"]
    full = train(compose_config(overrides), tmp_path / "full")

    resumed_dir = tmp_path / "resumed"
    with pytest.raises(SimulatedCrash):
        train(compose_config(overrides), resumed_dir, extra_callbacks=(CrashAtStep(8),))
    last = torch.load(resumed_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 6  # steps 7-8 are lost, nothing more
    assert not (resumed_dir / "export").exists()
    probe = BarProbe()
    resumed = train(compose_config(overrides), resumed_dir, extra_callbacks=(probe,))
    # the bar of the resumed start: the epoch, the steps so far and the total (an ETA)
    assert probe.seen[0][0].startswith("Epoch 0") and probe.seen[0][2] == 12
    assert probe.seen[0][1] >= 6 and probe.seen[-1][1] == 12

    assert resumed["global_step"] == full["global_step"] == 12
    # the training time over both starts: the first start's up to its last save, which the
    # checkpoint carried, plus the second's; one start's alone for the uninterrupted run
    carried = last["callbacks"]["FitClock"]["seconds"]
    assert 0 < carried < resumed["fit_seconds_all_starts"]
    assert resumed["fit_seconds_all_starts"] == pytest.approx(carried + resumed["fit_seconds"],
                                                             abs=0.11)
    assert full["fit_seconds_all_starts"] == pytest.approx(full["fit_seconds"], abs=0.11)
    a, b = export_weights(tmp_path / "full"), export_weights(resumed_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["val_loss"] == full["val_loss"]
    info = json.loads((resumed_dir / "run_info.json").read_text())
    assert len(info["starts"]) == 2 and info["starts"][1]["resumed_from"].endswith("last.ckpt")
    with (resumed_dir / "metrics.csv").open() as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert min(steps) <= 1 and max(steps) >= 11  # the first start's rows survived the resume
    assert info["starts"][0]["git"]["sha"] and info["starts"][0]["versions"]["torch"]


@pytest.mark.slow
def test_run_directory_contents(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train([*TINY, "trainer.max_steps=4", "trainer.val_every_n_steps=2",
                        "trainer.checkpoint_every_n_steps=2", "wandb.mode=offline",
                        "sample_prompt=ROMEO:", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.json", "run_info.json", "metrics.csv", "summary.json",
                 "checkpoints/last.ckpt", "export/config.json", "export/model.safetensors",
                 "export/tokenizer.json"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "checkpoints").glob("best-step*.ckpt"))
    assert list(run_dir.glob(".hydra/*/config.yaml"))  # Hydra's composed config, per start
    assert list((run_dir / "wandb").glob("offline-run-*"))
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    for metric in ("train/loss", "train/ppl", "train/grad_norm", "train/tokens_per_s",
                   "val/loss", "val/ppl", "lr-AdamW/decay"):
        assert metric in header, metric
    assert "export:" in result.stdout and "sample:" in result.stdout and "ROMEO:" in result.stdout
    # The export loads without Lightning or Hydra.
    code = ("import sys\nfor m in ('lightning', 'hydra', 'omegaconf'): sys.modules[m] = None\n"
            "from egmla.checkpoint import load_export\n"
            f"print(load_export({str(run_dir / 'export')!r}).num_params())")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and int(out.stdout) > 0, out.stderr


@pytest.mark.slow
def test_rerunning_a_finished_run_with_export_writes_the_export(tmp_path):
    """Resumed after its last step, a run trains nothing; it must still write its export."""
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    first = run_train([*args, "export=false"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (run_dir / "export").exists()
    again = run_train([*args, "export=true"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 2 and summary["export"] == str(run_dir / "export")


@pytest.mark.slow
def test_two_processes_match_one_process_at_twice_the_batch(tmp_path):
    # Adam's eps at 1e-5, not 1e-8: see below
    common = [*TINY, "trainer.max_steps=6", "trainer.val_every_n_steps=6",
              "trainer.checkpoint_every_n_steps=6", "optim.lr=3e-3", "optim.eps=1e-5"]
    single = run_train([*common, "data.batch_size=8", f"hydra.run.dir={tmp_path / 'one'}"])
    assert single.returncode == 0, single.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    double = run_train([*common, "trainer=ddp_cpu", "data.batch_size=4",
                        f"hydra.run.dir={tmp_path / 'two'}"], launcher=torchrun)
    assert double.returncode == 0, double.stderr[-3000:]
    a, b = export_weights(tmp_path / "one"), export_weights(tmp_path / "two")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    # One process and two sum the gradients in a different float32 order (gloo's all-reduce
    # averages). Where a gradient is a sum of contributions that nearly cancel (a gate-table row
    # of a token seen twice), its rounding error is large relative to it, and Adam, dividing by
    # sqrt(v) + eps, scales any gradient near eps up to a step of about lr: with eps 1e-8 that
    # moved a gate-table weight by 8e-5 after 6 steps (2e-5 on an earlier data order), so the
    # check depended on luck. With eps 1e-5 such gradients stay small and the worst difference is
    # about 3e-7. A real DDP bug (a missing all-reduce, a wrong batch split) moves weights with
    # ordinary gradients, far above eps, by about lr = 3e-3 a step.
    assert worst < 1e-5, worst


@pytest.mark.slow
def test_submitit_local_sweep_writes_two_runs(tmp_path):
    sweep = tmp_path / "sweep"
    try:
        result = run_train(["-m", "cluster=submitit_local", *TINY, "trainer.max_steps=2",
                            "trainer.val_every_n_steps=2", "seed=0,1", f"hydra.sweep.dir={sweep}"])
    except subprocess.TimeoutExpired:  # what each job had written by then
        logs = sorted((sweep / ".submitit").glob("*/*_log.*"))
        pytest.fail("the sweep did not finish; its jobs' logs:\n" + "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs))
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    seeds = {json.loads((s.parent / "config.json").read_text())["seed"] for s in summaries}
    assert seeds == {0, 1}
    # side by side on this machine, each job keeps to its cpus_per_task (1): no oversubscription
    for summary in summaries:
        (start,) = json.loads((summary.parent / "run_info.json").read_text())["starts"]
        assert start["hardware"]["torch_threads"] == 1


@pytest.mark.slow
def test_a_sweep_logs_each_job_to_its_own_wandb_run_grouped_by_the_sweep(tmp_path):
    """Hydra's basic launcher runs a -m sweep's jobs in one process; each must still get its own
    wandb run (offline here), named from its overrides, with its own config, in one group."""
    sweep = tmp_path / "sweep"
    args = [a for a in TINY if not a.startswith("wandb.mode=")]
    result = run_train(["-m", *args, "trainer.max_steps=2", "trainer.val_every_n_steps=2",
                        "trainer.final_val_batches=1", "export=false", "wandb.mode=offline",
                        "seed=0,1", f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reuse this run" not in result.stdout + result.stderr
    for seed, job in enumerate(("0", "1")):
        (run,) = (sweep / job / "wandb").glob("offline-run-*")  # one run per job, in its directory
        run_id = run.name.rsplit("-", 1)[-1]
        assert (sweep / job / "wandb_id").read_text().strip() == run_id
        config = logged_config(run / f"run-{run_id}.wandb")
        assert config["seed"] == seed  # its own config, not the other job's
        assert config["wandb"]["group"] == "sweep"  # grouped by the sweep directory's name
        assert config["wandb"]["name"] == f"default[seed={seed}]"  # named from what the sweep varies


def logged_config(record_file: Path) -> dict:
    """The training config a wandb offline run recorded. The run file is wandb's own binary log of
    protobuf records (no Python reader ships with wandb 0.31); the config rides in it as the
    JSON text of the logged `config` value, so it is found by its first key and decoded."""
    text = record_file.read_bytes().decode("latin-1")
    start = text.index('{"name":')
    config, _ = json.JSONDecoder().raw_decode(text, start)
    return config


# ---- bad input: a clear message, a non-zero exit, no traceback, nothing overwritten -------


def assert_clean_failure(result, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needles",
    [
        (["model/attention=gqa"], ["gqa", "small_mha"]),  # Hydra lists the options
        (["model.attention.type=gqa"], ["'gqa'"]),
        (["+trainer.max_step=3"], ["'max_step'"]),
        (["data=hf", "data.tokenizer.kind=bpe", "data.hf.path=json",
          "data.hf.data_files=/nonexistent/train.jsonl"],
         ["/nonexistent/train.jsonl"]),
    ],
)
def test_bad_input_fails_cleanly(tmp_path, args, needles):
    result = run_train([*TINY, *args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert_clean_failure(result, *needles)


@pytest.mark.parametrize("args, key", [
    (["trainer.max_step=3"], "trainer: unknown key 'max_step'; allowed keys: "),
    (["model.attention.dc=16"], "unknown key 'dc'; allowed keys: "),
    (["-m", "optim.lrr=1e-3,3e-3"], "optim: unknown key 'lrr'; allowed keys: "),
])
def test_a_misspelled_plain_override_is_the_projects_one_line(tmp_path, args, key):
    """Without `+` Hydra refuses the key itself, hinting at `+` (which would not help: the typed
    config refuses the key); train.py answers as for `+key=...`: one line, exit 2."""
    result = run_train([*TINY, *args, f"hydra.run.dir={tmp_path / 'run'}",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "To append" not in result.stderr, lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_resuming_with_another_model_or_tokenizer_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train([*TINY, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    for change, needle in (("model.d_model=128", "different model.d_model (64 there, 128 now)"),
                           ("data.tokenizer.vocab_size=600", "different data.tokenizer.vocab_size")):
        result = run_train([*TINY, "trainer.max_steps=4", change, f"hydra.run.dir={run_dir}"])
        assert_clean_failure(result, needle)
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p in before}
    assert after == before
