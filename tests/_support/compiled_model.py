"""Test-side helpers that run a model function compiled, once per model structure, shapes and static arguments.

A test that calls a decoder's pieces eagerly (a one-shot forward, one layer's projections, a decode step) dispatches
every primitive as its own XLA program. `compiled(fn)` runs `fn(model, *args)` under `jax.jit` with the model split
into its structure (static) and its weights (arguments), the way the package's own compiled entry points take it, so
the weights are not baked into the program and one program serves every call of the same shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx


def compiled(fn: Callable[..., Any], *, static_argnames: tuple[str, ...] = ()) -> Callable[..., Any]:
    """`fn(model, *args, **kwargs)`, compiled; `static_argnames` name keyword arguments that are static.

    Args:
        fn: a function of an nnx model and arrays (pytrees of arrays) returning arrays.
        static_argnames: keyword arguments of `fn` that select the program (ints, strings, settings).

    Returns:
        A function with `fn`'s signature.
    """

    @functools.partial(jax.jit, static_argnames=("graphdef", *static_argnames))
    def run(params: nnx.State, *args: Any, graphdef: Any, **kwargs: Any) -> Any:
        return fn(nnx.merge(graphdef, params), *args, **kwargs)

    @functools.wraps(fn)
    def call(model: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        graphdef, params = nnx.split(model)
        return run(params, *args, graphdef=graphdef, **kwargs)

    return call
