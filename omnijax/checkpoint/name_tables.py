"""Declarative conversion tables: where each Hugging Face tensor goes in an omnijax parameter tree.

A `Component` (the decoder, the audio tower, the vision tower) owns a tuple of `Rule`s, the sizes its shape symbols
stand for, and its layer count. `plan_conversion` maps every tensor name of a checkpoint to a (component, rule,
layer) from the headers alone (names and shapes), before any data is read; `fill` then copies tensor by tensor.
`convert_in_memory` runs the same plan on a dict of arrays (tests, small models).

This is the table language shared by the conversion loop (`omnijax.checkpoint.loop`) and the model families, which
hold the tables of their own parameter trees; it imports nothing but numpy and `omnijax.errors`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import numpy as np
import numpy.typing as npt

from omnijax.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError

__all__ = ["Component", "Plan", "Rule", "TRANSFORMS", "allocate", "convert_in_memory", "fill", "leaf",
           "param_shapes", "plan_conversion"]

# Torch layout -> omnijax layout.
TRANSFORMS: dict[str | None, Callable[[np.ndarray], np.ndarray]] = {
    None: lambda a: a,
    "T": lambda a: a.T,  # Linear [out, in] -> [in, out]
    "conv1d": lambda a: a.transpose(2, 1, 0),  # Conv1d [out, in, k] -> [k, in, out]
    "flatten_T": lambda a: a.reshape(a.shape[0], -1).T,  # Conv [out, c, ...] -> [c * ..., out]
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """Where one Hugging Face tensor goes.

    Attributes:
        hf_name: name below the component prefix; `{i}` stands for the layer index.
        path: `/`-separated path in the component's pure-dict parameter tree.
        dims: destination shape per layer, in symbols of `Component.dims` (e.g. "D Q").
        transform: a key of `TRANSFORMS` taking the torch layout to the omnijax layout.
        src_dims: the source shape in symbols, when `dims` and `transform` do not determine it (`flatten_T`).
        when: a `Component.flags` entry that must be True for the rule to apply, or None.
        layers: a `Component.layer_sets` entry: the (Hugging Face) layers that hold this tensor, stored in that
            order along the leading axis (e.g. only the MoE layers); None = all `num_layers`.

    A `{e}` in `hf_name` stands for an expert index: the destination gains an experts axis after the layers axis
    (`Component.num_experts` long), and each expert's tensor fills its row.
    """

    hf_name: str
    path: str
    dims: str
    transform: str | None = None
    src_dims: str | None = None
    when: str | None = None
    layers: str | None = None

    def __post_init__(self):
        if self.transform not in TRANSFORMS:
            raise ValueError(f"rule {self.hf_name!r}: unknown transform {self.transform!r}")
        if self.transform == "flatten_T" and self.src_dims is None:
            raise ValueError(f"rule {self.hf_name!r}: flatten_T needs src_dims")

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def experted(self) -> bool:
        return "{e}" in self.hf_name

    @property
    def pattern(self) -> re.Pattern:
        index = r"(0|[1-9][0-9]*)"
        text = re.escape(self.hf_name).replace(r"\{i\}", index.replace("(", "(?P<i>", 1))
        return re.compile(text.replace(r"\{e\}", index.replace("(", "(?P<e>", 1)) + r"\Z")

    def name_of(self, layer: int | None, expert: int | None) -> str:
        """The Hugging Face name of one (layer, expert) entry."""
        return self.hf_name.replace("{i}", str(layer)).replace("{e}", str(expert))

    def shape(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """Destination shape of one layer."""
        return tuple(dims[s] for s in self.dims.split())

    def source_shape(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """Expected Hugging Face shape."""
        if self.src_dims is not None:
            return tuple(dims[s] for s in self.src_dims.split())
        shape = self.shape(dims)
        if self.transform in ("T", "conv1d"):
            return shape[::-1]
        return shape


@dataclasses.dataclass(frozen=True)
class Component:
    """One parameter tree of a checkpoint and the table that fills it."""

    name: str
    prefix: str
    rules: tuple[Rule, ...]
    dims: Mapping[str, int]
    num_layers: int
    flags: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    layer_sets: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    num_experts: int = 0

    def active_rules(self) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.when is None or self.flags.get(r.when, False))

    def layers_of(self, rule: Rule) -> tuple[int, ...]:
        """The Hugging Face layers holding `rule`'s tensor, in storage order."""
        return tuple(range(self.num_layers)) if rule.layers is None else tuple(self.layer_sets[rule.layers])

    def leading(self, rule: Rule) -> tuple[int, ...]:
        """The destination's leading axes: layers (when layered), then experts (when experted)."""
        return (((len(self.layers_of(rule)),) if rule.layered else ()) +
                ((self.num_experts,) if rule.experted else ()))


