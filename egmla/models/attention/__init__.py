"""Attention variants behind one interface: `forward(x, positions, cache=None, token_ids=None)`
and `cache_spec()`."""

from egmla.models.attention.egmla import EGMLA
from egmla.models.attention.mha import MHA
from egmla.models.attention.mla import MLA

__all__ = ["EGMLA", "MHA", "MLA"]
