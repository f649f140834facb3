"""Compose configs/ exactly as train.py does, without running anything (tests, benchmarks,
notebooks): `compose_config(["experiment=quickstart", "model/attention=small_mla"])`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def compose_config(overrides: list[str], config_dir: Path = CONFIGS) -> dict[str, Any]:
    """The plain dict `train.py` hands to `egmla.training.run.train` for these overrides."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)
