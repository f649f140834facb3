"""Converting a GQA model to MLA / EG-MLA (egmla.upcycle), against a reference written apart
from the model code (support/partial_rope.py):

(a) every frequency kept, full rank: the converted model equals the original;
(b) for each rule and rope width, full rank: it equals the original with RoPE removed from the
    pairs not kept;
and EG-MLA's step 0 equals its MLA conversion (both gate positions), the SVD does what its
docstring says, the record tells the truth, and bad arguments fail in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from egmla.checkpoint import load_export, read_export_config, save_export
from egmla.config import ModelConfig
from egmla.data.tokenizer import get_tokenizer
from egmla.models import Transformer
from egmla.upcycle import UpcycleError, convert, upcycle
from egmla.upcycle.stats import collect_stats
from egmla.upcycle.svd import factor
from support.partial_rope import partial_rope_logits

# 2 layers, 4 query heads of 16 in 2 KV groups: full rank is 2 (32 - r) <= d_model 64
SOURCE = ModelConfig.from_dict({"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4,
                                "attention": {"type": "mha", "n_kv_heads": 2},
                                "rope_theta": 100.0})
RULES = ("2norm", "uniform", "high", "low")


def full_rank(rope_dims: int) -> int:
    return 2 * (2 * 16 - rope_dims)


@pytest.fixture(scope="module")
def source() -> Transformer:
    torch.manual_seed(0)
    return Transformer(SOURCE).double().eval()


@pytest.fixture(scope="module")
def calibration() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))


PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 24)]


def logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None])[0].double()


def test_the_reference_is_the_original_model_when_every_pair_rotates(source):
    for ids in PROMPTS:
        ref = partial_rope_logits(source.state_dict(), SOURCE, ids, None)
        assert (ref - logits(source, ids)).abs().max() < 1e-10


@pytest.mark.parametrize("to, position", [("mla", None), ("egmla", "kv"), ("egmla", "latent")])
def test_a_every_pair_kept_at_full_rank_equals_the_original(source, calibration, to, position):
    kw = {} if position is None else {"gate_position": position}
    converted = convert(source, to=to, d_c=full_rank(16), rope_dims=16, calibration=calibration,
                        **kw)
    for ids in PROMPTS:
        assert (logits(converted, ids) - logits(source, ids)).abs().max() < 1e-10


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("rope_dims", [4, 8])
@pytest.mark.parametrize("to, position", [("mla", None), ("egmla", "kv"), ("egmla", "latent")])
def test_b_full_rank_equals_the_original_without_rope_on_the_pairs_dropped(
        source, calibration, rule, rope_dims, to, position):
    kw = {} if position is None else {"gate_position": position}
    result = upcycle(source, to=to, d_c=full_rank(rope_dims), rope_dims=rope_dims, rule=rule,
                     calibration=calibration, **kw)
    assert all(len(g) == rope_dims // 2 for layer in result.freqs for g in layer)
    for ids in PROMPTS:
        ref = partial_rope_logits(source.state_dict(), SOURCE, ids, result.freqs)
        assert (logits(result.model, ids) - ref).abs().max() < 1e-10


@pytest.mark.parametrize("svd", ["plain", "whitened"])
@pytest.mark.parametrize("to, position", [("mla", None), ("egmla", "kv"), ("egmla", "latent")])
def test_a_and_b_hold_in_float32_within_1e_3(source, calibration, svd, to, position):
    source32 = Transformer(SOURCE).eval()
    source32.load_state_dict(source.state_dict())
    kw = {} if position is None else {"gate_position": position}
    for rope_dims in (4, 16):  # (b), and (a): every pair kept
        result = upcycle(source32.float(), to=to, d_c=full_rank(rope_dims), rope_dims=rope_dims,
                         calibration=calibration.long(), svd=svd, **kw)
        assert result.model.tok_emb.weight.dtype == torch.float32
        for ids in PROMPTS:
            ref = partial_rope_logits(source32.state_dict(), SOURCE, ids, result.freqs)
            assert (logits(result.model, ids) - ref).abs().max() < 1e-3
            if rope_dims == 16:
                assert (logits(result.model, ids) - logits(source32, ids)).abs().max() < 1e-3


@pytest.mark.slow  # SmolLM2 converted from its GGUF once per session (about 40 s)
@pytest.mark.parametrize("to, position", [("mla", None), ("egmla", "kv"), ("egmla", "latent")])
def test_b_holds_on_smollm2_in_float32(smollm2_cache, monkeypatch, to, position):
    """docs/upcycling.md: on SmolLM2 itself, at full rank (d_c 360) with 8 RoPE dims per KV head,
    the conversion equals the original without RoPE on the pairs dropped, to 5e-5 in float32."""
    from egmla.imports import load_pretrained

    monkeypatch.setenv("EGMLA_CACHE", str(smollm2_cache))
    model, _ = load_pretrained("SmolLM2-135M-Instruct", dtype=torch.float32)
    vocab = model.config.vocab_size
    calibration = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(0))
    kw = {} if position is None else {"gate_position": position}
    result = upcycle(model, to=to, d_c=360, rope_dims=8, calibration=calibration, **kw)
    for n in (9, 100):
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
        ref = partial_rope_logits(model.state_dict(), model.config, ids, result.freqs)
        assert (logits(result.model, ids) - ref).abs().max() < 2e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("to, kw, per_layer_stats, ids", [
    ("mla", {}, 0, 0),
    ("egmla", {"gate_position": "kv"}, 0, 4),  # identity start: no gate norm, the token id
    ("egmla", {"gate_position": "latent"}, 0, 0),
    ("egmla", {"gate_form": "paper"}, 2, 4),  # LayerNorm: mu and 1/sigma in float32 per layer
])
def test_the_caches_allocate_what_the_conversion_promises(source, calibration, dtype, to, kw,
                                                          per_layer_stats, ids):
    """Allocated bytes per token (contiguous and paged) equal (d_c + G r) per layer, with the
    gate's statistics and the token id where the form needs them, written out here."""
    from egmla.cache import ContiguousCache
    from serve.paged_cache import PagedKVCache

    model = convert(source, to=to, d_c=10, rope_dims=4, calibration=calibration, **kw)
    spec = model.cache_spec()
    expected = 2 * ((10 + 2 * 4) * dtype.itemsize + per_layer_stats * 4) + ids
    contiguous = ContiguousCache(spec, batch_size=2, max_len=8, dtype=dtype)
    paged = PagedKVCache(spec, num_blocks=3, block_size=4, dtype=dtype, device="meta")
    assert contiguous.nbytes() / 16 == paged.nbytes() / 12 == spec.bytes_per_token(dtype) == expected


