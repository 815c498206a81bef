"""The upload spec, and what a message costs and how it travels.

A method declares its uploads (`FederatedMethod.uploads`): for each named upload an `Upload`
saying how the clients' copies combine and how one client's copy is sent. Everything that counts,
packs, masks or noises uploads reads that spec here, outside the method:

- every tensor that crosses the wire costs `numel × itemsize` of the dtype it is sent in; a
  symmetric matrix (`Upload(symmetric=True)`) is sent as its upper triangle, d(d+1)/2 numbers; a
  stacked upload (`Upload(stacked=True)`) costs one client's row; an upload with an `encoding`
  (top-k values and indices, low-bit codes, a stand-in for a message the simulation does not
  form) costs what the encoding says;
- a Gram (`Upload(gram=True)`, e.g. XᵀX) is a sum over the client's training rows of positive
  semidefinite terms, which the screen (`workbench.federation.screen`) can check;
- a model update (`Upload(model_update=True)`) comes from the client half as one row per client;
  the protocol clips those rows under client-level DP (`workbench.federation.client_step`) and
  sends their sum;
- a transport packs messages with `pack` (symmetric -> upper triangle) and the receiver restores
  them with `unpack`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from workbench.federation.messages import message_bytes
from workbench.linalg import packed_symmetric_numel


class Encoding(Protocol):
    """How one client's copy of an upload is sent when not as its dense tensor."""

    def wire_bytes(self, value: Tensor) -> int:
        """Bytes one client sends for `value`, its copy of the upload."""
        ...


@dataclass(frozen=True)
class Upload:
    """How the clients' copies of one named upload travel and combine.

    stacked: False: summed over the clients (one client's shape); True: one leading row per
        client, concatenated in client order (e.g. OS-FED's snapshots).
    symmetric: a symmetric (..., d, d) matrix, sent as its upper triangle.
    model_update: the client half returns one row per client (m, ...): the update the protocol
        clips under client-level DP (all model-update uploads of a client as one vector) before
        the rows are summed; on the wire it is summed like any other.
    gram: a sum over the client's training rows of positive semidefinite terms (Σ x xᵀ, or one
        such d × d block per class; symmetric): an honest client's is positive semidefinite and
        its trace per row is the rows' mean squared norm, which the screen checks
        (`workbench.federation.screen`).
    encoding: what one client's copy costs when it is not sent dense (None: dense, or packed
        when symmetric).
    sizes: a model update's parameter tensors, the numel of each in the flat row's order (what a
        compressor scales tensor by tensor, `workbench.federation.compression`); () for one tensor.
    """

    stacked: bool = False
    symmetric: bool = False
    model_update: bool = False
    gram: bool = False
    encoding: Encoding | None = None
    sizes: tuple[int, ...] = ()


SUMMED, SYMMETRIC, STACKED = Upload(), Upload(symmetric=True), Upload(stacked=True)
GRAM = Upload(symmetric=True, gram=True)
MODEL_UPDATE = Upload(model_update=True)

Spec = Mapping[str, Upload]


@dataclass(frozen=True)
class WireSize:
    """An encoding of a fixed size per client (0: an upload that is not part of the protocol)."""

    bytes: int

    def wire_bytes(self, value: Tensor) -> int:
        return self.bytes


@dataclass(frozen=True)
class SentAs:
    """An upload sent in another dtype than it is computed in (e.g. float32 from a float64 run)."""

    dtype: torch.dtype

    def wire_bytes(self, value: Tensor) -> int:
        return value.numel() * torch.empty((), dtype=self.dtype).element_size()


FLOAT32 = SentAs(torch.float32)


def symmetric_names(spec: Spec) -> frozenset[str]:
    """The upload names sent as upper triangles."""
    return frozenset(name for name, upload in spec.items() if upload.symmetric)


def stacked_names(spec: Spec) -> frozenset[str]:
    """The upload names combined as one row per client."""
    return frozenset(name for name, upload in spec.items() if upload.stacked)


