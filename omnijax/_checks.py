"""Checks and config plumbing every layer shares: power-of-two sizes, the dtype table, and the JSON round trip of
frozen-dataclass configs."""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, Self, cast

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_power_of_two(name: str, value) -> None:
    """Refuses a `value` (page size, block size, ...) that is not a positive integer power of two, naming it `name`."""
    if not isinstance(value, numbers.Integral) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value!r}")


class JsonConfig:
    """What every frozen-dataclass config shares: `replace`, the jnp dtype, and a JSON round trip that refuses
    unknown fields (tuples are stored as lists and read back as tuples)."""

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (the dataclass's own validation runs again)."""
        return dataclasses.replace(cast(Any, self), **changes)

    def to_json(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}; known fields are {sorted(names)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)
