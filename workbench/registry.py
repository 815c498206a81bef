"""A registry of named builders, each tagged with the modality of the data it handles.

Datasets (`workbench.data.registry`) and backbones (`workbench.backbones.registry`) each keep
one:

    BACKBONES = Registry("backbone")

    @BACKBONES.register("my_net", modality="image")
    def build_my_net(*, pretrained, weights_path, seed): ...

    BACKBONES.names("my_*")             # ["my_net"]
    BACKBONES.modality("my_net")        # "image"
    BACKBONES["my_net"]                 # build_my_net
    with BACKBONES.temporarily("tmp", build_my_net):   # registered inside the block only
        ...
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Literal, TypeVar, get_args

__all__ = ["MODALITIES", "Modality", "Registry"]

Modality = Literal["image", "text"]
MODALITIES: tuple[Modality, ...] = get_args(Modality)

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one `kind` ("dataset", "backbone"), each with a modality.

    Errors name the kind: "dataset 'x' is already registered",
    "unknown dataset 'x'; available: a, b".
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._modalities: dict[str, Modality] = {}

    def register(self, name: str, modality: Modality = "image") -> Callable[[T], T]:
        """Decorator adding the decorated object under `name`; returns it unchanged.

        A bad modality fails here, at the decorator's creation; a taken name when it is applied.
        """
        _check_modality(modality)

        def decorate(entry: T) -> T:
            self.add(name, entry, modality)
            return entry

        return decorate

    def add(self, name: str, entry: T, modality: Modality = "image") -> None:
        """Adds `entry` under `name`; ValueError for a taken name or a bad modality."""
        _check_modality(modality)
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        self._modalities[name] = modality

    def remove(self, name: str) -> None:
        """Drops `name`; ValueError (listing the known names) if it is not registered."""
        self.check(name)
        del self._entries[name], self._modalities[name]

    @contextmanager
    def temporarily(self, name: str, entry: T, modality: Modality = "image") -> Iterator[T]:
        """Registers `entry` under `name` for the `with` block only (for tests)."""
        self.add(name, entry, modality)
        try:
            yield entry
        finally:
            self.remove(name)

    def names(self, pattern: str = "*", modality: Modality | None = None) -> list[str]:
        """Registered names matching the shell-style `pattern` (and `modality`), sorted."""
        matching = fnmatch.filter(self._entries, pattern)
        return sorted(n for n in matching if modality is None or self._modalities[n] == modality)

    def check(self, name: str) -> None:
        """ValueError listing the registered names unless `name` is one of them."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")

    def modality(self, name: str) -> Modality:
        """`image` or `text` for a registered name."""
        self.check(name)
        return self._modalities[name]

    def __getitem__(self, name: str) -> T:
        self.check(name)
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _check_modality(modality: str) -> None:
    if modality not in MODALITIES:
        raise ValueError(
            f"modality must be {' or '.join(map(repr, MODALITIES))}, got {modality!r}")
