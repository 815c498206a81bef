"""A second device that computes on the CPU and records what crosses between it and the host.

Device-agnostic code cannot be checked by running it on the CPU alone: there every tensor is on the
one device, so a forgotten `.to(device)` or a silent round trip through the host goes unseen, and
a GPU is not always at hand. Inside `fake_device()`, tensors placed on `DEVICE` (`meta`, which
needs no runtime) are `DeviceTensor`s that hold CPU data and compute with it, bit for bit as on the
CPU, and behave as a GPU's tensors where device-agnostic code goes wrong:

- an operation that mixes a device tensor with a host tensor of one or more dimensions fails with
  CUDA's error (0-dim host tensors mix, as on CUDA; host index tensors are copied over, recorded);
- every copy between host and device is recorded (`.to`, `.cpu()`, `copy_`, `torch.tensor(...,
  device=)`, `.tolist()`, host index tensors);
- every operation that makes the host wait for the device is recorded as a sync: reading values
  (`item()`, `int(t)`, `bool(t)`, `tolist()`, any copy to the host), a blocking copy to the device
  (CUDA synchronizes the stream after it; one marked `non_blocking` counts as asynchronous, as it is
  from page-locked memory), and operations whose output size depends on values (`nonzero`, boolean
  masks, `unique`, `bincount`, ...) or that check values on the host (Cholesky's and solve's error
  checks, `equal`);
- `numpy()` of a device tensor fails, and so does a host generator drawing on the device, as on CUDA.

Each event keeps the workbench line that caused it, so a failing test says where the round trip is.
"""
from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")
HOST = torch.device("cpu")

# operations after which a CUDA stream's host waits for the device (an output size, or an error
# check, that depends on values)
SYNC_OPS = {
    "_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "bincount", "equal", "_linalg_check_errors", "masked_scatter_", "repeat_interleave",
    "histc", "argwhere",
}
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


@dataclass
class Transfers:
    """What crossed between host and device: copies (direction, bytes, where), syncs (op, where)."""

    copies: list[tuple[str, int, str]] = field(default_factory=list)
    syncs: list[tuple[str, str]] = field(default_factory=list)

    def clear(self) -> None:
        self.copies.clear()
        self.syncs.clear()

    def copy(self) -> Transfers:
        return Transfers(list(self.copies), list(self.syncs))

    @property
    def bytes_to_host(self) -> int:
        return sum(size for direction, size, _ in self.copies if direction == "to_host")

    @property
    def bytes_to_device(self) -> int:
        return sum(size for direction, size, _ in self.copies if direction == "to_device")

    def summary(self) -> str:
        """Each kind of event by the line that caused it, most frequent first."""
        lines = Counter([f"copy {d} ({size} B) at {where}" for d, size, where in self.copies]
                        + [f"sync {op} at {where}" for op, where in self.syncs])
        return "\n".join(f"{count:4d} × {line}" for line, count in lines.most_common())


RECORDS: list[Transfers] = []  # the active recording


def _where() -> str:
    """The innermost workbench line (else the innermost line outside this file) behind an event."""
    frames = [frame for frame in traceback.extract_stack() if not frame.filename.endswith("fake_device.py")]
    for frame in reversed(frames):
        if "/workbench/" in frame.filename:
            return f"{frame.filename.split('/workbench/')[-1]}:{frame.lineno} ({frame.name})"
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


def _copy(direction: str, tensor: torch.Tensor) -> None:
    if RECORDS:
        RECORDS[-1].copies.append((direction, tensor.numel() * tensor.element_size(), _where()))


def _sync(op: str) -> None:
    if RECORDS:
        RECORDS[-1].syncs.append((op, _where()))


