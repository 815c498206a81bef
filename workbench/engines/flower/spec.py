"""What a ClientApp needs to rebuild a run, and tensors in Flower records.

- `RunSpec`: the method and data classes (names exported by `workbench.methods` /
  `workbench.data`, nothing else) with their init arguments as JSON; its `digest` names it.
- `to_record` / `from_record`: named tensors <-> an `ArrayRecord` (numpy .npy bytes per array);
  `record_views`: read-only tensors over a record's bytes, to copy from.
- `half_state` / `restore_half`: every buffer and parameter of a client half (persistent or not:
  DeepAFL's Φ cache, Ditto's personal heads, the compress stage's error feedback), kept by a node
  between messages.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.constant import SType
from lightning import LightningDataModule
from torch import Tensor, nn

from workbench import methods as method_classes
from workbench.catalog import data_classes
from workbench.federation.protocol import Federation
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
    """The method and data classes with their init arguments as JSON, and the protocol's settings a
    node runs on its side from the start (`Pipeline.node_settings`: the compression and its error
    feedback, whose state the node keeps): all a ClientApp needs to rebuild them (the method from
    its settings, never from learned state)."""

    method: str
    method_args: str
    data: str
    data_args: str
    protocol: str = "{}"

    @classmethod
    def of(cls, method: FederatedMethod, datamodule, protocol: Federation = Federation()) -> RunSpec:
        return cls(type(method).__name__, _init_args(method), type(datamodule).__name__, _init_args(datamodule),
                   json.dumps(plain(protocol, strict=True), sort_keys=True))

    @property
    def digest(self) -> str:
        """Names the spec in the messages after the first (a node checks its kept spec is the fit's)."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:32]

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

    def build_protocol(self) -> Federation:
        """The protocol's settings a node runs on its side (`Pipeline.for_node` adds each round's)."""
        return construct(Federation, json.loads(self.protocol))

    def build_data(self) -> LightningDataModule:
        modules = {cls.__name__: cls for cls in data_classes()}
        if self.data not in modules:
            raise ValueError(f"unknown data module {self.data!r}; this install has {sorted(modules)}")
        return construct(modules[self.data], json.loads(self.data_args))


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


def _array(tensor: Tensor) -> Array:
    """A tensor as the Array `Array(tensor)` makes (np.save's .npy bytes), in one copy instead of
    np.save's chunked writes and copies: a node saves its client's state with every message."""
    values = tensor.detach().cpu().numpy()
    values = values if values.flags.c_contiguous else values.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(values))
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype=SType.NUMPY,
                 data=b"".join((header.getvalue(), values.data)))


def to_record(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """Named tensors -> an ArrayRecord (CPU copies, in the given order)."""
    return ArrayRecord(OrderedDict((name, _array(value)) for name, value in tensors.items()))


def from_record(record: ArrayRecord) -> dict[str, Tensor]:
    """An ArrayRecord -> named tensors (writable copies: np.load reads each into a new array)."""
    return dict(record.to_torch_state_dict())


def record_views(record: ArrayRecord) -> dict[str, Tensor]:
    """An ArrayRecord -> named read-only tensors over its .npy bytes (no copy): to copy from, as
    `restore_half` does (a node restores its client's state from them)."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    views = {}
    for name, array in record.items():
        data = array.data
        header = io.BytesIO(data)  # shares the bytes
        version = np.lib.format.read_magic(header)
        if version not in readers:  # (3.0 only names structured fields: not a tensor's)
            views[name] = torch.from_numpy(array.numpy())
            continue
        shape, fortran_order, dtype = readers[version](header)
        values = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=header.tell())
        with warnings.catch_warnings():  # read-only on purpose: restore_half copies from them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            views[name] = torch.from_numpy(values.reshape(shape, order="F" if fortran_order else "C"))
    return views


def half_state(half: nn.Module) -> dict[str, Tensor]:
    """Every buffer and parameter of a client half, persistent or not, by qualified name."""
    state = {name: value for name, value in half.named_buffers() if value is not None}
    state.update({name: value.detach() for name, value in half.named_parameters()})
    return state


@torch.no_grad()
def restore_half(half: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Put back what `half_state` saved into a freshly built half: copied in place where the fresh
    tensor has the saved shape and dtype (whatever refers to it sees the kept state), replaced by
    a copy where the fit found another shape (e.g. a cache allocated in a later round). `state`
    is only read (it may be `record_views`)."""
    for name, value in state.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = half.get_submodule(owner_name) if owner_name else half
        parameter = owner._parameters.get(attribute)
        if parameter is not None:
            if parameter.shape == value.shape:
                parameter.copy_(value)
            else:
                owner._parameters[attribute] = nn.Parameter(value.to(parameter.dtype, copy=True),
                                                            requires_grad=parameter.requires_grad)
        elif attribute in owner._buffers:
            buffer = owner._buffers[attribute]
            if buffer is not None and buffer.shape == value.shape and buffer.dtype == value.dtype:
                buffer.copy_(value)  # in place: whatever holds this tensor sees the kept state
            else:
                owner._buffers[attribute] = value.clone() if buffer is None else value.to(buffer.device, copy=True)
        else:
            owner.register_buffer(attribute, value.clone(), persistent=False)
