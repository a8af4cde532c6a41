"""The declarative conversion engine: transforms, components chosen by prefix, and plan errors."""

import numpy as np
import pytest

from omnijax.checkpoint.name_tables import Component, Rule, convert_in_memory, param_shapes
from omnijax.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError

RULES = (
    Rule("conv.weight", "conv", "k C O", transform="conv1d"),
    Rule("patch.weight", "patch", "P O", transform="flatten_T", src_dims="O C k k"),
    Rule("blocks.{i}.fc.weight", "blocks/fc", "O O", transform="T"),
    Rule("blocks.{i}.fc.bias", "blocks/fc_bias", "O", when="bias"),
)


def _component(bias=True, prefix="enc."):
    return Component(name="enc", prefix=prefix, rules=RULES, dims={"k": 3, "C": 2, "O": 4, "P": 2 * 3 * 3},
                     num_layers=2, flags={"bias": bias})


def _tensors(rng, bias=True):
    t = {"thinker.enc.conv.weight": rng.standard_normal((4, 2, 3)),
         "thinker.enc.patch.weight": rng.standard_normal((4, 2, 3, 3))}
    for i in range(2):
        t[f"thinker.enc.blocks.{i}.fc.weight"] = rng.standard_normal((4, 4))
        if bias:
            t[f"thinker.enc.blocks.{i}.fc.bias"] = rng.standard_normal(4)
    return {k: v.astype(np.float32) for k, v in t.items()}  # exact after the float32 cast


def test_transforms_and_stacking():
    rng = np.random.default_rng(0)
    t = _tensors(rng)
    out = convert_in_memory(t, [_component()])["enc"]
    assert param_shapes(_component()) == {"conv": (3, 2, 4), "patch": (18, 4),
                                          "blocks": {"fc": (2, 4, 4), "fc_bias": (2, 4)}}
    w = t["thinker.enc.conv.weight"]
    assert all(out["conv"][j, c, o] == w[o, c, j] for j in range(3) for c in range(2) for o in range(4))
    np.testing.assert_array_equal(out["patch"], t["thinker.enc.patch.weight"].reshape(4, -1).T)
    np.testing.assert_array_equal(out["blocks"]["fc"][1], t["thinker.enc.blocks.1.fc.weight"].T)
    assert "fc_bias" not in convert_in_memory(_tensors(rng, bias=False), [_component(bias=False)])["enc"]["blocks"]


def test_plan_errors_name_the_tensor():
    rng = np.random.default_rng(1)
    t = _tensors(rng)
    with pytest.raises(MissingTensorError, match="thinker.enc.blocks.1.fc.bias"):
        convert_in_memory({k: v for k, v in t.items() if "1.fc.bias" not in k}, [_component()])
    with pytest.raises(UnexpectedTensorError, match="names layer 2"):
        convert_in_memory({**t, "thinker.enc.blocks.2.fc.weight": np.zeros((4, 4))}, [_component()])
    with pytest.raises(UnexpectedTensorError, match="maps to no parameter"):
        convert_in_memory({**t, "thinker.other.x": np.zeros(1)}, [_component()])
    with pytest.raises(ShapeMismatchError, match=r"patch.weight.*\(4, 18\).*\(4, 2, 3, 3\)"):
        convert_in_memory({**t, "thinker.enc.patch.weight": np.zeros((4, 18))}, [_component()])
    skipped = convert_in_memory({**t, "thinker.extra.y": np.zeros(1)}, [_component()], skip_prefixes=("extra.",))
    assert set(skipped) == {"enc"}


def test_flatten_rule_needs_source_dims():
    with pytest.raises(ValueError, match="src_dims"):
        Rule("p", "p", "P O", transform="flatten_T")
    with pytest.raises(ValueError, match="unknown transform"):
        Rule("p", "p", "P O", transform="rotate")
