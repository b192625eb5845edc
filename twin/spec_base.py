"""The checks every settings model shares (scenario, what-ifs, live config): no inf or NaN, no true for a number."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def _numeric(annotation: Any) -> bool:
    """int or float, or Optional of either (not bool, not a union with other kinds)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return all(a in (int, float) for a in args)


def _numeric_list(annotation: Any) -> bool:
    """list[int] or list[float] (or Optional of one)."""
    members = [annotation] if typing.get_origin(annotation) is list else typing.get_args(annotation)
    return any(typing.get_origin(a) is list and typing.get_args(a) and _numeric(typing.get_args(a)[0])
               for a in members)


class NumbersChecked(BaseModel):
    """inf and NaN are no setting (`rate: .inf` put every arrival at t = 0), nor is true a number (pydantic's lax
    mode read `num_requests: true` as 1, and `[true]` as `[1]`)."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, f in cls.model_fields.items():
                v = data.get(name)
                if isinstance(v, bool) and _numeric(f.annotation):
                    raise ValueError(f"@{name}: expected a number, got {v!r}")
                if isinstance(v, list) and any(isinstance(x, bool) for x in v) and _numeric_list(f.annotation):
                    raise ValueError(f"@{name}: expected numbers, got {v!r}")
        return data
