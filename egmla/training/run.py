"""One training run: check the config, prepare or resume the run directory, fit, export, report.

Run directory layout (the same path resumes the run):

    config.json        the validated, resolved config (first start; a later start must agree)
    run_info.json      git SHA, package versions, hardware, command: one entry per start
    metrics.csv        every logged metric (appended across resumes)
    checkpoints/       last.ckpt (every trainer.checkpoint_every_n_steps) + best by val/loss,
                       each with a SHA-256 sidecar <name>.sha256 (checkpoints.py)
    wandb/             the wandb run (offline without an API key)
    export/            the plain export: config.json, model.safetensors, tokenizer files
    summary.json       final validation loss, the unigram baseline, where the export is
    train.log          Hydra's job log (train.py): Lightning's log lines, kept off the terminal

A start writes nothing until everything it can check is checked: the run directory, the config
against the run the directory holds, last.ckpt's bytes and contents, the model and its teacher
(rundir.py). A start that fails leaves the directory as it was. A start on a finished run (its
summary.json at trainer.max_steps or past it, and its export if one is asked for) passes the
config checks, then returns that summary and writes nothing: no Trainer, no validation pass.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ModelSummary
from lightning.pytorch.plugins.environments import SLURMEnvironment

from egmla.checkpoint import load_export
from egmla.config import ModelConfig
from egmla.data.tokenizer import tokenizer_fingerprint
from egmla.devices import slow_precision_note, training_precision
from egmla.models import cache_spec_for
from egmla.provenance import provenance
from egmla.training.callbacks import (
    Export, ExportAt, FitClock, ProgressBar, ResumableCSVLogger, Throughput,
)
from egmla.training.checkpoints import (
    ChecksummedCheckpointIO, check_weights_match, sidecar, verify_checkpoint,
)
from egmla.training.config import TrainConfig
from egmla.training.data import build_datamodule
from egmla.training.module import LanguageModel, warmup_note
from egmla.training.rundir import RunError, check_run_dir, write_atomic

# Sections that define what is being trained: a resumed run must not change them.
FROZEN = ("data.kind", "data.tokenizer", "data.hf", "data.mqar", "data.recovery", "data.seq_len",
          "model", "init", "distill", "seed")


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first leaf where two nested dicts differ: (dotted path, value in a, value in b)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    return None if a == b else (path, a, b)


def _is_rank_zero() -> bool:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def _with_defaults(model: Any) -> Any:
    """A model section with every ModelConfig field it does not name set to that field's
    default, so that a run saved before a field existed resumes under the field's default."""
    if not isinstance(model, dict):
        return model
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.default is not dataclasses.MISSING}
    return {**defaults, **model}


def check_resume(run_dir: Path, config: TrainConfig, tokenizer_id: str | None) -> Path | None:
    """Raise RunError if run_dir holds a different run; return last.ckpt if there is one."""
    saved_path = run_dir / "config.json"
    if not saved_path.is_file():
        return None
    saved = json.loads(saved_path.read_text())
    saved["model"] = _with_defaults(saved.get("model"))
    current = {**config.to_dict(), "model": _with_defaults(config.model),
               "tokenizer_fingerprint": tokenizer_id, **_init_model(config)}
    for key in (*FROZEN, "tokenizer_fingerprint", *_init_model(config)):
        difference = _first_difference(_get(saved, key), _get(current, key), key)
        if difference:
            path, there, now = difference
            raise RunError(
                f"{run_dir} holds a run with a different {path} ({there!r} there, {now!r} now); "
                "resume it with its own config, or choose another run directory "
                "(name=... or hydra.run.dir=...)"
            )
    last = run_dir / "checkpoints" / "last.ckpt"
    return last if last.is_file() else None


