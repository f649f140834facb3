"""Partial RoPE: which frequency pairs of each KV head keep their rotation (MHA2MLA, section 3).

A head of width d_h rotates d_h/2 pairs, pair j = dims (j, j + d_h/2) at theta^(-2j/d_h): j = 0
is the highest frequency. A converted layer keeps r/2 pairs per KV head (r = rope_dims):

    high      j = 0 .. r/2 - 1                      the fastest-turning pairs
    low       j = d_h/2 - r/2 .. d_h/2 - 1          the slowest
    uniform   j = 0, s, 2s, ...  with s = d_h / r   spread over the spectrum
    2norm     the r/2 pairs with the largest sum over the KV head's R query heads of
              mean_t |q_t,j| * mean_t |k_t,j| on calibration text, where |x_j| is the 2-norm
              of the pair (x_j, x_(j + d_h/2)): the pairs that contribute most to the scores

(MHA2MLA's 2-norm rule, as its code computes it: token means of the pair norms, the query
heads of a group summed; RoPE does not change a pair's norm, so it is measured before it.)
"""

from __future__ import annotations

import torch

RULES = ("2norm", "uniform", "high", "low")


def select_frequencies(G: int, d_h: int, rule: str, rope_dims: int, stats=None
                       ) -> list[list[int]]:
    """The kept pairs of each of a layer's G KV heads of width d_h, ascending: [G][rope_dims/2].
    `stats` (egmla.upcycle.stats.LayerStats): the layer's calibration sums, for `2norm`."""
    half, keep = d_h // 2, rope_dims // 2
    if rule == "high":
        return [list(range(keep)) for _ in range(G)]
    if rule == "low":
        return [list(range(half - keep, half)) for _ in range(G)]
    if rule == "uniform":
        step = d_h // rope_dims
        return [list(range(0, half, step))[:keep] for _ in range(G)]
    if rule == "2norm":
        if stats is None:
            raise ValueError("rule='2norm' needs calibration statistics")
        score = stats.pair_scores()  # (G, half)
        return [sorted(torch.topk(score[g], keep).indices.tolist()) for g in range(G)]
    raise ValueError(f"rule={rule!r}: must be one of {', '.join(RULES)}")
