"""One registry for every extension point (`omnijax.registry.Registry`), checked as one matrix: every registered
retention policy, prefill selector, decoding strategy and paging mode is found by its name, has its protocol's
methods, builds from its name when it has defaults, and is accepted by its registry's check; names, classes and
other objects are refused with messages that say what to pass; the registry refuses bad registrations."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol

import pytest

import omnijax.models.minicpmo.duplex  # noqa: F401  registers MiniCPM-o's duplex rule with the strategies
from omnijax.decoding import STRATEGIES, Greedy, check_decoding
from omnijax.paging import MODES, PAGING_MODES, Paging
from omnijax.prefill.selectors import REGISTRY as SELECTORS
from omnijax.registry import Registry, parse_spec
from omnijax.retention.base import REGISTRY as POLICIES
from omnijax.retention.base import check_policy

REGISTRIES = {"retention": POLICIES, "prefill": SELECTORS, "decoding": STRATEGIES, "paging": MODES}
MATRIX = [(kind, name) for kind, registry in REGISTRIES.items() for name in registry]


def test_every_extension_point_ships_its_implementations():
    assert {"no_slide", "sink_window", "omnipick", "unit_fifo", "h2o"} <= set(POLICIES)
    assert {"snapkv", "chunkkv", "keydiff"} <= set(SELECTORS)
    assert {"greedy", "sampling", "row_sampling", "minicpmo_duplex"} <= set(STRATEGIES)
    assert PAGING_MODES == ("native", "tile_skip", "ordered_suffix", "eager") == tuple(MODES)


def _required(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING] if dataclasses.is_dataclass(cls) else []


@pytest.mark.parametrize("kind,name", MATRIX)
def test_each_registered_class_keeps_its_contract(kind, name):
    registry = REGISTRIES[kind]
    cls = registry[name]
    assert cls.name == name and name in registry
    assert registry.methods and all(callable(getattr(cls, m)) for m in registry.methods)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # static: part of the compiled program
    if not _required(cls):
        obj = registry.create(name)
        assert isinstance(obj, cls) and registry.check(obj) is obj
        hash(obj)  # hashable, like every static argument of a jitted function
    with pytest.raises(TypeError, match="not the name"):
        registry.check(name)
    with pytest.raises(TypeError, match=f"not the class {cls.__name__}"):
        registry.check(cls)
    with pytest.raises(KeyError, match=f"unknown {registry.kind} 'no_such_thing'"):
        registry.create("no_such_thing")


def test_create_parses_settings_and_refuses_unknown_ones():
    assert parse_spec("sink_window:sink=2, window=8,flag=true,x=none,s=abc") == (
        "sink_window", {"sink": 2, "window": 8, "flag": True, "x": None, "s": "abc"})
    assert STRATEGIES.create("sampling:temperature=0.5,top_k=3", seed=7).top_k == 3
    assert MODES.create("ordered_suffix:min_pages=2").min_pages == 2
    with pytest.raises(ValueError, match=r"greedy has no setting\(s\) \['temperature'\]"):
        STRATEGIES.create("greedy:temperature=1")
    with pytest.raises(ValueError, match="is not key=value"):
        STRATEGIES.create("greedy:3")
    with pytest.raises(TypeError, match="named by a string"):
        MODES.create(3)


def test_checks_refuse_what_is_not_an_implementation():
    assert check_decoding(Greedy()) == Greedy()
    with pytest.raises(TypeError, match=r"decoding must be a decoding strategy object \(with select and warp\)"):
        check_decoding(object())
    with pytest.raises(TypeError, match=r"policy must be a retention policy object.*get_policy\('omnipick'\)"):
        check_policy("omnipick")
    with pytest.raises(ValueError, match=r"unknown paging mode 'fast'; available: \['eager', 'native'"):
        Paging("fast")
    assert Paging("ordered_suffix", min_pages=3).mode_object == MODES.create("ordered_suffix", min_pages=3)


def test_the_registry_refuses_bad_registrations():
    class Shape(Protocol):
        name: ClassVar[str]

        def area(self) -> float:
            ...

    shapes: Registry[Shape] = Registry("shape", Shape)

    @shapes.register
    @dataclasses.dataclass(frozen=True)
    class Square:
        side: float = 1.0
        name: ClassVar[str] = "square"

        def area(self) -> float:
            return self.side ** 2

    assert shapes.create("square:side=3").area() == 9 and list(shapes) == ["square"] and len(shapes) == 1
    shapes.register(Square)  # the same class again: nothing changes

    class Impostor:
        name = "square"

        def area(self) -> float:
            return 0.0

    class Nameless:
        def area(self) -> float:
            return 0.0

    class Lazy:
        name = "lazy"

    with pytest.raises(ValueError, match="'square' is taken by"):
        shapes.register(Impostor)
    with pytest.raises(TypeError, match="needs a `name` class attribute"):
        shapes.register(Nameless)
    with pytest.raises(TypeError, match=r"Lazy is not a shape: it lacks \['area'\]"):
        shapes.register(Lazy)
    assert list(shapes) == ["square"]  # every refusal left the registry as it was
