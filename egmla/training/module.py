"""The LightningModule: next-token loss around the plain `Transformer`, AdamW and the schedule.

The model knows nothing of training; this wrapper adds the loss, the optimizer's parameter
groups (no weight decay on norms, biases or embedding tables, EG-MLA's gate tables included),
warmup followed by cosine or WSD decay, gradient-norm logging and optional `torch.compile`.
"""

from __future__ import annotations

import math
import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from egmla.config import ModelConfig
from egmla.data.mqar import MQARAccuracy
from egmla.models import Transformer
from egmla.training.config import OptimConfig

IGNORE_INDEX = -100


def lr_lambda(optim: OptimConfig, max_steps: int):
    """Multiplier of the peak lr at optimizer step s: linear warmup, then the schedule.

    cosine: from 1 down to min_lr_ratio over the remaining steps. wsd (warmup-stable-decay):
    1 until the last `decay_fraction` of steps, then linear down to min_lr_ratio.
    """
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_start = max(warmup, int(max_steps * (1 - optim.decay_fraction)))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return 1.0 - (1 - floor) * progress

    return multiplier


def warmup_note(optim: OptimConfig, max_steps: int) -> str | None:
    """The line a run that ends inside its warmup prints at start, else None.

    Its last step is step max_steps - 1, at lr_lambda's max_steps / warmup_steps of the peak:
    max_steps=5, warmup_steps=50 -> 10%. A run of warmup_steps steps reaches the peak at its last.
    """
    if max_steps >= optim.warmup_steps:
        return None
    last = lr_lambda(optim, max_steps)(max_steps - 1)
    return (f"note: trainer.max_steps={max_steps} ends inside the warmup (optim.warmup_steps="
            f"{optim.warmup_steps}): the learning rate never reaches its peak, it rises to "
            f"{100 * last:.3g}% of optim.lr={optim.lr:g} at the last step")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay matrices of linear layers only; never norms, biases, embeddings."""
    no_decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # shared/tied parameters appear once
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in no_decay_ids else decay).append(p)
    return [{"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]


class LanguageModel(L.LightningModule):
    """Trains a `Transformer` on (input_ids, labels) batches; labels of -100 are ignored."""

    def __init__(
        self,
        model: dict[str, Any],
        optim: dict[str, Any],
        max_steps: int,
        compile: bool = False,
        val_slices: list[str] | None = None,
    ) -> None:
        super().__init__()
        # Plain dicts in the checkpoint: loading it needs neither omegaconf nor Hydra.
        self.save_hyperparameters()
        self.model_config = ModelConfig.from_dict(model)
        self.optim = OptimConfig(**optim)
        self.max_steps = max_steps
        self.model = Transformer(self.model_config)
        self.val_slices = val_slices
        self._val_loss_sum = torch.zeros(())
        self._val_token_count = torch.zeros(())
        self._mqar = MQARAccuracy()

    def configure_model(self) -> None:
        if self.hparams.compile:
            self.model.compile()  # in place: state-dict names stay those of the plain model

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, labels = batch  # (B, T), (B, T)
        logits = self.model(input_ids)  # (B, T, V)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX
        )
        return loss, logits

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, _ = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", torch.exp(loss.detach().clamp(max=30)))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.log("train/grad_norm", norm)  # before clipping

    # ---- validation: token-weighted loss over the whole set, MQAR accuracy by slice --------

    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_token_count = torch.zeros((), device=self.device, dtype=torch.float64)
        self._mqar = MQARAccuracy()

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        loss, logits = self.loss(batch)
        tokens = (batch[1] != IGNORE_INDEX).sum()
        self._val_loss_sum += loss.detach().double() * tokens
        self._val_token_count += tokens
        if self.val_slices:
            self._mqar.update(logits, batch[1], self.val_slices[dataloader_idx])

    def on_validation_epoch_end(self) -> None:
        total = self.all_gather(torch.stack([self._val_loss_sum, self._val_token_count]))
        total = total.reshape(-1, 2).sum(0)
        val_loss = (total[0] / total[1].clamp(min=1)).float()
        self.log("val/loss", val_loss, prog_bar=True)
        self.log("val/ppl", torch.exp(val_loss.clamp(max=30)))
        if self.val_slices:
            for name, acc in self._mqar.compute().items():
                self.log(f"val/mqar_acc/{name}", acc)

    # ---- optimizer ------------------------------------------------------------------------

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(
            param_groups(self.model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, self.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ---- RNG state travels with the checkpoint, so a resumed run draws what it would have ---

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        checkpoint["egmla_rng"] = {  # tensors and plain values: loadable with weights_only
            "torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("egmla_rng")
        if state:
            torch.set_rng_state(state["torch"])
            kind, keys, pos, has_gauss, gauss = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
            random.setstate(state["python"])
