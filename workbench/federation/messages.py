"""Byte accounting for messages.

A message is a dict of named tensors. Each tensor costs `numel × itemsize` of the dtype it is
sent in; a tensor named as symmetric is sent as its upper triangle, `d(d+1)/2` numbers.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from torch import Tensor

from workbench.linalg import packed_symmetric_numel

SEED_BYTES = 8  # a shared integer seed replaces every random matrix on the wire


def message_bytes(tensor: Tensor, *, symmetric: bool = False) -> int:
    """Bytes to send one tensor, packed to its upper triangle when `symmetric`."""
    if symmetric:
        side = tensor.shape[-1]
        if tensor.ndim < 2 or tensor.shape[-2] != side:
            raise ValueError(f"a symmetric message must be square, got shape {tuple(tensor.shape)}")
        numel = tensor[..., 0, 0].numel() * packed_symmetric_numel(side)
    else:
        numel = tensor.numel()
    return numel * tensor.element_size()


def messages_bytes(messages: Mapping[str, Tensor], symmetric: Collection[str] = ()) -> int:
    """Total bytes of a message dict; names in `symmetric` are sent packed."""
    return sum(message_bytes(t, symmetric=name in symmetric) for name, t in messages.items())
