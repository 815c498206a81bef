"""Update compressors for gradient federated methods, with exact byte counts.

A compressor maps the m sampled clients' flat updates, (m, P), to what the server
reconstructs from their messages, (m, P), in one vectorized call, and says how many bytes
one client's message takes. P is the number of model parameters; `sizes` lists the numel of
each parameter tensor (in the flat order), so per-tensor scales are possible.

- `Dense`: the float32 update itself, 4·P bytes.
- `TopK`: the k = ceil(fraction·P) entries of largest magnitude: k float32 values and k
  indices, each index in the smallest unsigned integer of 1, 2, 4 or 8 bytes that holds P − 1.
- `Quantize`: uniform b-bit quantization per parameter tensor: with lo = min, hi = max of the
  tensor, step = (hi − lo)/(2^b − 1), code = round((x − lo)/step) ∈ {0, …, 2^b − 1},
  reconstruction lo + step·code. Codes are bit-packed: ceil(numel·b/8) bytes per tensor, plus
  lo and step as float32 (8 bytes per tensor).

Error feedback (`ErrorFeedback`) keeps, per client, what compression lost and adds it to
the next round's update: target = update + e, e ← target − reconstruction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

FLOAT_BYTES = 4  # values and scales are sent as float32


def as_sent(values: Tensor) -> Tensor:
    """Values rounded to the float32 that crosses the wire, in their own dtype."""
    return values.float().to(values.dtype)


def index_bytes(length: int) -> int:
    """Bytes of the smallest unsigned integer (1, 2, 4 or 8 bytes) that indexes `length` entries."""
    return next(width for width in (1, 2, 4, 8) if length - 1 < 256**width)


class Compressor:
    """Dense float32 updates; subclasses compress. `sizes`: numel of each parameter tensor."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = [int(size) for size in sizes]
        self.numel = sum(self.sizes)

    def __call__(self, updates: Tensor) -> Tensor:
        """What the server reconstructs: (m, P) -> (m, P)."""
        return as_sent(updates)

    def bytes_per_client(self) -> int:
        return FLOAT_BYTES * self.numel


Dense = Compressor


class TopK(Compressor):
    """Top-k sparsification by magnitude over the whole flat update (k = ceil(fraction · P))."""

    def __init__(self, sizes: Sequence[int], fraction: float) -> None:
        super().__init__(sizes)
        if not 0 < fraction <= 1:
            raise ValueError(f"the top-k fraction must be in (0, 1], got {fraction}")
        self.k = math.ceil(fraction * self.numel)

    def __call__(self, updates: Tensor) -> Tensor:
        index = updates.abs().topk(self.k, dim=1).indices
        return torch.zeros_like(updates).scatter_(1, index, as_sent(updates.gather(1, index)))

    def bytes_per_client(self) -> int:
        return self.k * (FLOAT_BYTES + index_bytes(self.numel))


class Quantize(Compressor):
    """Uniform `bits`-bit quantization, min-max per parameter tensor, round to nearest."""

    def __init__(self, sizes: Sequence[int], bits: int) -> None:
        super().__init__(sizes)
        if not 1 <= bits <= 16:
            raise ValueError(f"quantization bits must be in 1..16, got {bits}")
        self.bits = bits

    def __call__(self, updates: Tensor) -> Tensor:
        levels = 2**self.bits - 1
        pieces = []
        for block in updates.split(self.sizes, dim=1):  # one scale per tensor, all clients at once
            lo = as_sent(block.min(1, keepdim=True).values)
            step = as_sent((block.max(1, keepdim=True).values - lo) / levels)
            codes = torch.round((block - lo) / step.clamp_min(torch.finfo(block.dtype).tiny)).clamp(
                0, levels
            )
            pieces.append(lo + step * codes)
        return torch.cat(pieces, 1)

    def bytes_per_client(self) -> int:
        return sum(math.ceil(size * self.bits / 8) + 2 * FLOAT_BYTES for size in self.sizes)


def build_compressor(
    name: str, sizes: Sequence[int], *, topk_fraction: float = 0.01, quantize_bits: int = 8
) -> Compressor:
    """`none` (dense float32), `topk` or `quantize`."""
    if name == "none":
        return Dense(sizes)
    if name == "topk":
        return TopK(sizes, topk_fraction)
    if name == "quantize":
        return Quantize(sizes, quantize_bits)
    raise ValueError(f"unknown compression {name!r}; choose none, topk or quantize")


class ErrorFeedback(nn.Module):
    """Per-client residuals e (K, P) of a lossy upload, kept across rounds (checkpointed)."""

    def __init__(self, num_clients: int, numel: int) -> None:
        super().__init__()
        self.register_buffer("residual", torch.zeros(num_clients, numel))

    def target(self, clients: Tensor, updates: Tensor) -> Tensor:
        """update + e for the m clients: (m,), (m, P) -> (m, P)."""
        return updates + self.residual[clients]

    def keep(self, clients: Tensor, target: Tensor, sent: Tensor) -> None:
        """e ← target − what the server will reconstruct."""
        self.residual[clients] = target - sent