def test_the_rules_keep_the_pairs_they_name(source, calibration):
    def kept(rule):
        return upcycle(source, to="mla", d_c=8, rope_dims=8, rule=rule,
                       calibration=calibration).freqs[0]
    assert kept("high") == [[0, 1, 2, 3]] * 2  # the fastest-turning pairs
    assert kept("low") == [[4, 5, 6, 7]] * 2
    assert kept("uniform") == [[0, 2, 4, 6]] * 2  # every d_h / r = 2nd pair


def test_2norm_keeps_the_pairs_that_contribute_most(calibration):
    """Make pairs 1 and 6 of KV head 0 (and its query heads) dominate: the rule keeps them."""
    torch.manual_seed(0)
    model = Transformer(SOURCE).double().eval()
    with torch.no_grad():
        for block in model.layers:
            for w, heads in ((block.attn.wq.weight, (0, 1)), (block.attn.wk.weight, (0,))):
                for h in heads:
                    for j in (1, 6):
                        w[h * 16 + j] *= 50
                        w[h * 16 + j + 8] *= 50
    freqs = upcycle(model, to="mla", d_c=8, rope_dims=4, rule="2norm",
                    calibration=calibration).freqs
    assert all(layer[0] == [1, 6] for layer in freqs)


@pytest.mark.parametrize("position", ["kv", "latent"])
def test_egmla_step_0_equals_its_mla_conversion(source, calibration, position):
    """At a rank that cuts (d_c 12): same function, full forward and cached decode."""
    mla = convert(source, to="mla", d_c=12, rope_dims=4, calibration=calibration)
    eg = convert(source, to="egmla", d_c=12, rope_dims=4, calibration=calibration,
                 gate_position=position, d_e=8, gate_group_size=1)
    ids = PROMPTS[2]
    assert (logits(eg, ids) - logits(mla, ids)).abs().max() < 1e-10
    assert (logits(mla, ids) - logits(source, ids)).abs().max() > 1e-3  # the cut is real
    with torch.no_grad():
        outs = []
        for m in (mla, eg):
            cache = m.new_cache(1, len(ids))
            steps = [m(ids[None, :10], cache=cache)] + [m(ids[None, t:t + 1], cache=cache)
                                                        for t in range(10, len(ids))]
            outs.append(torch.cat(steps, dim=1))
    assert (outs[0] - outs[1]).abs().max() < 1e-10


