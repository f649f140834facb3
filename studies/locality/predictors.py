"""Per-layer predictors of which MLP neurons fire (PowerInfer's), trained on profiled activations.

    python -m studies.locality predictors --model runs/drelu --ranks 32 64 128 --recall 0.95

From the MLP inputs x of `--tokens` tokens of the embedded corpus's first half (corpus-a) and the
neurons that fire for them (studies.locality.firing), for each layer:

1. the neurons are ordered by firing frequency, most frequent first, and the first of them are
   the hot block, computed always (egmla.models.sparse_ffn, mode "predicted"; the model's MLPs
   are reordered the same way with `permute_neurons`, which changes nothing else): the first
   `--hot` share of each layer, or, with `--hot-budget BYTES`, the most often firing neurons of
   the whole model whose weights fit the budget (a memory budget for the hot tier, placed as
   PowerInfer places its GPU neurons: a layer whose neurons fire more gets more of it);
2. a low-rank MLP, scores = relu(x W1^T) W2^T + b, is trained (AdamW on a class-balanced binary
   cross-entropy) to predict the firing of every neuron;
3. its bias is shifted until it recalls `--recall` of the cold neurons' firings on a calibration
   tenth of the training tokens;
4. it is measured on held-out tokens (corpus-b): recall of the firing neurons (a hot neuron is
   always computed), the density (share of neurons computed per token: hot + predicted), the
   precision, and its parameters and multiply-adds against the MLP's.

Then the whole model's perplexity on the held-out tokens when every token's MLPs keep only the
neurons computed for it, against the reference: dense, or at a threshold (SwiGLU, `--threshold`
or `--sparsity`) the model computing exactly the neurons above it, whose own cost against
dense is reported beside (a predictor can only be asked to find what fires). Ranks are tried
in the given order and the first with a setting whose perplexity is within `--tolerance` of the
reference is chosen (PowerInfer widens its predictors until WikiText-2 perplexity is within
0.1%). `--hot` and `--recall` may each name
several values: at each rank every pair is tried (a calibration, not a new training), and the
pair within the tolerance that computes the fewest neurons (the lowest mean density on the
held-out tokens) is chosen. Every setting tried is reported.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from egmla.models.sparse_ffn import (LayerPredictor, Predictor, Threshold, firing, layer_thresholds,
                                     over_mlp_inputs, permute_neurons, predictors_to_tensors)
from studies.locality.profile import describe_threshold
from studies.locality.sources import BATCH, source_texts, token_stream, windows


CALIBRATION = 0.1  # share of the training tokens kept aside to calibrate the bias


def collect(model, batches: Iterable[torch.Tensor], threshold: Threshold = 0.0
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (x: the MLP inputs (N, d_model) float32, fired: (N, d_ff) bool) at
    `threshold` (one for every layer, or one per layer)."""
    thresholds = layer_thresholds(threshold, len(model.layers))
    xs: list[list[torch.Tensor]] = [[] for _ in model.layers]
    fired: list[list[torch.Tensor]] = [[] for _ in model.layers]

    def record(i, mlp, x):
        x = x.reshape(-1, x.shape[-1])
        xs[i].append(x.float())
        fired[i].append(firing(mlp, x, thresholds[i]))
    over_mlp_inputs(model, batches, record)
    return [(torch.cat(x), torch.cat(f)) for x, f in zip(xs, fired)]


def frequency_order(fired: torch.Tensor) -> torch.Tensor:
    """Neuron indices, most often firing first (ties by index, so the order is deterministic)."""
    return torch.sort(-fired.sum(0), stable=True).indices


