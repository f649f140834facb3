"""Plain-PyTorch model code: imports only torch and the standard library."""

from egmla.models.attention import EGMLA, MHA, MLA
from egmla.models.layers import FeedForward, RMSNorm, Rotary, apply_rope
from egmla.models.positions import Positions
from egmla.models.transformer import Transformer, cache_spec_for

__all__ = ["EGMLA", "MHA", "MLA", "FeedForward", "Positions", "RMSNorm", "Rotary", "Transformer",
           "apply_rope", "cache_spec_for"]