class DeviceTensor(torch.Tensor):
    """A tensor on `DEVICE`; its data, on the host, in `.data_on_host`."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> DeviceTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=DEVICE, requires_grad=data.requires_grad, layout=data.layout)
        wrapper.data_on_host = data
        return wrapper

    def __repr__(self) -> str:
        return f"DeviceTensor({self.data_on_host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name.split("::")[-1]
        if name == "copy_" and isinstance(args[0], DeviceTensor) != isinstance(args[1], DeviceTensor):
            return _copy_across(*args, **kwargs)
        if name == "_has_compatible_shallow_copy_type":  # nn.Module.to asks before replacing a parameter
            return type(args[0]) is type(args[1])
        host = [t for t in _tensors((args, kwargs)) if not isinstance(t, DeviceTensor) and t.dim() > 0]
        if host:
            if name not in INDEX_OPS:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {DEVICE} and cpu! (in {func}, at {_where()})")
            for tensor in host:  # index tensors on the host are copied over, blocking
                _copy("to_device", tensor)
                _sync("index on the host")
        if name in SYNC_OPS or (name in INDEX_OPS and any(t.dtype == torch.bool for t in _tensors(args[1:]))):
            _sync(name)
        to_host = not _on_device(_argument(func, args, kwargs, "device", DEVICE))
        if name in ("_to_copy", "to") and to_host:
            _copy("to_host", args[0])
            _sync("to_host")
            return func(*tree_map(_unwrap, args), **kwargs)
        kwargs["device"] = HOST if _on_device(kwargs.get("device")) else kwargs.get("device")
        kwargs = {key: value for key, value in kwargs.items() if value is not None}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name == "_local_scalar_dense":
            return out
        return tree_map(lambda t: DeviceTensor(t) if isinstance(t, torch.Tensor) else t, out)


def _copy_across(target: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`target.copy_(source)` between host and device; a blocking copy to the host is a sync."""
    to_host = isinstance(source, DeviceTensor)
    _copy("to_host" if to_host else "to_device", source)
    if to_host or not non_blocking:
        _sync("copy_")
    _unwrap(target).copy_(_unwrap(source))
    return target


def _argument(func, args, kwargs, name: str, default=None):
    """The value of argument `name` of a call of `func`, given by position or by name."""
    positions = {argument.name: i for i, argument in enumerate(func._schema.arguments)}
    if name in kwargs:
        return kwargs[name]
    return args[positions[name]] if name in positions and positions[name] < len(args) else default


def _unwrap(value):
    return value.data_on_host if isinstance(value, DeviceTensor) else value


def _tensors(tree) -> list[torch.Tensor]:
    found = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return found


def _on_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class _Placement(TorchDispatchMode):
    """Tensors made on the device (factories, also inside composite operations) and copies of host
    tensors to it become DeviceTensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not _on_device(kwargs.get("device")) or any(isinstance(t, DeviceTensor) for t in _tensors(args)):
            return func(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type != DEVICE.type:
            raise RuntimeError(f"Expected a '{DEVICE.type}' device type for generator but found "
                               f"'{generator.device.type}' (at {_where()})")
        kwargs["device"] = HOST
        if func._schema.name in ("aten::_to_copy", "aten::to"):  # (`to` itself under inference_mode)
            _copy("to_device", args[0])
            if not _argument(func, args, kwargs, "non_blocking", False):
                _sync("to_device")
        return DeviceTensor(func(*args, **kwargs))


class _HostData(TorchFunctionMode):
    """What bypasses the dispatcher: tensors made from host data on the device (`torch.tensor`,
    `as_tensor`, `new_tensor`: a copy to the device) and reads of values (`tolist`, `numpy`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, kwargs = getattr(func, "__name__", ""), dict(kwargs or {})
        if name == "new_tensor" and isinstance(args[0], DeviceTensor):
            kwargs.setdefault("dtype", args[0].dtype)
            func, args, kwargs["device"] = torch.tensor, args[1:], DEVICE
        if name == "as_tensor" and isinstance(args[0], DeviceTensor) and _on_device(kwargs.get("device", DEVICE)):
            return args[0] if kwargs.get("dtype") in (None, args[0].dtype) else args[0].to(kwargs["dtype"])
        made_from_host_data = args and not isinstance(args[0], torch.Tensor)
        if name in ("tensor", "as_tensor", "new_tensor") and _on_device(kwargs.get("device")) and made_from_host_data:
            kwargs["device"] = HOST
            data = func(*args, **kwargs)
            _copy("to_device", data)
            _sync(name)  # a blocking copy from pageable memory
            return DeviceTensor(data)
        if name == "tolist" and isinstance(args[0], DeviceTensor):
            _copy("to_host", args[0])
            _sync("tolist")
            return args[0].data_on_host.tolist()
        if name in ("numpy", "__array__") and isinstance(args[0], DeviceTensor):
            raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_device():
    """Run the body with `DEVICE` as a recording device; yields the `Transfers` it records."""
    record = Transfers()
    RECORDS.append(record)
    try:
        with _HostData(), _Placement():
            yield record
    finally:
        RECORDS.pop()
