"""What a ClientApp needs to rebuild a run, and tensors in Flower records.

- `RunSpec`: the method and data classes (names exported by `workbench.methods` /
  `workbench.data`, nothing else) with their init arguments as JSON.
- `to_record` / `from_record`: named tensors <-> an `ArrayRecord` (numpy .npy bytes per array).
- `half_state` / `restore_half`: every buffer and parameter of a client half (persistent or not:
  DeepAFL's Φ cache, Ditto's personal heads, error feedback), kept by a node between messages.
"""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from lightning import LightningDataModule
from torch import Tensor, nn

from workbench import data as data_classes
from workbench import methods as method_classes
from workbench.methods.base import FederatedMethod
from workbench.settings import construct, init_arguments, plain


def _init_args(module) -> str:
    """A module's init arguments as JSON, without the CLI's `_class_path`/`_instantiator` entries."""
    try:
        return json.dumps(plain(init_arguments(module), strict=True), sort_keys=True)
    except TypeError as error:
        raise TypeError(f"{type(module).__name__}'s init arguments reach the clients as JSON (numbers, "
                        f"strings, lists, dicts, dataclasses): {error}") from error


def _is_method(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, FederatedMethod) and value is not FederatedMethod


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The method and data classes with their init arguments as JSON: all a ClientApp needs to
    rebuild both (the method from its settings, never from learned state)."""

    method: str
    method_args: str
    data: str
    data_args: str

    @classmethod
    def of(cls, method: FederatedMethod, datamodule) -> RunSpec:
        return cls(type(method).__name__, _init_args(method), type(datamodule).__name__, _init_args(datamodule))

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(dataclasses.asdict(self))

    @classmethod
    def from_record(cls, record: ConfigRecord) -> RunSpec:
        return cls(**{field.name: text(record, field.name) for field in dataclasses.fields(cls)})

    def build_method(self) -> FederatedMethod:
        # Only classes the package exports: a message never names arbitrary code to run.
        method_class = getattr(method_classes, self.method, None)
        if self.method not in method_classes.__all__ or not _is_method(method_class):
            raise ValueError(f"unknown method {self.method!r}; this install has {method_classes.__all__}")
        return construct(cast(type, method_class), json.loads(self.method_args))

    def build_data(self) -> LightningDataModule:
        data_class = getattr(data_classes, self.data, None)
        if self.data not in data_classes.__all__ or not (
                isinstance(data_class, type) and issubclass(data_class, LightningDataModule)):
            raise ValueError(f"unknown data module {self.data!r}; this install has {data_classes.__all__}")
        return construct(data_class, json.loads(self.data_args))


# ---- values and tensors in records ---------------------------------------------------------------
def number(record: MetricRecord | ConfigRecord, key: str) -> float:
    """A number kept in a record (a report's count, a round's index)."""
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"record entry {key!r} holds {type(value).__name__}, not a number")
    return float(value)


def numbers(record: MetricRecord) -> dict[str, float]:
    """A metric record's numbers (sums over clients), by name."""
    return {key: number(record, key) for key in record}


def text(record: ConfigRecord, key: str) -> str:
    """A string kept in a config record."""
    value = record[key]
    if not isinstance(value, str):
        raise TypeError(f"record entry {key!r} holds {type(value).__name__}, not a string")
    return value


def flag(record: ConfigRecord, key: str) -> bool:
    """A bool kept in a config record."""
    value = record[key]
    if not isinstance(value, bool):
        raise TypeError(f"record entry {key!r} holds {type(value).__name__}, not a bool")
    return value



def to_record(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """Named tensors -> an ArrayRecord (CPU copies, in the given order)."""
    return ArrayRecord(OrderedDict((name, value.detach().cpu()) for name, value in tensors.items()))


def from_record(record: ArrayRecord) -> dict[str, Tensor]:
    """An ArrayRecord -> named tensors (writable copies)."""
    return {name: value.clone() for name, value in record.to_torch_state_dict().items()}


def half_state(half: nn.Module) -> dict[str, Tensor]:
    """Every buffer and parameter of a client half, persistent or not, by qualified name."""
    state = {name: value for name, value in half.named_buffers() if value is not None}
    state.update({name: value.detach() for name, value in half.named_parameters()})
    return state


@torch.no_grad()
def restore_half(half: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Put back what `half_state` saved into a freshly built half: copied in place where the fresh
    tensor has the saved shape and dtype (whatever refers to it sees the kept state), replaced
    where the fit found another shape (e.g. a cache allocated in a later round)."""
    for name, value in state.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = half.get_submodule(owner_name) if owner_name else half
        parameter = owner._parameters.get(attribute)
        if parameter is not None:
            if parameter.shape == value.shape:
                parameter.copy_(value)
            else:
                owner._parameters[attribute] = nn.Parameter(value.to(parameter.dtype),
                                                            requires_grad=parameter.requires_grad)
        elif attribute in owner._buffers:
            buffer = owner._buffers[attribute]
            if buffer is not None and buffer.shape == value.shape and buffer.dtype == value.dtype:
                buffer.copy_(value)  # in place: whatever holds this tensor sees the kept state
            else:
                owner._buffers[attribute] = value.to(buffer.device) if buffer is not None else value
        else:
            owner.register_buffer(attribute, value, persistent=False)
