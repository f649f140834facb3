"""Plain exports: save -> load gives the same model, needs no framework, names bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from egmla.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    check_destination,
    load_export,
    load_tokenizer,
    read_export_config,
    save_export,
)
from egmla.models import Transformer
from egmla.presets import PRESETS, preset

GROUPED = {**PRESETS["tiny-egmla"]["attention"], "gate_group_size": 2}
CASES = {
    "tiny-mha": {},
    "tiny-gqa2-untied": {"tie_embeddings": False},
    "tiny-mla": {},
    "tiny-egmla": {},
    "tiny-egmla-grouped": {"attention": GROUPED},
    "tiny-egmla-latent": {},
}


def build(case: str) -> Transformer:
    name = case.removesuffix("-untied").removesuffix("-grouped")
    torch.manual_seed(0)
    return Transformer(preset(name, **CASES[case])).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_gives_identical_logits(case, tmp_path):
    model = build(case)
    save_export(model, tmp_path / "export", extra={"note": case})
    loaded = load_export(tmp_path / "export")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert loaded.config == model.config and not loaded.training
    assert read_export_config(tmp_path / "export")[1]["extra"] == {"note": case}


def test_shared_tensors_stay_shared_and_are_stored_once(tmp_path):
    model = build("tiny-egmla-grouped")
    save_export(model, tmp_path / "export")
    loaded = load_export(tmp_path / "export")
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    assert loaded.layers[0].attn.gate_table.weight is loaded.layers[1].attn.gate_table.weight
    assert loaded.num_params() == model.num_params()
    size = (tmp_path / "export" / WEIGHTS_FILE).stat().st_size
    assert size < 4 * model.num_params() * 1.05  # once each, plus a small header


def test_loading_draws_no_random_init(tmp_path):
    """The weights come from the file: building the model on the meta device draws nothing, so
    loading leaves the global random stream where a seed put it (a 135M model's init was most
    of its load time)."""
    save_export(build("tiny-egmla-grouped"), tmp_path / "export")
    torch.manual_seed(1)
    loaded = load_export(tmp_path / "export")
    after_load = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after_load, torch.rand(4))
    assert all(p.requires_grad and p.device.type == "cpu" for p in loaded.parameters())


def test_a_loaded_model_keeps_its_weights_when_the_file_is_rewritten_in_place(tmp_path):
    """The loaded weights are the model's own memory, not the file's pages mapped (a file
    truncated under a mapping would crash the process that reads the page)."""
    model = build("tiny-mla")
    save_export(model, tmp_path / "export")
    loaded = load_export(tmp_path / "export")
    with open(tmp_path / "export" / WEIGHTS_FILE, "r+b") as f:  # the same inode, emptied
        f.truncate(0)
    for (name, param), (_, ref) in zip(loaded.named_parameters(), model.named_parameters()):
        assert torch.equal(param, ref), name


def test_from_state_dict_takes_the_tensors_and_names_what_does_not_fit():
    model = build("tiny-egmla-grouped")
    state = model.state_dict()
    rebuilt = Transformer.from_state_dict(model.config, state)
    assert torch.equal(rebuilt.tok_emb.weight, state["tok_emb.weight"])
    state["tok_emb.weight"].add_(1.0)  # a copy: the caller's tensors stay the caller's
    assert not torch.equal(rebuilt.tok_emb.weight, state["tok_emb.weight"])
    assert rebuilt.lm_head.weight is rebuilt.tok_emb.weight
    state = model.state_dict()
    shared = "layers.0.attn.gate_table.weight"  # layers 0 and 1 share it: either name will do
    from_the_other = Transformer.from_state_dict(model.config, {k: state[k] for k in state if k != shared})
    assert from_the_other.layers[0].attn.gate_table.weight is from_the_other.layers[1].attn.gate_table.weight
    assert torch.equal(from_the_other.layers[0].attn.gate_table.weight, state[shared])
    norm = state["norm.weight"]
    for broken, named in (({k: state[k] for k in state if k != "norm.weight"}, r"missing tensors \['norm"),
                          ({**state, "extra.weight": norm}, r"unexpected tensors \['extra.weight'\]"),
                          ({**state, "norm.weight": norm[:-1]}, "size mismatch for norm.weight")):
        with pytest.raises(ValueError, match=named):
            Transformer.from_state_dict(model.config, broken)


def test_dtype_is_kept_by_default_and_can_be_chosen(tmp_path):
    model = build("tiny-mla").to(torch.bfloat16)
    save_export(model, tmp_path / "export")
    assert load_export(tmp_path / "export").tok_emb.weight.dtype == torch.bfloat16
    as_f32 = load_export(tmp_path / "export", dtype=torch.float32)
    assert as_f32.tok_emb.weight.dtype == torch.float32
    assert torch.equal(as_f32.tok_emb.weight, model.tok_emb.weight.float())


def test_export_loads_without_transformers_lightning_or_hydra(tmp_path):
    model = build("tiny-egmla-grouped")
    save_export(model, tmp_path / "export")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        expected = model(ids)
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    blocked = ["transformers", "lightning", "pytorch_lightning", "hydra", "omegaconf"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # any import of them now fails\n"
        "import torch\n"
        "from egmla.checkpoint import load_export\n"
        "import egmla.imports  # converters import transformers only when called\n"
        f"model = load_export({str(tmp_path / 'export')!r})\n"
        f"ref = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(model(ref['ids']), ref['logits'])\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no-such-export"):
        load_export(tmp_path / "no-such-export")


def test_missing_config_or_weights_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=CONFIG_FILE):
        load_export(tmp_path / "empty")
    save_export(build("tiny-mha"), tmp_path / "export")
    (tmp_path / "export" / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        load_export(tmp_path / "export")


def test_unknown_config_key_is_named(tmp_path):
    save_export(build("tiny-mla"), tmp_path / "export")
    path = tmp_path / "export" / CONFIG_FILE
    data = json.loads(path.read_text())
    data["n_layer"] = 2  # a typo of n_layers
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="'n_layer'"):
        load_export(tmp_path / "export")


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    save_export(build("tiny-mla"), tmp_path / "a")
    save_export(build("tiny-mha"), tmp_path / "b")
    (tmp_path / "b" / WEIGHTS_FILE).replace(tmp_path / "a" / WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match=r"wkv_a|wq\.weight|wk\.weight"):
        load_export(tmp_path / "a")


def test_failed_save_leaves_nothing_behind(tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_export(build("tiny-mha"), tmp_path / "export", tokenizer=BrokenTokenizer())
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_previous_export(tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    old = build("tiny-mha")
    save_export(old, tmp_path / "export")
    with pytest.raises(OSError):
        save_export(build("tiny-mla"), tmp_path / "export", tokenizer=BrokenTokenizer())
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert load_export(tmp_path / "export").config == old.config


def test_save_replaces_an_export_but_not_other_directories(tmp_path):
    save_export(build("tiny-mha"), tmp_path / "export")
    save_export(build("tiny-mla"), tmp_path / "export")
    assert load_export(tmp_path / "export").config.attention.type == "mla"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not written by egmla"):
        save_export(build("tiny-mha"), tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_destination_that_cannot_be_written_is_refused_before_anything_is(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot be written"):
        check_destination(tmp_path / "file" / "export")
    with pytest.raises(CheckpointError, match="cannot be written"):
        save_export(build("tiny-mha"), tmp_path / "file" / "deeper" / "export")
    assert check_destination(tmp_path / "new" / "export") == tmp_path / "new" / "export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe left nothing


def test_load_tokenizer_without_tokenizer_files_says_so(tmp_path):
    save_export(build("tiny-mha"), tmp_path / "export")
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "export")