@pytest.mark.parametrize("form, position", [("identity", "kv"), ("identity", "latent"),
                                            ("paper", "kv")])
def test_the_converted_gate_trains_every_column(source, calibration, form, position):
    """No dead gate: one backward pass gives W_UE a gradient in every column and the tables
    one in every row read (the identity form: the table's gradient is W_UE^T dL/dg = 0 until
    W_UE moves, so only W_UE is checked there)."""
    eg = convert(source, to="egmla", d_c=12, rope_dims=4, calibration=calibration,
                 gate_form=form, gate_position=position, d_e=8, gate_group_size=1).train()
    ids = PROMPTS[2][None]
    eg(ids[:, :-1]).logsumexp(-1).sum().backward()
    for block in eg.layers:
        grad = block.attn.w_gate.weight.grad
        assert (grad.abs().sum(0) > 0).all()
        if form == "paper":
            rows = block.attn.gate_table.weight.grad[ids[0, :-1]]
            assert (rows.abs().sum(-1) > 0).all()


def test_the_paper_form_starts_at_a_gate_of_one_and_a_fitted_norm(source, calibration):
    result = upcycle(source, to="egmla", d_c=full_rank(4), rope_dims=4, calibration=calibration,
                     gate_form="paper", d_e=8, gate_group_size=1)
    attn = result.model.layers[0].attn
    ids = PROMPTS[1][None]
    assert torch.equal(attn.gate(ids), torch.ones_like(attn.gate(ids)))
    assert attn.gate_norm_kind == "layernorm" and not attn.gate_residual
    errors = result.gate["norm_fit_relative_error"]
    assert len(errors) == SOURCE.n_layers and all(0 < e < 1 for e in errors)


def test_whitened_factoring_has_the_smaller_error_on_the_calibration_inputs(source, calibration):
    """W_UKV W_DKV x is closest to W x, on average over the inputs it was fit to, under the
    whitened SVD (the optimum in that metric); plain is best in the Frobenius norm of W."""
    layer = source.layers[1].attn.rope_kv_attention()
    stats = collect_stats(source, [b.attn.rope_kv_attention() for b in source.layers],
                          calibration, covariance=True)[1]
    w = torch.cat([layer.wk, layer.wv]).double()
    cov = stats.covariance()
    errors = {}
    for kind in ("plain", "whitened"):
        down, up, energy = factor(w, 10, kind, cov)
        diff = w - up @ down
        errors[kind] = (torch.trace(diff @ cov @ diff.T).item(), torch.linalg.norm(diff).item())
        assert 0 < energy < 1
    assert errors["whitened"][0] < errors["plain"][0]
    assert errors["plain"][1] < errors["whitened"][1]


def test_the_record_gives_the_energy_the_singular_values_say(source):
    result = upcycle(source, to="mla", d_c=10, rope_dims=4, rule="high", svd="plain")
    attn = source.layers[0].attn
    rows = []
    for g in range(2):
        nope = [j for j in range(16) if j not in (0, 1, 8, 9)]
        rows += [attn.wk.weight[g * 16:(g + 1) * 16][nope], attn.wv.weight[g * 16:(g + 1) * 16]]
    s = torch.linalg.svdvals(torch.cat(rows).double())
    assert result.energy[0] == pytest.approx((s[:10].square().sum() / s.square().sum()).item())
    record = result.record()
    assert record["kv_elements_per_token"] == 2 * (10 + 2 * 4)  # (d_c + G r) per layer
    assert record["rope_freqs"] == [[[0, 1], [0, 1]]] * 2


