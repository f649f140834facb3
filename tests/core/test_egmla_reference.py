"""EG-MLA against an independent float64 numpy reference written from the equations of
docs/attention.md ("MLA", "EG-MLA"), not from the model's code.

The other EG-MLA tests check the absorbed decode against the rebuild, two computations of the
same module: a mistake both share (a norm without its mean, a dropped bias, a wrong scale or
RoPE) passes them. Here the model decodes for real (a prefill, then single-token steps through
its contiguous cache) and every attention layer's output at every step is compared with the
reference's, which reads only the layer's weights and the config and recomputes each position
from the layer's inputs and the token ids (no cache, no helper of the model). Then deliberately
broken models show the comparison fails by far more than its tolerance, while naive and
absorbed still agree with each other.

Reference, per layer and token t (h_t the layer's input, x_t the token id, RoPE half-split):

    q_t = W_Q h_t (or W_UQ RMSNorm(W_DQ h_t)), split per head into q^C, q^R = RoPE(.)
    c_t = RMSNorm(W_DKV h_t) (latent_norm), k^R_t = RoPE(W_KR h_t), g_t = W_UE E[x_t] (+ 1)
    kv:     [k^C; v]_t = Norm(W_UKV c_t * g_t), split per KV head into k^C, v
    latent: c'_t = Norm(c_t * g_t), [k^C; v]_t = W_UKV c'_t
    o_t = W_O [sum_{j <= t} softmax_j((q^C_i . k^C_j + q^R_i . k^R_j) / sqrt(d_nope + d_rope)) v_j]_i

with E the table of the layer's group (read from the group's first layer).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from egmla.config import ModelConfig
from egmla.models import Transformer
from egmla.presets import preset
from support import torch_threads
from support.models import build, with_attention

# float64 throughout (model, cache and reference): the honest errors are ~1e-15 on outputs of
# order 1, so 1e-10 leaves five orders of magnitude of rounding room and still fails any real
# difference in the equations.
TOL = 1e-10
# A broken model must miss the reference by this much at every step: 1e6 x TOL, yet still far
# below the O(1) errors a broken gate norm gives on these O(1) outputs (~1 observed).
BROKEN = 1e6 * TOL
PROMPT, STEPS, BATCH = 6, 6, 2  # a prefill of 6 tokens, then 6 single-token decode steps
LAYERS = 4
GROUPS = [1, 2, LAYERS]  # one table per layer, per pair, one for the whole depth
IMPLS = ["naive", "absorbed", "auto"]

# the forms a converted GQA model takes (docs/attention.md, "Converted models"), with a
# low-rank query besides: 2 KV heads, 2 RoPE keys at frequencies picked from a 24-wide head's
# spectrum (indices < (d_nope + d_rope) / 2 = 12), no latent norm
CONVERTED = {
    "latent_norm": False, "n_kv_heads": 2, "rope_heads": 2, "d_q": 24, "d_c": 8, "d_e": 24,
    "gate_residual": True,
    "rope_freqs": [[[0, 3, 5, 11], [1, 2, 7, 9]], [[4, 6, 8, 10], [0, 1, 2, 3]],
                   [[2, 5, 7, 11], [3, 4, 9, 10]], [[0, 1, 6, 8], [5, 7, 10, 11]]],
}


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: a second intra-op thread only spins (60x slower beside a busy
    core)."""
    with torch_threads(1):
        yield


def config(position: str, norm: str, group: int, residual: bool, impl: str, **changes) -> ModelConfig:
    """tiny-egmla (d 64, 4 heads, d_nope 16, d_rope 8, d_v 16) at 4 layers, d_c 16, d_e 8."""
    base = preset("tiny-egmla", n_layers=LAYERS)
    options = {"gate_position": position, "gate_norm": norm, "gate_group_size": group,
               "gate_residual": residual, "gate_init": "random", "impl": impl, "d_c": 16, "d_e": 8}
    return with_attention(base, **{**options, **changes})


# ---- the reference ------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * gain


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)  # biased, as docs/attention.md says
    return (x - mu) / np.sqrt(var + eps) * gain + bias


