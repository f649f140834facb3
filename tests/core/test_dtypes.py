"""egmla.dtypes: the one place dtype names are parsed and printed."""

from __future__ import annotations

import pytest
import torch

from egmla.dtypes import REPORT_DTYPES, WEIGHT_DTYPES, dtype_name, parse_dtype, short_name


@pytest.mark.parametrize("name", REPORT_DTYPES)
def test_names_round_trip(name):
    dtype = parse_dtype(name, REPORT_DTYPES)
    assert isinstance(dtype, torch.dtype) and dtype_name(dtype) == name
    assert parse_dtype(short_name(dtype), REPORT_DTYPES, aliases=True) is dtype
    assert parse_dtype(name.upper(), REPORT_DTYPES) is dtype


@pytest.mark.parametrize("name, accepted, aliases", [
    ("bf16", WEIGHT_DTYPES, False),  # short names only with aliases
    ("float8_e4m3fn", WEIGHT_DTYPES, True),  # not a weight dtype
    ("int4", REPORT_DTYPES, True), ("", WEIGHT_DTYPES, False)])
def test_a_name_outside_the_accepted_ones_is_refused_listing_them(name, accepted, aliases):
    with pytest.raises(ValueError, match=f"unknown dtype {name!r}; accepted: .*float32"):
        parse_dtype(name, accepted, aliases=aliases)
