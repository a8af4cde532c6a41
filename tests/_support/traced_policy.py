"""A retention policy's `plan`, compiled once for many settings: its numeric settings become traced arguments.

A policy is a frozen dataclass whose settings are Python constants of the programs it traces, so jitting `plan` with
the policy static compiles one program per distinct setting, and calling it eagerly dispatches (and compiles) every
primitive on its own, once per shape. A randomised check of hundreds of settings against a plain-Python reading paid
for either. `plan_traced` evaluates the same `plan` method of an already built (so already validated) policy with
the settings named in `traced` passed as jit arguments: one program per slot shape and remaining static settings.
It only serves settings the plan uses arithmetically; one it branches on in Python must stay static (tracing fails
loudly otherwise, it cannot pass silently).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from omnijax.retention import SequenceView, SlotFeatures


@functools.partial(jax.jit, static_argnames=("kind", "static"))
def _plan(kind: type, static: tuple[tuple[str, Any], ...], numbers: dict[str, Any], view: SequenceView,
          features: SlotFeatures) -> jax.Array:
    policy: Any = object.__new__(kind)  # the settings were validated when the caller's policy was built
    for name, value in (*static, *numbers.items()):
        object.__setattr__(policy, name, value)
    return policy.plan(view, features)


def plan_traced(policy: Any, view: SequenceView, features: SlotFeatures, traced: tuple[str, ...]) -> jax.Array:
    """`policy.plan(view, features)` with the settings `traced` (field names) traced, the others static.

    Args:
        policy: a built retention policy (a frozen dataclass with a `plan` method).
        view: the cache's sequence view.
        features: the cache's slot features.
        traced: the fields passed as traced scalars (numbers the plan only computes with).

    Returns:
        The plan's keep mask, as `policy.plan` returns it.
    """
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    unknown = set(traced) - set(fields)
    if unknown:
        raise ValueError(f"{type(policy).__name__} has no setting {sorted(unknown)}; its settings: {sorted(fields)}")
    numbers = {name: fields.pop(name) for name in traced}
    return _plan(type(policy), tuple(sorted(fields.items())), numbers, view, features)