def gate_norm(z: np.ndarray, w: dict[str, np.ndarray], kind: str, eps: float) -> np.ndarray:
    if kind == "layernorm":
        return layer_norm(z, w["gate_gain"], w["gate_bias"], eps)
    if kind == "rmsnorm":
        return rms_norm(z, w["gate_gain"], eps)
    assert kind == "none"
    return z


def rotate(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """RoPE in the half-split layout: pair (k, k + r/2) of x (..., r) turned by angles (..., r/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def inverse_frequencies(cfg: ModelConfig, layer: int) -> np.ndarray:
    """(rope_heads, d_rope / 2): theta^(-2k / d_rope), or with rope_freqs theta^(-2 j / (d_nope +
    d_rope)) for the layer's indices j per RoPE key."""
    a = cfg.attention
    if a.rope_freqs is None:
        k = np.arange(a.d_rope // 2, dtype=np.float64)
        return np.tile(cfg.rope_theta ** (-2 * k / a.d_rope), (a.rope_heads, 1))
    j = np.asarray(a.rope_freqs[layer], dtype=np.float64)
    return cfg.rope_theta ** (-2 * j / (a.d_nope + a.d_rope))


def reference_attention(cfg: ModelConfig, w: dict[str, np.ndarray], layer: int, h: np.ndarray,
                        ids: np.ndarray) -> np.ndarray:
    """The layer's output (B, S, d) for inputs h (B, S, d) and token ids (B, S) at positions
    0 .. S-1, each position attending causally over the ones before it."""
    a, eps = cfg.attention, cfg.norm_eps
    B, S, _ = h.shape
    H, n, r, dv, C = cfg.n_heads, a.d_nope, a.d_rope, a.d_v, a.d_c
    G = a.n_kv_heads or H  # K/V heads, each read by H / G consecutive query heads
    Hr = a.rope_heads  # RoPE keys, each read by H / Hr consecutive query heads

    if a.d_q is None:
        q = h @ w["wq"].T
    else:
        q = rms_norm(h @ w["wq_a"].T, w["q_norm"], eps) @ w["wq_b"].T
    q = q.reshape(B, S, H, n + r)

    down = h @ w["wkv_a"].T  # [W_DKV; W_KR] h
    c, k_rope = down[..., :C], down[..., C:].reshape(B, S, Hr, r)
    if a.latent_norm:
        c = rms_norm(c, w["kv_norm"], eps)

    angles = np.arange(S, dtype=np.float64)[:, None, None] * inverse_frequencies(cfg, layer)
    k_rope = rotate(k_rope, angles)  # (B, S, Hr, r)
    q_rope = rotate(q[..., n:], np.repeat(angles, H // Hr, axis=1))  # (B, S, H, r)

    g = w["table"][ids] @ w["w_gate"].T  # g = W_UE E[x]
    if a.gate_residual:
        g = 1 + g
    if a.gate_position == "kv":
        kv = gate_norm((c @ w["wkv_b"].T) * g, w, a.gate_norm, eps)  # (B, S, G (n + d_v))
    else:
        kv = gate_norm(c * g, w, a.gate_norm, eps) @ w["wkv_b"].T  # MLA over c' = Norm(c * g)
    kv = kv.reshape(B, S, G, n + dv)
    kv = kv[:, :, np.arange(H) // (H // G)]  # (B, S, H, n + d_v): each query head's K/V head
    k_rope = k_rope[:, :, np.arange(H) // (H // Hr)]  # (B, S, H, r)

    scores = (np.einsum("bthd,bshd->bhts", q[..., :n], kv[..., :n])
              + np.einsum("bthd,bshd->bhts", q_rope, k_rope)) / np.sqrt(n + r)
    future = np.triu(np.ones((S, S), dtype=bool), k=1)  # key after query
    scores = np.where(future, -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", p, kv[..., n:]).reshape(B, S, H * dv)
    return o @ w["wo"].T


def layer_weights(model: Transformer, layer: int) -> dict[str, np.ndarray]:
    """The layer's parameters as float64 arrays; the gate table is the one of its group's first
    layer (docs: one table E per group of gate_group_size consecutive layers)."""
    cfg = model.config
    attn = model.layers[layer].attn
    first = model.layers[layer - layer % cfg.attention.gate_group_size].attn
    params = {"wkv_a": attn.wkv_a.weight, "wkv_b": attn.wkv_b.weight, "wo": attn.wo.weight,
              "w_gate": attn.w_gate.weight, "table": first.gate_table.weight}
    if cfg.attention.d_q is None:
        params["wq"] = attn.wq.weight
    else:
        params.update(wq_a=attn.wq_a.weight, q_norm=attn.q_norm.weight, wq_b=attn.wq_b.weight)
    if cfg.attention.latent_norm:
        params["kv_norm"] = attn.kv_norm.weight
    if cfg.attention.gate_norm != "none":
        params["gate_gain"] = attn.gate_norm.weight
    if cfg.attention.gate_norm == "layernorm":
        params["gate_bias"] = attn.gate_norm.bias
    return {k: v.detach().double().numpy() for k, v in params.items()}


# ---- the model: non-trivial weights, real decoding ------------------------------------------------


def perturbed(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A float64 model whose attention weights all matter: projections at std fan_in^-1/2 (scores
    of order 1, not a uniform softmax), norm gains 1 + N(0, 0.25), biases N(0, 0.25), and a
    component shared by every row of W_UKV (or W_DKV under `latent`) and of W_UE, so each gated
    vector has a mean far from 0 (a norm that drops it is wrong by O(1))."""
    model = build(cfg)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    with torch.no_grad():
        for name, p in model.named_parameters():  # a shared table is listed once
            if ".attn." not in name:
                continue
            if name.endswith("gate_norm.bias"):
                p.copy_(0.5 * randn(*p.shape))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * randn(*p.shape))
            elif name.endswith("gate_table.weight"):
                p.copy_(randn(*p.shape))
            else:
                p.copy_(randn(*p.shape) * p.shape[1] ** -0.5)
        d_c = cfg.attention.d_c
        for block in model.layers:
            attn = block.attn
            latent = attn.wkv_b.weight if cfg.attention.gate_position == "kv" else attn.wkv_a.weight[:d_c]
            for w in (latent, attn.w_gate.weight):
                w.add_(randn(w.shape[1]) * w.shape[1] ** -0.5)
    return model


def decode_layers(model: Transformer, ids: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prefill PROMPT tokens, then one token per step through the model's cache; every
    attention layer's (inputs, outputs) over all steps, each (B, S, d)."""
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in model.layers]
    hooks = [block.attn.register_forward_hook(
        lambda module, args, out, i=i: seen[i].append((args[0].clone(), out.clone())))
        for i, block in enumerate(model.layers)]
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    try:
        with torch.no_grad():
            model(ids[:, :PROMPT], cache=cache)
            for t in range(PROMPT, ids.shape[1]):
                model(ids[:, t:t + 1], cache=cache)
    finally:
        for hook in hooks:
            hook.remove()
    assert all(len(steps) == 1 + ids.shape[1] - PROMPT for steps in seen)
    return [tuple(torch.cat(parts, dim=1).numpy() for parts in zip(*steps)) for steps in seen]


def step_errors(model: Transformer, weights: list[dict[str, np.ndarray]], ids: torch.Tensor
                ) -> tuple[np.ndarray, list[np.ndarray]]:
    """max |model - reference| per layer and step, (layers, 1 + STEPS), with the reference built
    on `weights` (layer_weights, read before any break); and each layer's outputs (B, S, d)."""
    np_ids = ids.numpy()
    bounds = [0, *range(PROMPT, ids.shape[1] + 1)]  # the prefill, then one token per step
    errors, outputs = [], []
    for i, (h, out) in enumerate(decode_layers(model, ids)):
        ref = reference_attention(model.config, weights[i], i, h, np_ids)
        diff = np.abs(out - ref)
        errors.append([diff[:, a:b].max() for a, b in zip(bounds, bounds[1:])])
        outputs.append(out)
    return np.array(errors), outputs


def all_weights(model: Transformer) -> list[dict[str, np.ndarray]]:
    return [layer_weights(model, i) for i in range(len(model.layers))]


def token_ids(cfg: ModelConfig, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (BATCH, PROMPT + STEPS), generator=gen)


# ---- the honest model matches -------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("residual", [False, True], ids=["gate", "residual-gate"])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"group{g}")
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "none"])
@pytest.mark.parametrize("position", ["kv", "latent"])
def test_decode_matches_the_reference(position, norm, group, residual, impl):
    """Every layer's attention output at the prefill and at each decode step equals the
    reference's to TOL, for both gate positions, every gate norm, tables per layer, per pair and
    for the whole depth, with and without the residual gate, and every `impl` (under `kv`,
    `auto` rebuilds for the prefill and the first decode steps and absorbs later ones)."""
    cfg = config(position, norm, group, residual, impl)
    model = perturbed(cfg)
    errors, _ = step_errors(model, all_weights(model), token_ids(cfg))
    assert errors.max() < TOL, f"max error per (layer, step):\n{errors}"
    if impl == "auto" and position == "kv":
        attn = model.layers[0].attn
        absorbed = [attn.prefers_absorbed(1, s) for s in range(PROMPT + 1, PROMPT + STEPS + 1)]
        assert not attn.prefers_absorbed(PROMPT, PROMPT) and any(absorbed) and not all(absorbed)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position", ["kv", "latent"])
def test_converted_form_matches_the_reference(position, impl):
    """The converted forms (2 KV heads, 2 RoPE keys at chosen frequencies, no latent norm), a
    low-rank query and the residual gate, with LayerNorm and tables shared by pairs of layers,
    and d_e wider than d_c (the absorbed contractions' other order)."""
    cfg = config(position, "layernorm", 2, True, impl, **CONVERTED)
    model = perturbed(cfg)
    errors, _ = step_errors(model, all_weights(model), token_ids(cfg))
    assert errors.max() < TOL, f"max error per (layer, step):\n{errors}"


# ---- a broken model does not -------------------------------------------------------------------


def drop_mean(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """LayerNorm without centering: z / sqrt(mean(z^2) + eps) * gamma + beta. The rebuild and
    the `latent` gate call the norm module; the absorbed `kv` computation never does, it reads
    the statistics `norm_stats` cached at write time; so both are broken, each where it computes
    the norm: the module's forward, and the statistics (mu = 0, inv_sigma the inverse RMS)."""
    for block in model.layers:
        attn, norm = block.attn, block.attn.gate_norm

        def uncentered(z: torch.Tensor, norm=norm) -> torch.Tensor:
            return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias

        monkeypatch.setattr(norm, "forward", uncentered)
        if hasattr(attn, "norm_stats"):  # gate_position kv

            def rms_stats(c, ids, original=attn.norm_stats, eps=norm.eps) -> torch.Tensor:
                mu, inv_sigma = original(c, ids).unbind(-1)
                mean_square = inv_sigma.pow(-2) - eps + mu**2  # var + mu^2
                return torch.stack((torch.zeros_like(mu), torch.rsqrt(mean_square + eps)), dim=-1)

            monkeypatch.setattr(attn, "norm_stats", rms_stats)


def drop_bias(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm's beta removed from the module: one patch reaches both computations (the
    module's forward passes bias=None to layer_norm; the absorbed output reads the module's
    `bias`, now None, for beta_V)."""
    for block in model.layers:
        monkeypatch.setattr(block.attn.gate_norm, "bias", None)


BREAKS = {"no-mean": drop_mean, "no-bias": drop_bias}


@pytest.mark.parametrize("position", ["kv", "latent"])
@pytest.mark.parametrize("name", list(BREAKS))
def test_a_broken_gate_norm_fails_the_reference(name, position, monkeypatch):
    """With the gate norm broken in the model (see `drop_mean`, `drop_bias`), naive, absorbed
    and auto all miss the reference by more than BROKEN (1e6 x TOL) at the prefill and at every
    decode step, yet agree with each other to TOL: the self-consistency tests alone would pass
    this bug."""
    outputs = {}
    for impl in IMPLS:
        cfg = config(position, "layernorm", 2, False, impl)
        model = perturbed(cfg)
        weights = all_weights(model)  # the reference keeps the intended norm
        BREAKS[name](model, monkeypatch)
        errors, outputs[impl] = step_errors(model, weights, token_ids(cfg))
        assert errors.max(axis=0).min() > BROKEN, f"{impl}: max error per (layer, step):\n{errors}"
    for impl in IMPLS[1:]:
        for ours, theirs in zip(outputs["naive"], outputs[impl]):
            assert np.abs(ours - theirs).max() < TOL
