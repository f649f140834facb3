"""Train an egmla backbone: the Hydra entry point.

    python train.py                                         # the quickstart (small EG-MLA, CPU)
    python train.py model/attention=mla trainer.max_steps=200 name=mla-try
    python train.py -m experiment=mqar_sweep model/attention=mha,mla,egmla
    torchrun --standalone --nproc_per_node=2 train.py trainer=ddp_cpu
    python train.py -m cluster=slurm experiment=paper_egmla_kv64      # SLURM via submitit

Configs live in configs/ (groups: model, model/attention, data, optim, trainer, cluster,
experiment); `python train.py --help` lists them. Re-running with the same run directory
(runs/<name>) resumes from its last checkpoint. Bad input (a config value, a run directory that
cannot be used or holds another run, a damaged checkpoint) is one line on stderr and exit 2,
and leaves the run directory as it was.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from egmla.data.corpus import CorpusError
    from egmla.training.config import TrainConfig
    from egmla.training.rundir import exit_with_error

    raw = OmegaConf.to_container(cfg, resolve=True)
    _name_sweep_job(raw)
    _use_the_jobs_cpus()
    try:
        TrainConfig.from_dict(raw)  # a bad key or value fails here, before Lightning is imported
        from egmla.training.report import print_summary
        from egmla.training.run import train

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        summary = train(raw, run_dir, on_start=lambda: _save_hydra_record(cfg, run_dir))
    except (ValueError, FileNotFoundError, CorpusError) as err:  # config, data, tokenizer,
        exit_with_error(err)  # run dir, checkpoint: one line, exit 2
    print_summary(summary, raw.get("sample_prompt"))
    return summary["val_loss"]  # the value a Hydra sweeper minimizes


def _save_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """What Hydra's output_subdir would hold (the composed config, Hydra's own, the overrides),
    in .hydra/<time>/, written once the start has been checked: configs/train.yaml sets
    output_subdir to null, since Hydra writes it before train.py can check anything."""
    hc = HydraConfig.get()
    folder = run_dir / ".hydra" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, folder / "config.yaml")
    OmegaConf.save(HydraConfig.instance().cfg, folder / "hydra.yaml")  # {hydra: ...}
    OmegaConf.save(hc.overrides.task, folder / "overrides.yaml")


def _use_the_jobs_cpus() -> None:
    """A job started by submitit uses at most the launcher's `cpus_per_task` threads. SLURM
    confines a job to its CPUs; submitit's local executor runs a sweep's jobs side by side on
    this machine without doing so, and each would otherwise start one thread per core, so that
    two jobs oversubscribe the cores (threads that wait at every operation's barrier)."""
    cpus = (HydraConfig.get().launcher or {}).get("cpus_per_task")
    if os.environ.get("SUBMITIT_EXECUTOR") and isinstance(cpus, int) and cpus > 0:
        import torch

        torch.set_num_threads(min(cpus, torch.get_num_threads()))


SWEEP_SYNTAX = (",", "range(", "choice(", "interval(", "glob(")


def _name_sweep_job(raw: dict) -> None:
    """In a -m sweep, each job's wandb run is named from the overrides the sweep varies
    (`quickstart[seed=1]`) and grouped by the sweep (its directory's name), unless the config
    names them. The varied keys are read from the command line where the sweep was launched
    (a launcher that runs jobs elsewhere, such as SLURM, names them by all their overrides)."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or not isinstance(raw.get("wandb"), dict):
        return
    w = raw["wandb"]
    if w.get("group") is None:
        w["group"] = Path(hc.sweep.dir).name
    if w.get("name") is None:
        swept = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:]
                 if "=" in a and any(t in a.split("=", 1)[1] for t in SWEEP_SYNTAX)}
        job = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept]
        label = ",".join(job) or hc.job.override_dirname or str(hc.job.num)
        w["name"] = f"{raw.get('name')}[{label}]"


def _check_plain_overrides() -> None:
    """A misspelled key given without `+` (`optim.lrr=1e-3`) is the typed config's one line and
    exit 2 (`optim: unknown key 'lrr'; allowed keys: ...`), as with `+`, not Hydra's hint."""
    from egmla.training.compose import check_plain_overrides
    from egmla.training.rundir import exit_with_error

    try:
        check_plain_overrides(sys.argv[1:])
    except ValueError as err:
        exit_with_error(err)


if __name__ == "__main__":
    _check_plain_overrides()
    main()
