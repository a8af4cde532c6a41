"""Choose the kernel a loaded model's quantised weights run: XLA's formulations or the int4 Pallas matmul.

`set_matmul_kernel(model, "pallas")` marks every quantised decoder weight (attention, dense MLP and experts) of a
loaded model to run `omnijax.kernels.int4_matmul` (Triton on GPU, the Pallas interpreter on CPU) whenever the
decoder multiplies by it; `"xla"` puts them back (the default after `omnijax.load`). It is a runtime choice: the
checkpoint stores codes, scales and offsets, not the kernel, and a saved model loads with "xla" again.

It is an explicit setting because the kernel has not been compiled or timed on a GPU here (no GPU was lent); until
it is, XLA's dense formulation stays the default everywhere. A model whose quantised weights are not all int4 (an
int8 checkpoint, or Q6_K blocks kept beside Q4_K ones) is refused, naming the weights, rather than run half on the
kernel.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from omnijax.kernels.quant import KERNELS, QuantizedWeight, with_kernel


def _params(model: Any) -> list[tuple[str, nnx.Param]]:
    """The decoder's parameters holding a `QuantizedWeight`, with their paths (stacked or split layers alike)."""
    decoder = getattr(model, "decoder", model)
    if not isinstance(decoder, nnx.Module):
        raise TypeError(f"set_matmul_kernel takes a loaded model (omnijax.load) or a Decoder, got "
                        f"{type(model).__name__}")
    return [("decoder." + ".".join(map(str, path)), param) for path, param in nnx.iter_graph(decoder)
            if isinstance(param, nnx.Param) and isinstance(param[...], QuantizedWeight)]


def matmul_kernels(model: Any) -> dict[str, str]:
    """Each quantised decoder weight's kernel by path ({} for a float model)."""
    return {path: getattr(param[...], "kernel") for path, param in _params(model)}


def set_matmul_kernel(model: Any, kernel: str) -> Any:
    """Sets every quantised decoder weight of `model` to run `kernel` ("xla" or "pallas"), in place; returns `model`.

    Raises:
        ValueError: an unknown kernel; "pallas" on a model without quantised weights, or with quantised weights that
            are not `Int4Grouped` (named). Nothing is changed then.
        TypeError: `model` is neither a loaded model nor a `Decoder`.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    params = _params(model)
    if kernel == "pallas" and not params:
        raise ValueError("kernel='pallas' runs quantised int4 weights, and this model holds none (convert it with "
                         "--quantize int4, or load an int4 checkpoint)")
    values = with_kernel({path: param[...] for path, param in params}, kernel)  # checks all before any is set
    for path, param in params:
        param.set_value(values[path])
    return model
