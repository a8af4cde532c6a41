"""Lower a function for the cuda platform on a machine without a GPU, to check that Pallas kernels reach Triton.

`lower_for_cuda(fn, *args)` returns the lowered HLO text; `has_triton_call(text)` tells whether it holds the Triton
custom call. Lowering catches Triton-incompatible kernel code (non-power-of-two blocks, unsupported primitives); it
cannot catch what only the GPU compiler sees (ptxas, shared memory, registers).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


def _lower(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lower_for_cuda(fn: Callable[..., Any], *args: jax.Array | jax.ShapeDtypeStruct,
                   device_kind: str = "NVIDIA H100 80GB HBM3", num_cores: int = 132) -> str:
    """HLO text of `fn(*args)` lowered for cuda. `args` may be arrays or `jax.ShapeDtypeStruct`s.

    If lowering refuses because no GPU device exists, it is retried under an abstract mesh that describes one
    (`device_kind`, `num_cores`); the arguments are created by the caller, outside that mesh.
    """
    try:
        return _lower(fn, args)
    except Exception as err:  # noqa: BLE001 - retried once, re-raised if the retry fails too
        if "gpu" not in str(err).lower() and "cuda" not in str(err).lower():
            raise
        first = err
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
            platform="gpu", device_kind=device_kind, num_cores=num_cores))
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            return _lower(fn, args)
    except Exception as err:  # noqa: BLE001
        raise err from first


def has_triton_call(text: str) -> bool:
    """Whether lowered HLO text contains the Pallas Triton custom call."""
    return TRITON_CALL_TARGET in text
