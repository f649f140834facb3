"""Every Hydra config composes into a valid typed config; misspelled keys fail by name."""

from __future__ import annotations

import pytest
import torch
from training_utils import CONFIGS, compose_config

from egmla.config import ConfigError
from egmla.models import Transformer
from egmla.training.config import TrainConfig

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
ATTENTIONS = sorted(p.stem for p in (CONFIGS / "model" / "attention").glob("*.yaml"))
SIZES = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (CONFIGS / "trainer").glob("*.yaml") if p.stem != "base")
DATA = sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml"))


def test_there_is_something_to_compose():
    assert {"quickstart", "mqar_sweep", "paper_mha", "paper_mla", "paper_egmla_kv256",
            "paper_egmla_kv64", "paper_egmla_kv16"} <= set(EXPERIMENTS)
    assert {"cpu", "gpu", "ddp", "fsdp", "ddp_cpu"} <= set(TRAINERS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_builds_its_model(experiment):
    raw = compose_config([f"experiment={experiment}"])
    if raw["data"]["kind"] == "hf":
        assert raw["data"]["hf"]["path"]  # the experiment names its dataset
    config = TrainConfig.from_dict(raw)
    with torch.device("meta"):
        model = Transformer(config.model_config())
    assert model.num_params() == config.model_config().num_params()
    assert config.name == raw["name"]


def test_paper_experiments_reproduce_the_paper_cache_sizes():
    from egmla.cache import cache_spec_for

    expected = {"paper_mha": 18432, "paper_mla": 3840, "paper_egmla_kv256": 3840,
                "paper_egmla_kv64": 1536, "paper_egmla_kv16": 960}
    for experiment, elements in expected.items():
        cfg = TrainConfig.from_dict(compose_config([f"experiment={experiment}"])).model_config()
        assert cache_spec_for(cfg).elements_per_token() == elements, experiment


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_size_with_every_attention(size, attention):
    overrides = [f"model={size}", f"model/attention={attention}"]
    config = TrainConfig.from_dict(compose_config(overrides))
    assert config.model_config().attention.type == compose_config(overrides)["model"]["attention"]["type"]


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("data", DATA)
def test_every_trainer_and_data_config_validates(trainer, data):
    overrides = [f"trainer={trainer}", f"data={data}"]
    if data == "hf":
        overrides.append("data.hf.path=json")
    TrainConfig.from_dict(compose_config(overrides))


@pytest.mark.parametrize(
    "override, name",
    [
        ("+trainer.max_step=5", "max_step"),
        ("+model.attention.dc=16", "dc"),
        ("+data.tokenizer.vocab=100", "vocab"),
        ("+optim.learning_rate=1", "learning_rate"),
        ("+batch_size=3", "batch_size"),
    ],
)
def test_misspelled_key_fails_naming_it(override, name):
    with pytest.raises(ConfigError, match=f"'{name}'"):
        TrainConfig.from_dict(compose_config([override]))


def test_unknown_attention_type_fails_naming_it():
    with pytest.raises(ConfigError, match="'gqa'"):
        TrainConfig.from_dict(compose_config(["model.attention.type=gqa"]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_steps=0", "max_steps=0"),
        ("data.seq_len=1", "seq_len=1"),
        ("optim.schedule=linear", "schedule='linear'"),
        ("wandb.mode=sometimes", "mode='sometimes'"),
        ("data.kind=parquet", "kind='parquet'"),
    ],
)
def test_bad_values_fail_naming_them(override, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(compose_config([override]))