def model_update_names(spec: Spec) -> list[str]:
    """The upload names that are a client's model update (clipped together under client-level DP)."""
    return [name for name, upload in spec.items() if upload.model_update]


def update_rows(updates: Mapping[str, Tensor]) -> Tensor:
    """The clients' model updates {name: (m, ...)} as one vector per client: (m, P), the names in
    order (what client-level DP clips and a robust center combines)."""
    first = next(iter(updates.values()))
    return torch.cat([value.reshape(len(first), -1) for value in updates.values()], 1)


def split_rows(rows: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`update_rows` undone: (..., P) back into `like`'s names and per-client shapes,
    {name: (..., *shape)}."""
    parts = rows.split([value[0].numel() for value in like.values()], dim=-1)
    return {name: part.reshape(*rows.shape[:-1], *value.shape[1:])
            for (name, value), part in zip(like.items(), parts, strict=True)}


def gram_names(spec: Spec) -> list[str]:
    """The upload names that are Grams of the client's training rows (the screen checks them)."""
    return [name for name, upload in spec.items() if upload.gram]


def one_client(uploads: Mapping[str, Tensor], spec: Spec) -> dict[str, Tensor]:
    """One client's upload shapes from a round's combined uploads: a stacked upload keeps its
    first row (a leading axis of 1, as one client sends it); a summed one is one client's shape."""
    return {name: value[:1] if spec[name].stacked else value for name, value in uploads.items()}


def client_bytes(upload: Mapping[str, Tensor], spec: Spec) -> int:
    """Bytes one client sends for its upload (one client's shapes, as `one_client` gives them)."""
    total = 0
    for name, value in upload.items():
        entry = spec[name]
        if entry.encoding is not None:
            total += entry.encoding.wire_bytes(value)
        else:
            total += message_bytes(value, symmetric=entry.symmetric)
    return total


def upload_bytes(uploads: Mapping[str, Tensor], spec: Spec) -> int:
    """Bytes one client sends for the round whose combined uploads are `uploads`."""
    return client_bytes(one_client(uploads, spec), spec)


def pack(message: Mapping[str, Tensor], symmetric: frozenset[str]) -> dict[str, Tensor]:
    """Symmetric (..., d, d) entries -> their upper triangles (..., d(d+1)/2); others as they are."""
    packed = {}
    for name, value in message.items():
        if name in symmetric:
            rows, cols = torch.triu_indices(value.shape[-1], value.shape[-1], device=value.device)
            value = value[..., rows, cols]
        packed[name] = value
    return packed


def unpack(message: Mapping[str, Tensor], symmetric: frozenset[str]) -> dict[str, Tensor]:
    """Inverse of `pack`: upper triangles (..., d(d+1)/2) -> full symmetric (..., d, d)."""
    full = {}
    for name, value in message.items():
        if name in symmetric:
            length = value.shape[-1]
            side = round(((8 * length + 1) ** 0.5 - 1) / 2)
            if packed_symmetric_numel(side) != length:
                raise ValueError(f"message {name!r} is not a packed symmetric matrix ({length} values)")
            rows, cols = torch.triu_indices(side, side, device=value.device)
            matrix = value.new_zeros(*value.shape[:-1], side, side)
            matrix[..., rows, cols] = value
            matrix[..., cols, rows] = value
            value = matrix
        full[name] = value
    return full


def combine(parts: Iterable[Mapping[str, Tensor]], spec: Spec) -> dict[str, Tensor]:
    """Cohorts' uploads, in client order, combined as the round's: summed (in that order), or
    stacked (each cohort's rows after those before it, concatenated once)."""
    total: dict[str, Tensor] = {}
    stacks: dict[str, list[Tensor]] = {}
    for uploads in parts:
        for name, value in uploads.items():
            if spec[name].stacked:
                stacks.setdefault(name, []).append(value)
                total.setdefault(name, value)  # (its place among the names)
            elif name not in total:
                total[name] = value.clone()
            else:
                total[name] += value
    return {name: torch.cat(stacks[name]) if name in stacks else value for name, value in total.items()}