def param_shapes(component: Component) -> dict[str, Any]:
    """The component's pure-dict tree as nested dicts of shape tuples (layered parameters lead with the layers)."""
    tree: dict[str, Any] = {}
    for rule in component.active_rules():
        *parents, leaf = rule.path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = component.leading(rule) + rule.shape(component.dims)
    return tree


def leaf(tree: dict, path: str) -> Any:
    """The node of `tree` at a `/`-separated path."""
    for part in path.split("/"):
        tree = tree[part]
    return tree


@dataclasses.dataclass(frozen=True)
class Plan:
    """The validated mapping: HF name -> (component, rule, layer or None); `skipped` counts by skipped prefix."""

    assign: dict[str, tuple[Component, Rule, tuple[int, ...]]]  # the last: index into the leading axes
    skipped: dict[str, int]


def plan_conversion(names: Iterable[str], shapes: Mapping[str, Sequence[int]], components: Sequence[Component], *,
                    strip_prefix: str = "", skip_prefixes: Sequence[str] = ()) -> Plan:
    """Maps every tensor to a table entry and checks that every entry is filled exactly once with the right shape.

    Args:
        names: tensor names of the checkpoint.
        shapes: their shapes.
        components: the components to fill; a name belongs to the component with the longest matching prefix.
        strip_prefix: an optional leading prefix (e.g. "thinker.") removed before matching.
        skip_prefixes: prefixes (after stripping) of tensors deliberately not converted; counted (under the name's
            own prefix, stripped part included), not errors.

    Raises:
        UnexpectedTensorError: a name matches no entry, names a layer beyond the config, or fills an entry twice.
        MissingTensorError: an entry (for some layer) has no tensor.
        ShapeMismatchError: a tensor's shape is not the one the config implies.
    """
    by_prefix = sorted(components, key=lambda c: len(c.prefix), reverse=True)
    patterns = {c.name: [(r, r.pattern) for r in c.active_rules()] for c in components}
    slots = {(c.name, r.path): {layer: row for row, layer in enumerate(c.layers_of(r))} for c in components
             for r in c.active_rules()}
    assign: dict[str, tuple[Component, Rule, tuple[int, ...]]] = {}
    filled: dict[tuple[str, str, tuple[int, ...]], str] = {}
    skipped: collections.Counter = collections.Counter()
    stripped = 0
    unstripped: dict[str, bool] = {}
    for name in names:
        local = name.removeprefix(strip_prefix) if strip_prefix else name
        stripped += local != name
        skip = next((p for p in skip_prefixes if local.startswith(p)), None)
        if skip is not None:
            skipped[name[: len(name) - len(local)] + skip] += 1  # counted under the name's own prefix
            continue
        component = next((c for c in by_prefix if local.startswith(c.prefix)), None)
        match = None
        if component is not None:
            inner = local[len(component.prefix):]
            match = next(((r, m) for r, p in patterns[component.name] if (m := p.match(inner))), None)
        if match is None:
            raise UnexpectedTensorError(f"tensor {name!r} maps to no parameter")
        rule, m = match
        index: tuple[int, ...] = ()
        if rule.layered:
            layer = int(m.group("i"))
            if layer >= component.num_layers:
                raise UnexpectedTensorError(f"tensor {name!r} names layer {layer} but the {component.name} has "
                                            f"{component.num_layers} layers")
            row = slots[component.name, rule.path].get(layer)
            if row is None:
                raise UnexpectedTensorError(f"tensor {name!r}: layer {layer} of the {component.name} holds no "
                                            f"{rule.hf_name.rsplit('.', 2)[-2]!r} tensor under this config "
                                            f"(its {rule.layers} layers are {component.layers_of(rule)})")
            index += (row,)
        if rule.experted:
            expert = int(m.group("e"))
            if expert >= component.num_experts:
                raise UnexpectedTensorError(f"tensor {name!r} names expert {expert} but the {component.name} has "
                                            f"{component.num_experts} experts")
            index += (expert,)
        key = (component.name, rule.path, index)
        if key in filled:
            raise UnexpectedTensorError(f"tensors {filled[key]!r} and {name!r} fill the same parameter")
        expected = rule.source_shape(component.dims)
        if tuple(shapes[name]) != expected:
            raise ShapeMismatchError(f"tensor {name!r} has shape {tuple(shapes[name])}, expected {expected}")
        filled[key] = name
        assign[name] = (component, rule, index)
        # a missing tensor is named as its component's tensors are (a full Qwen3-Omni's `talker.` has no `thinker.`)
        unstripped[component.name] = unstripped.get(component.name, False) or local == name
    missing = []
    for c in components:
        prefix = strip_prefix if stripped and not unstripped.get(c.name, False) else ""
        for r in c.active_rules():
            layers = list(enumerate(c.layers_of(r))) if r.layered else [(None, None)]
            experts = range(c.num_experts) if r.experted else (None,)
            for row, layer in layers:
                for e in experts:
                    index = tuple(i for i in (row, e) if i is not None)
                    if (c.name, r.path, index) not in filled:
                        missing.append(prefix + c.prefix + r.name_of(layer, e))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise MissingTensorError(f"checkpoint lacks tensor(s) {', '.join(map(repr, missing[:5]))}{more}")
    return Plan(assign, dict(skipped))


