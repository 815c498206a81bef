"""Settings as data: a method's or data module's constructor arguments, some of them frozen
dataclasses (`LocalTraining`, `Compression`, `Federation`, ...), to plain values and back.

- `plain(value)`: numbers, strings, lists and dicts only (dataclasses become dicts, tuples
  lists, paths strings): what a checkpoint compares, JSON carries to a Flower node and a logger
  records;
- `init_arguments(obj)`: the arguments an object was built with (`hparams_initial`, without the
  command line's private `_class_path` entries);
- `construct(cls, arguments)`: `cls(**arguments)` from plain values, turning dicts back into the
  dataclasses the signature names (following `**kwargs` into the base classes, as the command
  line does).
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any


def plain(value: Any, *, strict: bool = False) -> Any:
    """`value` as plain data: dataclasses become dicts, tuples lists, paths strings; anything else
    not a number, string, bool or None becomes its repr (`strict`: a TypeError naming it)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name), strict=strict) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): plain(item, strict=strict) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, strict=strict) for item in value]
    if isinstance(value, Path):
        return str(value)
    if strict:
        raise TypeError(f"{type(value).__name__} {value!r} is not plain data (numbers, strings, lists, dicts, "
                        "dataclasses)")
    return repr(value)


def init_arguments(obj: Any) -> dict[str, Any]:
    """The arguments `obj` (a method or data module) was built with, without the CLI's private ones."""
    return {key: value for key, value in obj.hparams_initial.items() if not key.startswith("_")}


def _signature_hints(cls: type) -> dict[str, Any]:
    """The annotated parameters of `cls`'s constructor and, where it takes `**kwargs`, of its bases'."""
    hints: dict[str, Any] = {}
    for owner in inspect.getmro(cls):
        if "__init__" not in vars(owner):
            continue
        init = vars(owner)["__init__"]  # the class's own (checked above), as `owner.__init__` gives it
        found = typing.get_type_hints(init)
        hints.update({name: hint for name, hint in found.items() if name not in hints})
        parameters = inspect.signature(init).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return hints


def construct(cls: type, arguments: dict[str, Any]) -> Any:
    """`cls(**arguments)`, dicts turned back into the dataclasses the signature names."""
    hints = _signature_hints(cls)
    kwargs = {}
    for name, value in arguments.items():
        hint = hints.get(name)
        if isinstance(value, dict) and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            value = hint(**value)
        kwargs[name] = value
    return cls(**kwargs)
