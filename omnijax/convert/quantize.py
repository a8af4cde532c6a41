"""Weight-only quantisation at conversion time: `omnijax convert SRC DST --quantize int8|int4 [--group-size N]`
and, for a GGUF source, `--keep-quantized`.

The decoder's linear weights (`QUANTIZABLE`: the attention q/k/v/o projections, the dense MLP's gate/up/down and the
MoE experts' gate/up/down) are stored as `omnijax.kernels.quant.QuantizedWeight`s; the embedding, the LM head, the
router, the norms and the biases stay float (the embedding is a gather, the head and the router are few and
precision-sensitive).

- `--quantize int8`: symmetric int8, one scale per output channel (`Int8PerChannel`); with `--group-size N`, one scale
  per N input rows (`Int8Grouped(N)`).
- `--quantize int4`: asymmetric int4 with a scale and an offset per `--group-size` input rows (default 32, GGUF's
  Q4 block) (`Int4Grouped(N)`).
- `--keep-quantized` (GGUF only): a weight whose GGUF tensors (one per layer) all have one of the types Q8_0, Q4_0,
  Q4_1, Q4_K or Q6_K is repacked from the file's blocks without a float round trip (`omnijax.convert.gguf_quant`:
  the dequantised repack is gguf's dequantisation bit for bit); any other weight, a stack mixing types across layers
  included (a Q4_K_M file's Q4_K and Q6_K layers), is dequantised as without the option and, when `--quantize` is
  given too, requantised with that scheme. Each weight's fate is reported (a log line and the manifest's
  `source.quantization`).

Dequantising GGUF stays the default: it is the conversion transformers' GGUF loader performs (the tests' oracle), and
a quantised checkpoint has to be asked for because it changes the model's numbers (float32 logits of a Q4_1 file
equal either way only when the file's blocks are kept, not after requantising).

Every option is checked, and every weight's input width against the group size, before any tensor is read: a bad
option is a `ConvertError` naming it and nothing is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from omnijax.checkpoint import staged
from omnijax.convert import gguf_quant
from omnijax.convert.gguf import unpermute_rows
from omnijax.errors import ConvertError
from omnijax.kernels.quant import (
    GROUP_SIZES,
    Int4Grouped,
    Int8Grouped,
    Int8PerChannel,
    QuantizedWeight,
    Scheme,
    quantize,
)
from omnijax.models.config import DecoderConfig

QUANTIZE_CHOICES = ("int8", "int4")
DEFAULT_INT4_GROUP = 32
# decoder parameter (dotted path) -> the GGUF tensor (below `blk.N.`) it is read from
QUANTIZABLE = {"layers.q_proj": "attn_q.weight", "layers.k_proj": "attn_k.weight", "layers.v_proj": "attn_v.weight",
               "layers.o_proj": "attn_output.weight", "layers.gate_proj": "ffn_gate.weight",
               "layers.up_proj": "ffn_up.weight", "layers.down_proj": "ffn_down.weight",
               "layers.expert_gate": "ffn_gate_exps.weight", "layers.expert_up": "ffn_up_exps.weight",
               "layers.expert_down": "ffn_down_exps.weight"}


@dataclasses.dataclass(frozen=True)
class QuantizeOptions:
    """The conversion's quantisation options (all off: a float checkpoint).

    Attributes:
        quantize: "int8", "int4" or None.
        group_size: input rows per scale (None: per channel for int8, 32 for int4).
        keep_quantized: repack a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights instead of dequantising them.
    """

    quantize: str | None = None
    group_size: int | None = None
    keep_quantized: bool = False

    @property
    def active(self) -> bool:
        return self.quantize is not None or self.keep_quantized

    def scheme(self) -> Scheme | None:
        """The scheme `--quantize` asks for (None without it).

        Raises:
            ConvertError: an unknown `--quantize`, a `--group-size` without it or outside `GROUP_SIZES`.
        """
        if self.quantize is None:
            if self.group_size is not None:
                raise ConvertError(f"--group-size {self.group_size} needs --quantize int8|int4 (it sets the rows a "
                                   "scale of the requested scheme covers)")
            return None
        if self.quantize not in QUANTIZE_CHOICES:
            raise ConvertError(f"--quantize must be one of {QUANTIZE_CHOICES}, got {self.quantize!r}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ConvertError(f"--group-size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.quantize == "int8":
            return Int8PerChannel() if self.group_size is None else Int8Grouped(self.group_size)
        return Int4Grouped(DEFAULT_INT4_GROUP if self.group_size is None else self.group_size)


def _widths(shapes: dict, name: str) -> tuple[int, ...] | None:
    node: Any = shapes
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return tuple(node)


def check(options: QuantizeOptions, shapes: dict, *, gguf: bool) -> Scheme | None:
    """Checks the options against a decoder's parameter shapes (`param_shapes(config)`) before any tensor is read.

    Returns:
        The `--quantize` scheme, or None.

    Raises:
        ConvertError: a bad option (see `QuantizeOptions.scheme`), `--keep-quantized` for a source that is not GGUF,
            or a group size that does not divide a weight's input width (the weight and `--group-size` named).
    """
    scheme = options.scheme()
    if options.keep_quantized and not gguf:
        raise ConvertError("--keep-quantized applies to a GGUF source only (its Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K "
                           "blocks); this source is float: use --quantize int8|int4")
    for name in QUANTIZABLE:
        shape = _widths(shapes, name)
        if scheme is None or shape is None:
            continue
        rows = shape[-2]
        if rows % scheme.group_size(rows):
            raise ConvertError(f"--group-size {scheme.group_size(rows)} does not divide the input width {rows} of "
                               f"{name} {shape}; pick a group size that divides it")
    return scheme


def _read_layer(leaf: Any, index: int) -> np.ndarray:
    """Row `index` of a written parameter array (a `StagedArray` after `finish`, or an array)."""
    if isinstance(leaf, staged.StagedArray):
        leaf.finish()
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(leaf.path)}}, open=True,
                        read=True).result()
        return np.asarray(store[index].read().result())
    return np.asarray(leaf[index])


# One program per (row shape, scheme), compiled once: op by op, each new shape lowered and compiled a dozen.
_quantize_row = jax.jit(quantize, static_argnums=1)


def _quantize_stack(leaf: Any, scheme: Scheme) -> QuantizedWeight:
    """A stacked float weight `[L, ..., in, out]` quantised one leading row at a time into host arrays."""
    parts = [_quantize_row(jax.numpy.asarray(_read_layer(leaf, i)), scheme) for i in range(leaf.shape[0])]
    stack = [None if parts[0].offsets is None else np.stack([np.asarray(p.offsets) for p in parts])]
    return QuantizedWeight(np.stack([np.asarray(p.values) for p in parts]),
                           np.stack([np.asarray(p.scales) for p in parts]), stack[0], scheme)


def _repack_stack(file: Any, name: str, config: DecoderConfig, permuted_qk: bool) -> tuple[QuantizedWeight | None,
                                                                                              str]:
    """A stacked weight repacked from the GGUF's blocks, or `(None, why not)`."""
    tensors = [file.tensors.get(f"blk.{i}.{QUANTIZABLE[name]}") for i in range(config.num_layers)]
    tensors = [t for t in tensors if t is not None]
    types = sorted({t.tensor_type.name for t in tensors})
    if len(types) != 1 or types[0] not in gguf_quant.BLOCK_BYTES:
        return None, (f"GGUF type(s) {types} are not repacked (only {', '.join(gguf_quant.BLOCK_BYTES)}, one type "
                      "for all layers)")
    parts = []
    for t in tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # [..., out, in]
        data = np.asarray(t.data)
        if permuted_qk and name in ("layers.q_proj", "layers.k_proj"):
            heads = config.num_heads if name == "layers.q_proj" else config.num_kv_heads
            data = unpermute_rows(data.reshape(shape[0], -1), heads)
        parts.append(gguf_quant.from_gguf(data.reshape(-1), shape, types[0]))
    offsets = None if parts[0].offsets is None else np.stack([np.asarray(p.offsets) for p in parts])
    return QuantizedWeight(np.stack([p.values for p in parts]), np.stack([p.scales for p in parts]), offsets,
                           parts[0].scheme), f"repacked from GGUF {types[0]} without a float round trip"


