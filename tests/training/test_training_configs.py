"""Every Hydra config composes into a valid typed config; misspelled keys fail by name."""

from __future__ import annotations

import pytest
import torch

from egmla.config import ConfigError
from egmla.models import Transformer
from egmla.training.config import TrainConfig
from support.training import CONFIGS, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
ATTENTIONS = sorted(p.stem for p in (CONFIGS / "model" / "attention").glob("*.yaml"))
SIZES = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (CONFIGS / "trainer").glob("*.yaml") if p.stem != "base")
DATA = sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml"))


def test_there_is_something_to_compose():
    assert {"quickstart", "mqar_sweep", "paper_mha", "paper_mla", "paper_egmla_kv256",
            "paper_egmla_kv64", "paper_egmla_kv16"} <= set(EXPERIMENTS)
    assert {"cpu", "gpu", "ddp", "fsdp", "ddp_cpu"} <= set(TRAINERS)


@pytest.fixture(scope="module")
def an_export(tmp_path_factory):
    """For the experiments that start from an export (init=, e.g. upcycle_smollm2)."""
    from egmla.checkpoint import save_export
    from egmla.presets import preset

    return save_export(Transformer(preset("tiny-mla")), tmp_path_factory.mktemp("init") / "x")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_builds_its_model(experiment, an_export):
    raw = compose_config([f"experiment={experiment}"])
    if raw.get("init") == "???":  # the experiment needs an export to start from
        with pytest.raises(ConfigError, match="init: missing; pass init=<export directory>"):
            TrainConfig.from_dict(raw)
        raw = compose_config([f"experiment={experiment}", f"init={an_export}"])
    if raw["data"]["kind"] == "hf":
        assert raw["data"]["hf"]["path"]  # the experiment names its dataset
    config = TrainConfig.from_dict(raw)
    with torch.device("meta"):
        model = Transformer(config.model_config())
    assert model.num_params() == config.model_config().num_params()
    assert config.name == raw["name"]


