"""What fires: per layer, the fraction of neurons that fire per token, each neuron's firing
frequency and its concentration, the union over a decode batch, and the overlap of the most
frequent neurons across sources."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from egmla.models.sparse_ffn import Threshold, firing, layer_thresholds, over_mlp_inputs


UNION_BATCHES = (1, 4, 16)
TOP_SHARE = 0.2  # the hot set whose stability across sources is reported
COVERAGE = 0.8  # "X% of neurons give 80% of firings"
CURVE_POINTS = 101


class LayerStats:
    """Firing statistics of one layer, accumulated over batches of (B, T, d_ff) masks."""

    def __init__(self, d_ff: int) -> None:
        self.counts = torch.zeros(d_ff, dtype=torch.long)
        self.tokens = 0
        self.per_token: list[torch.Tensor] = []  # active fraction of each token
        self.union = {b: [] for b in UNION_BATCHES}

    def add(self, mask: torch.Tensor) -> None:
        B, T, d_ff = mask.shape
        self.counts += mask.sum((0, 1))
        self.tokens += B * T
        self.per_token.append(mask.float().mean(-1).flatten())
        for b in UNION_BATCHES:
            if B % b == 0:
                grouped = mask.view(B // b, b, T, d_ff).any(1)  # b sequences at one position
                self.union[b].append(grouped.float().mean(-1).flatten())

    def summary(self) -> dict[str, Any]:
        fractions = torch.cat(self.per_token)
        q = torch.quantile(fractions, torch.tensor([0.1, 0.5, 0.9])).tolist()
        return {
            "tokens": self.tokens,
            "active_fraction": {"mean": fractions.mean().item(), "p10": q[0], "p50": q[1],
                                "p90": q[2]},
            "sparsity": 1 - fractions.mean().item(),
            "neurons_for_80pct": coverage_share(self.counts),
            "never_fired": (self.counts == 0).float().mean().item(),
            "union_sparsity": {str(b): 1 - torch.cat(v).mean().item()
                               for b, v in self.union.items() if v},
            "curve": concentration_curve(self.counts),
        }


def coverage_share(counts: torch.Tensor, coverage: float = COVERAGE) -> float | None:
    """The smallest share of neurons (most frequent first) that give `coverage` of all firings;
    None when nothing fired."""
    total = counts.sum().item()
    if total == 0:
        return None
    cum = counts.sort(descending=True).values.cumsum(0).double() / total
    k = int(torch.searchsorted(cum, torch.tensor([coverage], dtype=torch.float64)).item()) + 1
    return min(k, counts.numel()) / counts.numel()


def concentration_curve(counts: torch.Tensor, points: int = CURVE_POINTS) -> list[float]:
    """Share of all firings given by the top x share of neurons, at x = 0, 1/(points-1), ..., 1."""
    total = counts.sum().item()
    cum = torch.cat([torch.zeros(1), counts.sort(descending=True).values.cumsum(0).double()])
    idx = torch.linspace(0, counts.numel(), points).round().long()
    return (cum[idx] / total).tolist() if total else [0.0] * points


def top_overlap(a: torch.Tensor, b: torch.Tensor, share: float = TOP_SHARE) -> float:
    """|top(a) & top(b)| / |top(a)|, top = the `share` most frequent neurons."""
    k = max(1, round(share * a.numel()))
    ta, tb = set(a.topk(k).indices.tolist()), set(b.topk(k).indices.tolist())
    return len(ta & tb) / k


def profile_model(model, batches: Iterator[torch.Tensor], threshold: Threshold = 0.0,
                  progress: Callable[[int], None] | None = None) -> list[LayerStats]:
    """Run `model` over the (B, T) token batches and gather each layer's LayerStats, firing
    at `threshold` (one for every layer, or one per layer)."""
    layers = [LayerStats(block.mlp.w_up.out_features) for block in model.layers]
    thresholds = layer_thresholds(threshold, len(model.layers))

    def counted(batches):
        for ids in batches:
            yield ids
            if progress:
                progress(ids.numel())
    over_mlp_inputs(model, counted(batches),
                    lambda i, mlp, x: layers[i].add(firing(mlp, x, thresholds[i])))
    return layers


def pooled(layers: list[LayerStats]) -> dict[str, Any]:
    counts = torch.cat([s.counts for s in layers])
    return {"neurons_for_80pct": coverage_share(counts), "curve": concentration_curve(counts),
            "sparsity": sum(s.summary()["sparsity"] for s in layers) / len(layers)}