def train_predictor(x: torch.Tensor, fired: torch.Tensor, rank: int, steps: int = 400,
                    batch: int = 512, lr: float = 3e-3, seed: int = 0) -> Predictor:
    """A low-rank MLP from x to the firing of each neuron (class-balanced BCE, AdamW)."""
    g = torch.Generator().manual_seed(seed)
    d, d_ff = x.shape[1], fired.shape[1]
    net = nn.Sequential(nn.Linear(d, rank, bias=False), nn.ReLU(), nn.Linear(rank, d_ff))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1 / p.shape[-1]) ** 0.5)
    rate = fired.float().mean(0).clamp(1e-4, 1 - 1e-4)
    pos_weight = (1 - rate) / rate  # each neuron's firings weigh as much as its silences
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, x.shape[0], (min(batch, x.shape[0]),), generator=g)
            loss = F.binary_cross_entropy_with_logits(net(x[idx]), fired[idx].float(),
                                                      pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
    w1, w2 = net[0].weight.detach().clone(), net[2].weight.detach().clone()
    return Predictor(w1, w2, net[2].bias.detach().clone())


def calibrate(predictor: Predictor, x: torch.Tensor, fired: torch.Tensor, hot: int,
              recall: float) -> Predictor:
    """The predictor with its bias shifted so that it recalls `recall` of the cold neurons'
    firings in (x, fired)."""
    with torch.no_grad():
        scores = predictor.scores(x)[:, hot:][fired[:, hot:]]
    if scores.numel() == 0:
        return predictor
    cut = torch.quantile(scores.double(), 1 - recall).item()  # keep scores above it
    return Predictor(predictor.w1, predictor.w2, predictor.bias - cut + 1e-6)


def measure(predictor: Predictor, x: torch.Tensor, fired: torch.Tensor, hot: int,
            matrices: int) -> dict[str, Any]:
    """Recall, density, precision, parameter and multiply-add shares on (x, fired)."""
    with torch.no_grad():
        computed = predictor(x)
    computed[:, :hot] = True
    true = fired.sum().item()
    hit = (computed & fired).sum().item()
    d, d_ff = x.shape[1], fired.shape[1]
    mlp_params = matrices * d * d_ff
    return {
        "recall": hit / true if true else None,
        "density": computed.float().mean().item(),
        "firing_density": fired.float().mean().item(),
        "precision": hit / computed.sum().item() if computed.any() else None,
        "params": predictor.params(),
        "params_share_of_mlp": predictor.params() / mlp_params,
        "macs_share_of_mlp": (predictor.w1.numel() + predictor.w2.numel()) / mlp_params,
    }


def perplexity(model, batches: Iterable[torch.Tensor], keep=None) -> float:
    """exp(mean next-token loss) over the batches; with `keep`, a function (layer index, mlp,
    x) -> bool (rows, d_ff) mask, each token's MLP keeps only the neurons the mask names."""
    hooks = []
    if keep is not None:
        for i, block in enumerate(model.layers):
            def masked(mlp, args, output, i=i):
                x = args[0]
                h = mlp.hidden(x) * keep(i, mlp, x.reshape(-1, x.shape[-1])).view(
                    *x.shape[:-1], -1)
                return mlp.w_down(h)
            hooks.append(block.mlp.register_forward_hook(masked))
    total, count = 0.0, 0
    try:
        with torch.inference_mode():
            for ids in batches:
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(),
                                       reduction="sum")
                total, count = total + loss.item(), count + ids[:, 1:].numel()
    finally:
        for h in hooks:
            h.remove()
    return math.exp(total / count)


def reorder(model, orders: list[torch.Tensor]) -> None:
    """Permute every layer's neurons in place, most frequent first."""
    for block, order in zip(model.layers, orders):
        permute_neurons(block.mlp, order)


def hot_by_share(train: list[tuple[torch.Tensor, torch.Tensor]], share: float) -> list[int]:
    """Each layer's hot block: the same share of its neurons."""
    return [round(share * fired.shape[1]) for _, fired in train]


