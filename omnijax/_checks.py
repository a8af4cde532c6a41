"""Checks and config plumbing every layer shares: power-of-two sizes, the dtype table, and the JSON round trip of
frozen-dataclass configs."""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Iterable
from typing import Any, Self, cast

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_power_of_two(name: str, value) -> None:
    """Refuses a `value` (page size, block size, ...) that is not a positive integer power of two, naming it `name`."""
    if not isinstance(value, numbers.Integral) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value!r}")


def _lists(value: Any) -> Any:
    """Tuples to JSON lists, nested ones included."""
    return [_lists(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value: Any) -> Any:
    """JSON lists back to tuples, nested ones included (a config's tuple fields must stay hashable)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class JsonConfig:
    """What every frozen-dataclass config shares: `replace`, the jnp dtype, and a JSON round trip that refuses
    unknown fields (tuples are stored as lists and read back as tuples, at every depth)."""

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (the dataclass's own validation runs again)."""
        return dataclasses.replace(cast(Any, self), **changes)

    def to_json(self) -> dict[str, Any]:
        return {f.name: _lists(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}; known fields are {sorted(names)}")
        return cls(**{k: _tuples(v) for k, v in data.items()})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)


def is_positive_int(value: Any) -> bool:
    """Whether `value` is an integer >= 1 (numpy integers count; a bool does not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_config_fields(config: Any, error: Any, *, positive: Iterable[str] = (),
                        positive_tuples: Iterable[str] = ()) -> None:
    """The checks every model-part config starts with: a known `dtype`, positive integer sizes, and non-empty tuples
    of positive integers.

    Args:
        config: a frozen-dataclass config with a `dtype` field.
        error: `error(field, value, reason)` builds the exception raised (each config names its own error type).
        positive: fields that must be positive integers.
        positive_tuples: fields that must be non-empty tuples of positive integers.

    Raises:
        whatever `error` builds, for the first offending field (dtype first, then the fields in the order given).
    """
    if config.dtype not in DTYPES:
        raise error("dtype", config.dtype, f"must be one of {sorted(DTYPES)}")
    for name in positive:
        if not is_positive_int(value := getattr(config, name)):
            raise error(name, value, "must be a positive integer")
    for name in positive_tuples:
        value = getattr(config, name)
        if not isinstance(value, tuple) or not value or not all(is_positive_int(v) for v in value):
            raise error(name, value, "must be a non-empty tuple of positive integers")


def int_fields(config_type: Any, *, but: Iterable[str] = ()) -> tuple[str, ...]:
    """The names of a dataclass's fields annotated `int` (the annotation as written, under postponed evaluation),
    but those in `but`."""
    return tuple(f.name for f in dataclasses.fields(config_type) if f.type in ("int", int) and f.name not in set(but))
