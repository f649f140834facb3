"""One forward's token positions, with what every layer derives from them.

The model's forward wraps its positions once and hands the object to every layer, as nanochat
hands its `cos_sin` down: the RoPE angles (per rotary and dtype) and the causal mask (per
key-positions tensor and query-head folding) are computed by the first layer that asks and
reused by the rest. They live as long as the object, one forward; nothing is kept in a module
or a layer between forwards.

    positions = Positions(torch.arange(4)[None])           # (1, T): every row at 0..3
    cos, sin = positions.cos_sin(rope, torch.float32)      # (1, 4, rope.dim), once per forward
    mask = positions.causal_mask(key_positions, R)         # (B or 1, 1, R * T, S)
"""

from __future__ import annotations

import torch

from egmla.models.layers import Rotary


class Positions:
    """positions (B, T) or (1, T) integer: each new token's position; `tensor` is that tensor."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.tensor = positions
        self._angles: dict[tuple[Rotary, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (key_positions, R, mask)

    @classmethod
    def of(cls, positions: Positions | torch.Tensor) -> Positions:
        """`positions` as this class: a layer called on its own may be given the bare tensor."""
        return positions if isinstance(positions, Positions) else cls(positions)

    def cos_sin(self, rope: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope`'s cos, sin at these positions in `dtype` (Rotary.cos_sin), computed once."""
        if torch.compiler.is_compiling():  # a traced forward computes them in its graph
            return rope.cos_sin(self.tensor, dtype)
        key = (rope, dtype)
        if key not in self._angles:
            self._angles[key] = rope.cos_sin(self.tensor, dtype)
        return self._angles[key]

    def causal_mask(self, key_positions: torch.Tensor, R: int = 1) -> torch.Tensor:
        """(B or 1, 1, R * T, S) boolean: the query at position p sees the keys at positions
        <= p, each query repeated for the R heads folded into it (egmla.models.attention.common.
        attend). `key_positions` (S,) or (B, S); the layers of a forward that pass the same
        tensor share one mask."""
        if not torch.compiler.is_compiling():
            for keys, r, mask in self._masks:
                if keys is key_positions and r == R:  # the tensor itself is kept: ids stay unique
                    return mask
        kp = key_positions if key_positions.dim() == 2 else key_positions[None]  # (B or 1, S)
        mask = kp[:, None, :] <= self.tensor[:, :, None]  # (B or 1, T, S)
        mask = mask[:, None, None].expand(-1, -1, R, -1, -1).reshape(mask.shape[0], 1, -1, kp.shape[-1])
        if not torch.compiler.is_compiling():
            self._masks.append((key_positions, R, mask))
        return mask