@pytest.mark.parametrize("kwargs, message", [
    ({"d_c": 57}, "d_c=57: must be in [1, 56]"),
    ({"d_c": 0}, "d_c=0"),
    ({"rope_dims": 5}, "rope_dims=5: must be even"),
    ({"rope_dims": 18}, "rope_dims=18"),
    ({"rule": "random"}, "rule='random': must be one of"),
    ({"to": "gqa"}, "to='gqa'"),
    ({"svd": "qr"}, "svd='qr'"),
    ({"calibration": None}, "needs calibration token ids"),
    ({"to": "egmla", "gate_form": "paper", "gate_position": "latent"}, "must be kv"),
    ({"to": "egmla", "gate_group_size": 3}, "gate_group_size=3"),
    ({"d_c": True}, "d_c=True"),
    ({"to": "egmla", "d_e": 8.0}, "d_e=8.0: must be an integer"),
    ({"to": "egmla", "seed": 2**64}, "seed=18446744073709551616: must be in [0, 2**64)"),
    ({"to": "egmla", "seed": -1}, "seed=-1"),
    # 10^10 x 256 rows in float64: refused before anything is allocated
    ({"to": "egmla", "d_e": 10**10}, "d_e=10000000000: the converted model's weights would take"),
])
def test_bad_arguments_are_named(source, calibration, kwargs, message):
    args = {"to": "mla", "d_c": 8, "rope_dims": 4, "calibration": calibration, **kwargs}
    with pytest.raises(UpcycleError, match=re.escape(message)):
        upcycle(source, **args)


def test_a_source_that_is_not_gqa_is_refused(calibration):
    mla = Transformer(ModelConfig.from_dict({**SOURCE.to_dict(), "attention": {
        "type": "mla", "d_c": 16, "d_nope": 8, "d_rope": 8, "d_v": 16}}))
    with pytest.raises(UpcycleError, match="'mla': only MHA/GQA"):
        convert(mla, to="mla", d_c=8, rope_dims=4, calibration=calibration)


# ---- the command ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_export(tmp_path_factory, source):
    torch.manual_seed(1)
    model = Transformer(ModelConfig.from_dict({**SOURCE.to_dict(), "vocab_size": 512})).eval()
    return save_export(model, tmp_path_factory.mktemp("source") / "export",
                       tokenizer=get_tokenizer("bpe", vocab_size=512))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "egmla.upcycle", *args], capture_output=True,
                          text=True, timeout=600)


def test_the_command_writes_an_export_that_loads_and_equals_the_function(source_export, tmp_path):
    out = tmp_path / "eg"
    done = run_cli("--model", str(source_export), "--to", "egmla", "--d-c", "56",
                   "--rope-dims", "4", "--d-e", "8", "--gate-group-size", "1",
                   "--calibration-tokens", "2048", "--calibration-seq-len", "64", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "KV 128 elements per token against the original's 128" in done.stdout
    converted = load_export(out)
    _, meta = read_export_config(out)
    record = meta["extra"]["upcycle"]
    assert record["kv_elements_per_token"] == 128 and record["options"]["svd"] == "whitened"
    original = load_export(source_export).double()
    ids = PROMPTS[1]
    ref = partial_rope_logits(original.state_dict(), original.config, ids, record["rope_freqs"])
    assert (logits(converted, ids) - ref).abs().max() < 1e-3  # (b), from the command line
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--d-c", "1000"], "d_c=1000: must be in [1, 56]"),
    (["--d-c", "-3"], "--d-c=-3: must be positive"),
    (["--rope-dims", "7"], "rope_dims=7"),
    (["--d-e", "8"], "--d-e: EG-MLA's gate options, for --to egmla"),
    (["--gate-form", "paper", "--seed", "1"], "--gate-form, --seed: EG-MLA's gate options"),
    (["--calibration-seq-len", "100000"], "--calibration-seq-len=100000: the model's context is"),
])
def test_the_command_refuses_bad_values_in_one_line(source_export, tmp_path, args, message):
    done = run_cli("--model", str(source_export), "--to", "mla", "--d-c", "8", "--rope-dims", "4",
                   "--calibration-tokens", "256", "--calibration-seq-len", "64",
                   "--out", str(tmp_path / "x"), *args)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x").exists()


def test_the_command_checks_out_before_it_loads_the_model(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    for out, message in ((tmp_path / "file" / "x", "cannot be written"),
                         (tmp_path / "notes", "--overwrite")):
        done = run_cli("--model", "no-such-model", "--to", "mla", "--d-c", "8", "--out", str(out))
        assert done.returncode == 2 and message in done.stderr and str(out) in done.stderr
        assert "no-such-model" not in done.stderr  # the model was not looked for yet
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]


def test_the_command_refuses_an_unknown_model(tmp_path):
    done = run_cli("--model", "no-such-model", "--to", "mla", "--d-c", "8",
                   "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "no-such-model" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
