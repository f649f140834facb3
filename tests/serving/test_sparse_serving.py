"""Activation-locality decoding in the serving engine (`LLM(..., ffn_sparsity=...)`,
`python -m serve --ffn-sparsity`): the same greedy tokens as dense decoding under continuous
batching, for every ReLU-family MLP; bad settings refused before a model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from egmla.presets import preset
from serve import LLM, SamplingParams
from support import ROOT
from support.models import build

PROMPTS = [[5, 9, 2, 7], [1, 2, 3], [30, 31, 32, 33, 34, 35], [8]]


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["gate", "oracle"])
@pytest.mark.parametrize("ffn", ["reglu", "drelu", "relu2"])
def test_sparse_serving_decodes_what_dense_serving_does(ffn, mode):
    cfg = preset("tiny-gqa2", ffn=ffn)
    dense = greedy(LLM(build(cfg), num_blocks=32, block_size=4))
    llm = LLM(build(cfg), num_blocks=32, block_size=4, ffn_sparsity=mode)
    assert greedy(llm) == dense
    stats = [block.mlp.sparse.stats for block in llm.model.layers]
    assert stats[0]["steps"] > 0  # the decode steps ran sparse...
    assert all(s["active"] < s["steps"] * s["neurons"] for s in stats)  # ...and skipped neurons


@pytest.mark.parametrize("kwargs, message", [
    ({"ffn_sparsity": "predicted"}, "ffn_sparsity='predicted'"),
    ({"ffn_sparsity": "gate", "ffn_threshold": -0.5}, "ffn_threshold=-0.5"),
    ({"ffn_sparsity": "gate", "ffn_threshold": float("nan")}, "ffn_threshold=nan"),
    ({"ffn_threshold": 0.1}, "needs an ffn_sparsity mode"),
])
def test_bad_settings_fail_before_loading(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "never-loaded"), **kwargs)


def test_a_swiglu_model_needs_a_threshold():
    with pytest.raises(ValueError, match="SwiGLU MLP is not sparse"):
        LLM(build(preset("tiny-gqa2"), dtype=torch.float32), ffn_sparsity="gate")
    llm = LLM(build(preset("tiny-gqa2"), dtype=torch.float32), ffn_sparsity="gate",
              ffn_threshold=0.01)
    assert len(greedy(llm)[0]) == 20


def test_the_server_flag_refuses_a_swiglu_model_without_a_threshold(tmp_path):
    from egmla.checkpoint import save_export
    from egmla.models import Transformer

    torch.manual_seed(0)
    export = save_export(Transformer(preset("tiny-mha")), tmp_path / "export")
    run = subprocess.run([sys.executable, "-m", "serve", "--model", str(export), "--ffn-sparsity",
                          "gate"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "SwiGLU MLP is not sparse" in run.stderr
