"""Retention policy contract and registry.

A policy is a frozen dataclass of static hyperparameters. `trim(kv, next_pos)` is pure and jittable: it returns the
new cache, the new next-position cursor and the number of evicted tokens per sequence. The streaming scan calls it
after every chunk; a policy decides with `lax.cond` (never Python branching on traced values) whether to act.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV


class RetentionPolicy(Protocol):
    name: str

    def trim(self, kv: PagedKV, next_pos: jax.Array) -> tuple[PagedKV, jax.Array, jax.Array]:
        """Returns `(kv, next_pos [B], evicted [B] int32)`."""


REGISTRY: dict[str, Callable[..., RetentionPolicy]] = {}


def register(cls):
    """Class decorator adding a policy to `REGISTRY` under its `name`."""
    REGISTRY[cls.name] = cls
    return cls


def get_policy(name: str, **hyperparameters) -> RetentionPolicy:
    if name not in REGISTRY:
        raise KeyError(f"unknown retention policy {name!r}; registered: {sorted(REGISTRY)}")
    return REGISTRY[name](**hyperparameters)


@register
@dataclasses.dataclass(frozen=True)
class NoSlide:
    """Full context: never evicts."""

    name = "no_slide"

    def trim(self, kv: PagedKV, next_pos: jax.Array) -> tuple[PagedKV, jax.Array, jax.Array]:
        return kv, next_pos, jnp.zeros(next_pos.shape, jnp.int32)