def hot_under_budget(counts: list[torch.Tensor], neuron_bytes: int, budget: int) -> list[int]:
    """Each layer's hot block under a memory budget for the hot tier (PowerInfer's placement,
    greedily): the most often firing neurons of the whole model, whichever layer they are in,
    until their weights (`neuron_bytes` each) fill `budget` bytes. `counts` are each layer's
    firing counts, most frequent first, so a layer's share is a prefix: its hot block. Ties go
    to the earlier layer, then the earlier neuron."""
    take = min(budget // neuron_bytes, sum(c.numel() for c in counts))
    layer = torch.cat([torch.full((c.numel(),), i) for i, c in enumerate(counts)])
    order = torch.sort(-torch.cat(counts).double(), stable=True).indices[:take]
    return torch.bincount(layer[order], minlength=len(counts)).tolist()


def fit(model, train: list[tuple[torch.Tensor, torch.Tensor]], held_out_x, held_out_fired,
        ranks: list[int], hot_options: list[list[int]], recalls: list[float], steps: int,
        seed: int = 0):
    """Train one predictor per layer at each rank, then calibrate and measure it for each hot
    block (`hot_options`: each layer's hot neurons, one list per option) and each recall
    target; yield (rank, hots, recall, predictors, per-layer measurements) in that order. A
    predictor scores every neuron, so the hot block and the recall target change only its
    calibration: one training per layer and rank. `train` and `held_out_*` are in reordered
    neuron order already."""
    matrices = model.config.ffn_matrices
    cuts = [max(1, round(CALIBRATION * x.shape[0])) for x, _ in train]  # calibration | training
    for rank in ranks:
        trained = [train_predictor(x[cut:], fired[cut:], rank, steps=steps, seed=seed + i)
                   for i, ((x, fired), cut) in enumerate(zip(train, cuts))]
        for hots in hot_options:
            for recall in recalls:
                predictors, rows = [], []
                for i, ((x, fired), p, cut) in enumerate(zip(train, trained, cuts)):
                    p = calibrate(p, x[:cut], fired[:cut], hots[i], recall)
                    predictors.append(p)
                    rows.append({"layer": i, "hot": hots[i],
                                 **measure(p, held_out_x[i], held_out_fired[i], hots[i], matrices)})
                yield rank, hots, recall, predictors, rows


def build_predictors(model, tokenizer, args
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    """Train and choose predictors (this module's doc); the report, and the tensors and
    metadata to save (none if no rank was within the tolerance)."""
    def data(source: str, tokens: int) -> torch.Tensor:
        ids = token_stream(tokenizer, source_texts(source), max(tokens, BATCH * args.seq_len))
        return windows(ids, args.seq_len, tokens)

    train_ids, held_ids = data("corpus-a", args.tokens), data("corpus-b", args.held_out_tokens)
    print(f"collecting MLP inputs: {train_ids.numel()} training and {held_ids.numel()} held-out "
          "tokens ...", file=sys.stderr, flush=True)
    train = collect(model, train_ids.split(BATCH), args.threshold)
    orders = [frequency_order(fired) for _, fired in train]
    reorder(model, orders)
    train = [(x, fired[:, order]) for (x, fired), order in zip(train, orders)]
    held = collect(model, held_ids.split(BATCH), args.threshold)
    held_x, held_fired = [x for x, _ in held], [f for _, f in held]
    dense = perplexity(model, held_ids.split(BATCH))
    thresholds = layer_thresholds(args.threshold, len(model.layers))
    # the reference a predictor is held to: the model computing exactly what fires (at a
    # threshold, SwiGLU's firing set, an approximation of its own; else dense itself)
    reference = dense if not any(thresholds) else perplexity(
        model, held_ids.split(BATCH), lambda i, mlp, x: firing(mlp, x, thresholds[i]))
    if reference != dense:
        print(f"perplexity {reference:.3f} at the thresholds alone (dense {dense:.3f}, "
              f"{reference / dense - 1:+.2%}): the predictors' reference", file=sys.stderr,
              flush=True)
    if args.hot_budget is not None:
        cfg = model.config
        neuron_bytes = cfg.ffn_matrices * cfg.d_model * model.layers[0].mlp.w_up.weight.element_size()
        hot_options = {None: hot_under_budget([f.sum(0) for _, f in train], neuron_bytes,
                                                args.hot_budget)}
    else:
        hot_options = {share: hot_by_share(train, share) for share in dict.fromkeys(args.hot)}
    tried, chosen, best = [], None, None
    for rank, hots, recall, preds, rows in fit(model, train, held_x, held_fired, args.ranks,
                                                 list(hot_options.values()),
                                                 list(dict.fromkeys(args.recall)), args.steps):
        if chosen is not None and rank != chosen:
            break  # a smaller rank had a setting within the tolerance

        def keep(i, mlp, x, preds=preds, hots=hots):
            mask = preds[i](x)
            mask[:, :hots[i]] = True
            return mask & firing(mlp, x, thresholds[i])

        ppl = perplexity(model, held_ids.split(BATCH), keep)
        share = next(s for s, h in hot_options.items() if h is hots)
        entry = {"rank": rank, "hot_share": share, "hot": hots, "recall_target": recall,
                 "perplexity": ppl, "relative_increase": ppl / reference - 1,
                 "vs_dense": ppl / dense - 1,
                 "density": sum(r["density"] for r in rows) / len(rows), "layers": rows,
                 "params_share_of_model": sum(p.params() for p in preds) / model.num_params()}
        tried.append(entry)
        print(f"rank {rank}, hot {'budget' if share is None else share}, recall target {recall}: "
              f"perplexity {ppl:.3f} (reference {reference:.3f}, "
              f"{entry['relative_increase']:+.2%}), "
              f"recall {sum(r['recall'] or 0 for r in rows) / len(rows):.3f}, "
              f"density {entry['density']:.3f}", file=sys.stderr, flush=True)
        if entry["relative_increase"] <= args.tolerance and (
                best is None or entry["density"] < best[0]["density"]):
            chosen, best = rank, (entry, preds)
    report = {"dense_perplexity": dense, "reference_perplexity": reference, "tried": tried,
              "chosen_rank": chosen,
              "tolerance": args.tolerance, "hot_budget_bytes": args.hot_budget,
              "recall_target": None, "hot_share": None, "hot": None,
              "train_tokens": train_ids.numel(), "held_out_tokens": held_ids.numel()}
    if best is None:
        report["note"] = (f"no rank in {args.ranks} kept perplexity within {args.tolerance:.1%} "
                          "of the reference; nothing saved")
        return report, {}, {}
    entry, preds = best
    report.update(recall_target=entry["recall_target"], hot_share=entry["hot_share"],
                  hot=entry["hot"])
    tensors, metadata = predictors_to_tensors(
        [LayerPredictor(*layer) for layer in zip(preds, orders, entry["hot"])], args.threshold)
    if args.sparsity is not None:
        metadata["sparsity"] = repr(args.sparsity)
    return report, tensors, metadata


def predictors_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    budget = report["hot_budget_bytes"]
    chosen = ("none chosen" if report["chosen_rank"] is None else
              f"chosen: rank {report['chosen_rank']}, hot block "
              + (f"share {report['hot_share']}" if budget is None else f"under a {budget:,}-byte budget")
              + f" ({', '.join(map(str, report['hot']))} neurons by layer), recall target "
              f"{report['recall_target']}")
    dense, reference = report["dense_perplexity"], report["reference_perplexity"]
    held_to = ("dense" if reference == dense else
               f"the {describe_threshold(meta['threshold'], meta.get('sparsity'))} alone, "
               f"perplexity {reference:.3f} ({reference / dense - 1:+.2%} over dense)")
    lines = [f"# Predictors: {meta['model']}", "",
             (f"ffn {meta['ffn']}; {report['train_tokens']} training tokens (corpus-a), "
              f"{report['held_out_tokens']} held out (corpus-b); dense perplexity "
              f"{dense:.3f}; reference: {held_to}; tolerance {report['tolerance']:.1%} over the "
              f"reference; {chosen}; git {str(meta['git'].get('sha'))[:10]}."), "",
             ("| rank | hot share | recall target | perplexity | vs reference | vs dense | "
              "mean recall | mean density | mean firing | predictor params / model |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in report["tried"]:
        n = len(t["layers"])
        lines.append(
            f"| {t['rank']} | {'budget' if t['hot_share'] is None else t['hot_share']} | "
            f"{t['recall_target']} | {t['perplexity']:.3f} | {t['relative_increase']:+.2%} | "
            f"{t['vs_dense']:+.2%} | "
            f"{sum(r['recall'] or 0 for r in t['layers']) / n:.3f} | {t['density']:.1%} | "
            f"{sum(r['firing_density'] for r in t['layers']) / n:.1%} | "
            f"{t['params_share_of_model']:.1%} |")
    lines += ["", f"Chosen rank: {report['chosen_rank']}" + (
        f" ({report['note']})" if report.get("note") else "")]
    return "\n".join(lines) + "\n"
