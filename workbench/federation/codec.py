"""What a message costs and how it travels, read from a method's upload spec.

Every tensor that crosses the wire costs `numel × itemsize` of the dtype it is sent in; a
symmetric matrix (`Upload(symmetric=True)`) is sent as its upper triangle, d(d+1)/2 numbers; a
stacked upload (`Upload(stacked=True)`) costs one client's row. A transport packs messages with
`pack` (symmetric -> upper triangle) and the receiver restores them with `unpack`.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from workbench.federation.messages import messages_bytes
from workbench.linalg import packed_symmetric_numel


def symmetric_names(spec: Mapping) -> frozenset[str]:
    """The upload names sent as upper triangles."""
    return frozenset(name for name, upload in spec.items() if upload.symmetric)


def stacked_names(spec: Mapping) -> frozenset[str]:
    """The upload names combined as one row per client."""
    return frozenset(name for name, upload in spec.items() if upload.stacked)


def one_client(uploads: Mapping[str, Tensor], spec: Mapping) -> dict[str, Tensor]:
    """One client's upload shapes from a round's combined uploads: a stacked upload keeps its
    first row (a leading axis of 1, as one client sends it); a summed one is one client's shape."""
    return {name: value[:1] if spec[name].stacked else value for name, value in uploads.items()}


def upload_bytes(uploads: Mapping[str, Tensor], spec: Mapping) -> int:
    """Bytes one client sends for the round whose combined uploads are `uploads`."""
    return messages_bytes(one_client(uploads, spec), symmetric_names(spec))


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


def combine(total: dict[str, Tensor], uploads: Mapping[str, Tensor], spec: Mapping) -> dict[str, Tensor]:
    """Adds one cohort's uploads to a round's running total: summed, or stacked after the rows
    already there (callers add cohorts in client order)."""
    for name, value in uploads.items():
        if name not in total:
            total[name] = value.clone()
        elif spec[name].stacked:
            total[name] = torch.cat([total[name], value])
        else:
            total[name] += value
    return total