def test_paper_experiments_reproduce_the_paper_cache_sizes():
    from egmla.models import cache_spec_for

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
        ("model.ffn=gelu", "model.ffn='gelu': must be one of"),
        ("seed=-1", r"seed=-1: seeds are from 0 to 2\*\*32 - 1"),  # was numpy's, unnamed
        ("seed=4294967296", "seed=4294967296: seeds are from 0"),
    ],
)
def test_bad_values_fail_naming_them(override, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(compose_config([override]))


@pytest.mark.parametrize("override, message", [
    ("data.mqar.vocab_size=2", r"kv_pairs 4.*vocab_size=2: too small"),
    ("data.seq_len=32", r"kv_pairs 16, data.seq_len 32\): seq_len=32: must be >= 4 \* num_kv_pairs"),
    ("data.mqar.train_kv_pairs=[]", r"train_kv_pairs=\[\]"),
    ("data.mqar.train_examples=2", "train_examples=2: fewer than one for each of the 3"),
    ("data.mqar.val_examples=0", "val_examples=0"),
    ("data.mqar.power_a=0", "power_a=0"),
    ("data.mqar.val_kv_pairs=[0]", "num_kv_pairs=0"),
])
def test_bad_mqar_values_fail_before_the_run_starts(override, message):
    """The MQAR slices are built when the run starts; their settings are checked with the rest
    of the config, before the run directory is written (they used to fail after it was)."""
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(compose_config(["experiment=mqar_sweep", override]))
    TrainConfig.from_dict(compose_config(["experiment=mqar_sweep"]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=abc", "optim.lr: expected a float, got 'abc'"),
        ("optim.lr=null", "optim.lr: expected a float, got null"),
        ("trainer.max_steps=abc", "trainer.max_steps: expected an int, got 'abc'"),
        ("trainer.max_steps=2.5", "trainer.max_steps: expected an int, got 2.5"),
        ("data.batch_size=abc", "data.batch_size: expected an int, got 'abc'"),
        ("data.tokenizer.vocab_size=true", "data.tokenizer.vocab_size: expected an int, got True"),
        ("trainer.compile=1", "trainer.compile: expected a bool (true or false), got 1"),
        ("trainer.deterministic=yes", "trainer.deterministic: expected a bool (true or false)"),
        ("trainer.gradient_clip_val=abc", "trainer.gradient_clip_val: expected a float or null"),
        ("optim.betas=[0.9,abc]", "optim.betas[1]: expected a float, got 'abc'"),
        ("wandb=null", "wandb: missing section"),
        ("model.d_model=abc", "model.d_model: expected an int, got 'abc'"),
        ("+model.tie_embeddings=0", "model.tie_embeddings: expected a bool"),
        ("model.attention.d_c=abc", "model.attention.d_c: expected an int, got 'abc'"),
        ("model.attention.d_q=1.5", "model.attention.d_q: expected an int or null, got 1.5"),
    ],
)
def test_wrongly_typed_values_fail_naming_key_and_type(override, message):
    with pytest.raises(ConfigError) as failure:
        TrainConfig.from_dict(compose_config(["model/attention=small_mla", override]))
    assert str(failure.value).startswith(message), failure.value


def test_ints_read_as_floats_and_names_and_null_where_optional():
    config = TrainConfig.from_dict(compose_config([
        "optim.lr=1", "name=123", "trainer.gradient_clip_val=null", "model/attention=small_mha",
        "model.attention.n_kv_heads=2"]))
    assert config.optim.lr == 1 and config.name == "123" and config.trainer.gradient_clip_val is None
    assert config.model_config().attention.n_kv_heads == 2


def test_debug_quick_shortens_every_part_of_a_run_and_keeps_the_experiment():
    raw = compose_config(["experiment=quickstart", "debug=quick"])
    config = TrainConfig.from_dict(raw)
    t = config.trainer
    assert (t.max_steps, t.limit_val_batches, t.final_val_batches) == (5, 2, 2)
    assert config.wandb.mode == "disabled" and config.name == "debug"
    assert raw["model"]["attention"]["type"] == "egmla" and raw["data"]["seq_len"] == 128


def test_the_final_validation_covers_the_whole_split_unless_told():
    assert TrainConfig.from_dict(compose_config(["experiment=quickstart"])).trainer.final_val_batches is None
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="trainer.final_val_batches"):
            TrainConfig.from_dict(compose_config([f"trainer.final_val_batches={bad}"]))


@pytest.mark.parametrize("ffn", ["swiglu", "reglu", "drelu", "relu2"])
def test_the_mlp_activation_is_a_hydra_option_at_equal_parameters(ffn):
    config = TrainConfig.from_dict(compose_config(["model=small", f"model.ffn={ffn}"]))
    model = Transformer(config.model_config())
    assert all(block.mlp.activation == ffn for block in model.layers)
    swiglu = TrainConfig.from_dict(compose_config(["model=small"])).model_config()
    assert model.num_params() == swiglu.num_params()  # relu2: no gate, 1.5x the width


def test_a_run_saved_before_a_model_field_existed_resumes_under_its_default(tmp_path):
    """A run directory written before `model.ffn` existed holds no such key: it is SwiGLU, and
    resumes as such; a run saved with another activation is still refused by name."""
    import json

    from egmla.training.run import RunError, check_resume

    config = TrainConfig.from_dict(compose_config(["model=small"]))
    saved = config.to_dict()
    del saved["model"]["ffn"]
    (tmp_path / "config.json").write_text(json.dumps({**saved, "tokenizer_fingerprint": "t"}))
    assert check_resume(tmp_path, config, "t") is None  # no checkpoint yet, and no refusal
    saved["model"]["ffn"] = "drelu"
    (tmp_path / "config.json").write_text(json.dumps({**saved, "tokenizer_fingerprint": "t"}))
    with pytest.raises(RunError, match="different model.ffn \\('drelu' there, 'swiglu' now\\)"):
        check_resume(tmp_path, config, "t")