def fill(destination: Mapping[str, dict], name: str, array: np.ndarray, plan: Plan) -> None:
    """Copies one tensor, transformed and cast, into its place in `destination` (component name -> tree)."""
    component, rule, index = plan.assign[name]
    out = leaf(destination[component.name], rule.path)
    # the transform is a view (transpose, reshape); the leaf (a numpy array, or a `StagedArray` writing its storage)
    # casts as it copies, rounding as astype does
    out[index] = TRANSFORMS[rule.transform](array)


def convert_in_memory(tensors: Mapping[str, np.ndarray], components: Sequence[Component],
                      dtype: npt.DTypeLike = np.float32, *,
                      strip_prefix: str = "thinker.", skip_prefixes: Sequence[str] = ()) -> dict[str, dict]:
    """Converts a dict of Hugging Face tensors into each component's pure-dict tree of numpy arrays."""
    plan = plan_conversion(tensors, {k: np.shape(v) for k, v in tensors.items()}, components,
                           strip_prefix=strip_prefix, skip_prefixes=skip_prefixes)
    out = {c.name: allocate(param_shapes(c), lambda shape, _: np.zeros(shape, dtype)) for c in components}
    for name in plan.assign:
        fill(out, name, np.asarray(tensors[name]), plan)
    return out


def allocate(shapes: dict, make: Callable[[tuple[int, ...], str], Any], prefix: str = "") -> dict:
    """Builds a tree of arrays from a tree of shapes; `make(shape, dotted_name)` creates each leaf."""
    return {k: allocate(v, make, f"{prefix}{k}.") if isinstance(v, dict) else make(v, f"{prefix}{k}")
            for k, v in shapes.items()}
