"""One registry for every extension point: retention policies, prefill selectors, decoding strategies, paging modes.

An extension point is a `typing.Protocol` (what an implementation must have) and a `Registry` of the named
implementations that ship with omnijax (classes, each with a `name` class attribute, added by the `register`
decorator). A registry is a read-only mapping `name -> class`; `create("name:key=value,...")` is the one way a name
written by a user (Python, a command line, a request) becomes an object, with its settings checked against the
class's fields; `check(obj)` accepts any object that has the protocol's methods (registered or not) and refuses a
name, a class or anything else with a message that lists what is registered.

    POLICIES = Registry("retention policy", RetentionPolicy, hint="omnijax.retention.get_policy")

    @POLICIES.register
    @dataclasses.dataclass(frozen=True)
    class MyPolicy: ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Iterator, Mapping, TypeVar

__all__ = ["Registry", "parse_spec", "parse_value"]

T = TypeVar("T")
C = TypeVar("C", bound=type)


def parse_value(text: str) -> Any:
    """A setting's value as a command line writes it: int, float, true/false, none, or the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`"name:key=value,key=value"` -> `(name, {key: value})` (values by `parse_value`).

    Raises:
        ValueError: a setting that is not `key=value`.
    """
    name, _, args = spec.partition(":")
    settings = {}
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"setting {item!r} in {spec!r} is not key=value")
        settings[key.strip()] = parse_value(value)
    return name.strip(), settings


class Registry(Mapping[str, type], Generic[T]):
    """The named implementations of one extension point (module docstring).

    Args:
        kind: what an implementation is, in messages ("retention policy").
        protocol: the methods an implementation must have (their names are checked by `check`).
        aliases: other names accepted by `create` and `[]` for a registered name.
        hint: the function users call to build one by name, named in refusals (default `<registry>.create`).
    """

    def __init__(self, kind: str, protocol: type, *, aliases: Mapping[str, str] | None = None,
                 hint: str | None = None):
        self.kind, self.protocol = kind, protocol
        self.aliases = dict(aliases or {})
        self.hint = hint
        self._classes: dict[str, type] = {}
        # What `check` asks of an object: the protocol's callables (methods), not its data attributes.
        self.methods = tuple(sorted(name for name, value in vars(protocol).items()
                                    if callable(value) and not name.startswith("_")))

    # -------------------------------------------------------------------------------------------- Mapping
    def __getitem__(self, name: str) -> type:
        key = self.aliases.get(name, name)
        if key not in self._classes:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._classes)}"
                           + (f" (aliases: {sorted(self.aliases)})" if self.aliases else ""))
        return self._classes[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.aliases.get(name, name) in self._classes

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {sorted(self._classes)})"

    # ---------------------------------------------------------------------------------------------- adding
    def register(self, cls: C) -> C:
        """Class decorator: adds `cls` under its `name` class attribute.

        Raises:
            TypeError: `cls` has no string `name`, or lacks a method of the protocol.
            ValueError: another class holds that name already.
        """
        name = vars(cls).get("name", getattr(cls, "name", None))
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} class needs a `name` class attribute (a string), {cls.__name__} has "
                            f"{name!r}")
        missing = [m for m in self.methods if not callable(getattr(cls, m, None))]
        if missing:
            raise TypeError(f"{cls.__name__} is not a {self.kind}: it lacks {missing}")
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"{self.kind} name {name!r} is taken by {self._classes[name].__qualname__}")
        self._classes[name] = cls
        return cls

    # ------------------------------------------------------------------------------------------------ using
    def create(self, spec: str, *, defaults: Mapping[str, Mapping[str, Any]] | None = None,
               **settings: Any) -> T:
        """The object a name stands for: `spec` is a registered name (or alias), optionally with
        `:key=value,...` settings as a command line writes them; keyword `settings` are added to those; `defaults`
        maps a registered name to settings used when neither the spec nor the keywords set them.

        Raises:
            TypeError: `spec` is not a string.
            KeyError: an unknown name (the message lists the registered ones).
            ValueError: a malformed setting, or a setting the class does not have (the message lists its fields).
        """
        if not isinstance(spec, str):
            raise TypeError(f"a {self.kind} is named by a string, got {spec!r}")
        name, parsed = parse_spec(spec)
        cls = self[name]
        key = self.aliases.get(name, name)
        chosen = {**(defaults or {}).get(key, {}), **parsed, **settings}
        if dataclasses.is_dataclass(cls):
            fields = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = sorted(set(chosen) - fields)
            if unknown:
                raise ValueError(f"{key} has no setting(s) {unknown}; its settings are {sorted(fields)}")
        return cls(**chosen)

    def check(self, obj: Any, what: str | None = None) -> T:
        """Returns `obj` if it has the protocol's methods; refuses a registered name, a class or anything else,
        saying what to pass instead.

        Args:
            obj: the candidate.
            what: the parameter's name in messages (default the kind).
        """
        what = what or self.kind
        how = self.hint or "Registry.create"
        if isinstance(obj, str):
            raise TypeError(f"{what} must be a {self.kind} object, not the name {obj!r}: use {how}({obj!r}) or its "
                            f"class (registered: {sorted(self._classes)})")
        if isinstance(obj, type):
            raise TypeError(f"{what} must be a {self.kind} object, not the class {obj.__name__}: use "
                            f"{obj.__name__}(...)")
        missing = [m for m in self.methods if not callable(getattr(obj, m, None))]
        if missing:
            wanted = " and ".join(filter(None, (", ".join(self.methods[:-1]), self.methods[-1])))
            raise TypeError(f"{what} must be a {self.kind} object (with {wanted}), got {obj!r}")
        return obj

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._classes)