def apply(params: dict, options: QuantizeOptions, scheme: Scheme | None, config: DecoderConfig, *,
          gguf_file: Any = None, permuted_qk: bool = False,
          log: Callable[[str], None] | None = None) -> tuple[dict, dict[str, str]]:
    """Replaces the quantisable leaves of a converted decoder tree by `QuantizedWeight`s.

    Args:
        params: the decoder's pure-dict tree (`StagedArray`s or arrays, float, already written).
        options: the conversion's options; scheme: `check`'s result.
        config: the decoder config.
        gguf_file: the checked GGUF file (`omnijax.convert.gguf.GGUFFile`) when `options.keep_quantized`.
        permuted_qk: the GGUF's q/k rows are in llama.cpp's rotary order (undone here as the float path does).
        log: receives one line per weight saying what became of it.

    Returns:
        `(tree, report)`: the new tree and, per quantised or dequantised weight, what was done.
    """
    note = log if log is not None else (lambda _: None)
    layers = dict(params["layers"])
    report: dict[str, str] = {}
    for name in QUANTIZABLE:
        key = name.split(".")[1]
        if key not in layers:
            continue
        qw = None
        if options.keep_quantized:
            qw, why = _repack_stack(gguf_file, name, config, permuted_qk)
            report[name] = why
        if qw is None and scheme is not None:
            qw = _quantize_stack(layers[key], scheme)
            report[name] = (report[name] + "; requantised" if name in report else "quantised") + \
                f" as {type(scheme).__name__}({getattr(scheme, 'size', 'per channel')}) from the float weights"
        elif qw is None:
            report[name] += "; dequantised to float"
        if qw is not None:
            layers[key] = qw
        note(f"{name}: {report[name]}")
    return {**params, "layers": layers}, report
