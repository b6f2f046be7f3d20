"""Request bodies read the way JSON (and JSON Schema) mean their numbers.

JSON has one number type: `5.0` and `5` are the same number, and a JSON Schema `integer` accepts both.
Python's json module reads `5.0` as a float, which the strict request models would refuse for an integer
field (`top_k`, `n`, token ids, ...). Reading every integral number as an int makes `top_k: 5.0` mean 5;
float fields take an int unchanged, so nothing else changes. `5.5` stays a float and is still refused
where an integer is required.
"""
from __future__ import annotations

import json
from decimal import Decimal
from typing import Any


def _number(literal: str) -> int | float:
    value = float(literal)
    if not value.is_integer():
        return value
    if abs(value) < 2**63:  # decide on the literal itself: 1.0000000000000001 is no integer, 9007199254740993.0 is
        exact = Decimal(literal)
        return int(exact) if exact == exact.to_integral_value() else value
    return int(value)  # far beyond any integer field's range; never a huge Decimal expansion of "1e400000000"


def loads(raw: bytes | str) -> Any:
    return json.loads(raw, parse_float=_number)