def finished_summary(run_dir: Path, config: TrainConfig) -> dict[str, Any] | None:
    """The summary of the run that `run_dir` holds if that run is finished: its summary.json
    reads back with a global_step of trainer.max_steps or more, and the export is there if the
    config asks for one (a run finished without it resumes to write it). Its paths name where
    the run directory is now (it may have been moved since); its numbers are as recorded."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = int(summary["global_step"])
    except (OSError, ValueError, KeyError, TypeError):  # none, or damaged: resumed, rewritten
        return None
    export = run_dir / "export"
    if steps < config.trainer.max_steps or (
            config.export and not (export / "model.safetensors").is_file()):
        return None
    return {**summary, "run_dir": str(run_dir),
            "export": str(export) if summary.get("export") else None}


def _init_model(config: TrainConfig) -> dict[str, Any]:
    """A run started from an export records the model it holds, so that resuming with an
    export of another model (a conversion with other options) is refused."""
    return {"init_model": config.model_config().to_dict()} if config.init is not None else {}


def _wandb_logger(config: TrainConfig, run_dir: Path):
    """The wandb logger (or None), and the run id a first start records in `wandb_id`."""
    w = config.wandb
    mode = w.mode
    if mode == "disabled":
        return None, None
    if mode == "auto":
        netrc = Path.home() / ".netrc"
        has_key = bool(os.environ.get("WANDB_API_KEY")) or (
            netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
        mode = os.environ.get("WANDB_MODE") or ("online" if has_key else "offline")
    from lightning.pytorch.loggers import WandbLogger

    id_file = run_dir / "wandb_id"  # one wandb run per run directory, continued on resume
    new_id = None
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    elif _is_rank_zero():
        run_id = new_id = uuid.uuid4().hex[:12]  # written by _record_start
    else:
        run_id = None
    # quiet: no run history and summary on the terminal when the run ends (metrics.csv holds
    # them); the run's place and, online, its URL are still printed
    logger = WandbLogger(name=w.name or config.name, save_dir=str(run_dir), project=w.project,
                         entity=w.entity, group=w.group, tags=w.tags, id=run_id, resume="allow",
                         offline=mode == "offline", mode=mode, settings={"quiet": True})
    return logger, new_id


def _precision(config: TrainConfig) -> str:
    """The precision Lightning trains in: trainer.precision with "auto" resolved for this machine."""
    return training_precision(config.trainer.precision, config.trainer.accelerator)


def _peak_flops(config: TrainConfig) -> float | None:
    if config.trainer.peak_tflops:
        return config.trainer.peak_tflops * 1e12
    if config.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        from lightning.fabric.utilities.throughput import get_available_flops

        dtype = torch.bfloat16 if "bf16" in _precision(config) else torch.float32
        return get_available_flops(torch.device("cuda"), dtype)
    return None  # CPUs: unknown; MFU is not logged


def _model_stats(model_config) -> dict[str, Any]:
    spec = cache_spec_for(model_config)
    return {
        "params": model_config.num_params(),
        "params_without_gate_tables": model_config.num_params(include_gate_tables=False),
        "kv_elements_per_token": spec.elements_per_token(),
        "kv_bytes_per_token_bf16": spec.bytes_per_token(torch.bfloat16),
    }


def _record_start(run_dir: Path, config: TrainConfig, tokenizer_id: str | None,
                  resume_from: Path | None, stats: dict[str, Any], wandb_id: str | None) -> None:
    """config.json on the first start; run_info.json gains one provenance entry per start;
    wandb_id on the first start with wandb."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "config.json").is_file():
            record = {**config.to_dict(), "tokenizer_fingerprint": tokenizer_id,
                      **_init_model(config)}
            write_atomic(run_dir / "config.json", json.dumps(record, indent=2) + "\n")
        info_path = run_dir / "run_info.json"
        starts = json.loads(info_path.read_text())["starts"] if info_path.is_file() else []
        starts.append({**provenance(), "resumed_from": str(resume_from) if resume_from else None,
                       "max_steps": config.trainer.max_steps, "precision": _precision(config)})
        write_atomic(info_path, json.dumps({**stats, "starts": starts}, indent=2) + "\n")
        if wandb_id is not None:
            write_atomic(run_dir / "wandb_id", wandb_id)
    except OSError as err:  # checked before (check_run_dir), so only a race gets here
        raise RunError(f"{run_dir}: cannot be written ({err.strerror}: {err.filename})") from err


