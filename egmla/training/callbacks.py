"""Callbacks and loggers: throughput and MFU, the training time over all starts, the plain
export, a CSV log and a progress bar that survive resume."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from egmla.checkpoint import save_export


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters that do matmuls) + attention's 12 L d T.

    Embedding and gate tables are lookups, not matmuls, so they are left out; a tied LM head
    is a matmul and is counted once. (The usual estimate of the PaLM paper, appendix B.)
    """
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    matmul_params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    if head is not None and id(head.weight) in lookups:
        matmul_params += head.weight.numel()
    cfg = model.config
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len


class Throughput(L.Callback):
    """Logs tokens/s (shown in the progress bar) and an MFU estimate when peak FLOPs are known.

    `tokens_per_step` is per device; the logged rate counts all ranks. The time is the wall
    time between optimizer steps.
    """

    def __init__(self, tokens_per_step: int, seq_len: int, peak_flops: float | None) -> None:
        self.tokens_per_step, self.seq_len, self.peak_flops = tokens_per_step, seq_len, peak_flops
        self._last: float | None = None
        self._flops_per_token = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._flops_per_token = flops_per_token(pl_module.model, self.seq_len)
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-accumulation: no optimizer step yet
        now = time.perf_counter()
        if self._last is not None:
            tokens_per_s = self.tokens_per_step * trainer.world_size / (now - self._last)
            pl_module.log("train/tokens_per_s", tokens_per_s, prog_bar=True)
            if self.peak_flops:
                mfu = tokens_per_s * self._flops_per_token / (self.peak_flops * trainer.world_size)
                pl_module.log("train/mfu", mfu)
        self._last = now


class FitClock(L.Callback):
    """A run's training time over all its starts. Each checkpoint carries the seconds trained
    until it was saved: what the checkpoint this start resumed carried, plus this start's time
    since fit began. So a resumed run's `total` counts each earlier start up to its last save
    (the steps after it are lost, and trained again in the next start, whose time counts), and
    this start whole. `total` is None for a run resumed from a checkpoint saved without the
    clock (its earlier starts' time is unknown), and for every later start of it."""

    def __init__(self, resumed: bool = False) -> None:
        self.before: float | None = None if resumed else 0.0  # known once the checkpoint loads
        self._started: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()

    def total(self, this_start: float | None = None) -> float | None:
        """The seconds of the earlier starts plus `this_start` (default: since fit began)."""
        if this_start is None:
            this_start = 0.0 if self._started is None else time.perf_counter() - self._started
        return None if self.before is None else self.before + this_start

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.total()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = state_dict.get("seconds")


class ProgressBar(TQDMProgressBar):
    """Lightning's bar (steps, loss, tokens/s, ETA), also after a resume. Lightning does not call
    `on_train_epoch_start` when it restarts mid-epoch, so its bar kept the placeholder
    description and no total ("Training: 350/?", no ETA) for the rest of a resumed run."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.fit_loop.restarted_mid_epoch and self.train_progress_bar is not None:
            # the batches behind the restored step; the bar goes on counting from there, so its
            # total is the epoch's, where Lightning's (for max_steps) is the steps left
            done = trainer.global_step * trainer.accumulate_grad_batches
            total = min(trainer.num_training_batches, done + self.total_train_batches)
            bar = self.train_progress_bar
            bar.reset(total=convert_inf(total))
            bar.initial = bar.n = done  # the rate and ETA count this start's batches only
            bar.set_description(f"Epoch {trainer.current_epoch}")


class Export(L.Callback):
    """After fitting, write the plain export (config.json, model.safetensors, tokenizer).

    On `fit` end, not train end: a run resumed after its last step trains nothing, and Lightning
    then skips `on_train_end`, but its export must still be written.
    """

    def __init__(self, directory: Path, tokenizer: Any = None, extra: dict | None = None) -> None:
        self.directory, self.tokenizer, self.extra = directory, tokenizer, extra

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model
        model = getattr(model, "_orig_mod", model)
        save_export(model, self.directory, tokenizer=self.tokenizer,
                    extra={**(self.extra or {}), "global_step": trainer.global_step})


class ExportAt(L.Callback):
    """Write the plain export at given optimizer steps, into `<root>/step<N>/` (a recovery
    curve from one run). A resumed run writes the export of the step it resumes at, if the
    interruption came between that step's checkpoint and its export."""

    def __init__(self, steps: list[int], root: Path, tokenizer: Any = None,
                 extra: dict | None = None) -> None:
        self.steps, self.root = sorted(set(steps)), root
        self.tokenizer, self.extra = tokenizer, extra

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        directory = self.root / f"step{step}"
        if step in self.steps and trainer.is_global_zero and not directory.is_dir():
            model = getattr(pl_module.model, "_orig_mod", pl_module.model)
            save_export(model, directory, tokenizer=self.tokenizer,
                        extra={**(self.extra or {}), "global_step": step})

    def on_train_start(self, trainer, pl_module) -> None:
        self._export(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._export(trainer, pl_module)


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        """Lightning's writer deletes an existing metrics.csv; a resumed run appends to it."""
        path = Path(self.metrics_file_path)
        if path.is_file():
            with path.open(newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))


class ResumableCSVLogger(CSVLogger):
    """CSVLogger writing `<save_dir>/metrics.csv`, appending when a run resumes."""

    def __init__(self, save_dir: Path) -> None:
        super().__init__(save_dir=str(save_dir), name="", version="")

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