def _callbacks(config: TrainConfig, run_dir: Path, tokenizer, extra: tuple) -> list:
    t, d = config.trainer, config.data
    ckpt_dir = run_dir / "checkpoints"
    callbacks = [
        # always last.ckpt, the file a resume reads: Lightning's version counter would write
        # last-v1.ckpt beside it when the run directory was moved or copied since its last save
        ModelCheckpoint(dirpath=ckpt_dir, filename="last", save_top_k=0, save_last=True,
                        every_n_train_steps=t.checkpoint_every_n_steps,
                        enable_version_counter=False),
        ModelCheckpoint(dirpath=ckpt_dir, filename="best-step{step}", monitor="val/loss",
                        mode="min", save_top_k=1, auto_insert_metric_name=False),
        LearningRateMonitor(logging_interval="step"),
        ProgressBar(refresh_rate=max(1, t.log_every_n_steps // 2)),  # steps, loss, tok/s, ETA
        Throughput(tokens_per_step=d.batch_size * t.accumulate_grad_batches * d.seq_len,
                   seq_len=d.seq_len, peak_flops=_peak_flops(config)),
        *extra,
    ]
    if _is_rank_zero():  # the plain summary logs its table (to train.log); rich's prints it
        callbacks.append(ModelSummary())
    extra_info = {"run": config.name, "run_dir": str(run_dir)}
    if config.export:
        callbacks.append(Export(run_dir / "export", tokenizer=tokenizer, extra=extra_info))
    if config.export_steps:
        callbacks.append(ExportAt(config.export_steps, run_dir / "exports", tokenizer=tokenizer,
                                  extra=extra_info))
    return callbacks


def _trainer(config: TrainConfig, run_dir: Path, callbacks: list, loggers: list) -> L.Trainer:
    t = config.trainer
    plugins = [ChecksummedCheckpointIO()]  # atomic saves, a SHA-256 sidecar each
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=_precision(config), max_steps=t.max_steps, max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_every_n_steps * t.accumulate_grad_batches,
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps, num_sanity_val_steps=0,
        deterministic=t.deterministic, use_distributed_sampler=False,
        default_root_dir=str(run_dir), logger=loggers, callbacks=callbacks, plugins=plugins,
        enable_model_summary=False,  # ours is in `callbacks`, on rank zero
    )


def _log_once() -> None:
    """Let the root logger's handlers alone print Lightning's log lines. Importing `lightning`
    gives its logger a stderr handler of its own, and its lines also reach the root logger's
    (train.py: Hydra's console and train.log), so each appeared twice on the terminal.
    lightning.pytorch leaves its lines to the root logger where that has handlers; so here."""
    own = getattr(L, "_console", None)
    if own is not None and logging.getLogger().hasHandlers():
        logging.getLogger("lightning").removeHandler(own)


def _module(config: TrainConfig, model_config: ModelConfig, datamodule) -> LanguageModel:
    """The LightningModule: plain next-token training, or distillation from a teacher; its
    weights from `init` where given (a resumed run then loads its checkpoint over them)."""
    common = {"model": model_config.to_dict(), "optim": vars(config.optim).copy(),
              "max_steps": config.trainer.max_steps, "compile": config.trainer.compile,
              "val_slices": datamodule.val_slices}
    if config.distill is None:
        module = LanguageModel(**common)
    else:
        from egmla.training.distill import DistillationModel

        module = DistillationModel(**common, distill=dataclasses.asdict(config.distill))
    if config.init is not None:
        module.model.load_state_dict(load_export(config.init, dtype=torch.float32).state_dict())
    if config.distill is not None:
        _attach_teacher(module, config, datamodule)
    return module


def _attach_teacher(module, config: TrainConfig, datamodule) -> None:
    from egmla.imports import load_pretrained
    from egmla.training.distill import teacher_cache

    d = config.distill
    teacher, _ = load_pretrained(d.teacher, dtype=torch.float32)
    if teacher.config.vocab_size != module.model_config.vocab_size:
        raise RunError(f"distill.teacher={d.teacher!r} has a vocabulary of "
                       f"{teacher.config.vocab_size}, the model {module.model_config.vocab_size}")
    topk = None
    if d.top_k and d.teacher_cache:
        datamodule.prepare_data()
        datamodule.setup("fit")
        train_set = datamodule.train_set.dataset  # the PackedDataset under Indexed
        topk = teacher_cache(teacher, train_set.tokens, len(train_set), config.data.seq_len,
                             d.top_k)
    module.attach_teacher(teacher, topk)


def train(raw: dict[str, Any], run_dir: Path, extra_callbacks: tuple = (),
          on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Train (or resume) the run described by `raw` in `run_dir`; return the summary.

    Everything is checked before anything is written (see the module's docstring); then, on
    rank zero, the start is recorded and `on_start` called (train.py writes Hydra's record
    there). A finished run is reported as recorded: nothing is written, `on_start` not called."""
    config = TrainConfig.from_dict(raw)
    model_config = config.model_config()
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    datamodule = build_datamodule(config.data, config.seed, config.trainer.max_steps,
                                  indexed=config.distill is not None)
    tokenizer = datamodule.load_tokenizer()
    tokenizer_id = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    datamodule.check_vocab(model_config.vocab_size)
    resume_from = check_resume(run_dir, config, tokenizer_id)
    finished = finished_summary(run_dir, config)  # checked against the run's config just above
    if finished is not None:
        if _is_rank_zero():
            print(f"note: {run_dir} holds a finished run ({finished['global_step']} steps, "
                  f"trainer.max_steps={config.trainer.max_steps}): reporting its record, "
                  f"{run_dir / 'summary.json'}, without training or validating again; raise "
                  "trainer.max_steps to train further", file=sys.stderr)
        return finished
    if resume_from is not None:  # its bytes, before the model (and a teacher's cache) is built
        checkpoint, verified = verify_checkpoint(resume_from)
    stats = _model_stats(model_config)

    L.seed_everything(config.seed, workers=True, verbose=False)
    module = _module(config, model_config, datamodule)
    if resume_from is not None:
        check_weights_match(resume_from, checkpoint, module)
        del checkpoint  # memory-mapped; Lightning loads the file itself
        if not verified and _is_rank_zero():
            print(f"note: {resume_from} has no checksum ({sidecar(resume_from).name}: saved "
                  "before checksums were recorded); resuming without checking its bytes",
                  file=sys.stderr)
    _log_once()
    loggers = [ResumableCSVLogger(run_dir)]
    wandb_logger, wandb_id = _wandb_logger(config, run_dir)
    if wandb_logger is not None:
        loggers.append(wandb_logger)
    clock = FitClock(resumed=resume_from is not None)
    trainer = _trainer(config, run_dir, _callbacks(config, run_dir, tokenizer,
                                                   (clock, *extra_callbacks)), loggers)

    if _is_rank_zero():  # the start is checked: from here on the run directory is written
        note = warmup_note(config.optim, config.trainer.max_steps)
        if note:
            print(note, file=sys.stderr)
        slow = slow_precision_note(_precision(config), config.trainer.accelerator)
        if slow:
            print(f"warning: {slow}", file=sys.stderr)
        _record_start(run_dir, config, tokenizer_id, resume_from, stats, wandb_id)
        if on_start is not None:
            on_start()
        for logger in loggers:  # -> hparams.yaml in the run directory and the wandb config
            logger.log_hyperparams({"config": config.to_dict(), **stats})
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None)
    fit_seconds = time.perf_counter() - started
    all_starts = clock.total(fit_seconds)
    # the final number covers the whole validation set unless a quick run asks for less
    final_batches = config.trainer.final_val_batches
    trainer.limit_val_batches = 1.0 if final_batches is None else final_batches
    final = trainer.validate(module, datamodule=datamodule, verbose=False)
    val_loss = float(final[0]["val/loss"]) if final else math.nan
    if wandb_logger is not None and trainer.is_global_zero:
        # End this run now: the jobs of a -m sweep share one process, and wandb would log the
        # next job into this run ("a wandb run already in progress ... will reuse this run").
        wandb_logger.experiment.finish()

    summary: dict[str, Any] = {
        "name": config.name, "run_dir": str(run_dir), "global_step": trainer.global_step,
        # this start's training time; over all starts (None where an earlier start's is unknown)
        "val_loss": val_loss, "fit_seconds": round(fit_seconds, 1),
        "fit_seconds_all_starts": None if all_starts is None else round(all_starts, 1),
        "export": str(run_dir / "export") if config.export else None,
        **datamodule.baselines(),
    }
    if datamodule.val_slices:
        summary["mqar_accuracy"] = {k.removeprefix("val/mqar_acc/"): float(v)
                                    for k, v in final[0].items() if k.startswith("val/mqar_acc/")}
    if trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
