"""Secure aggregation: pairwise additive masks, so the server holds only masked uploads and their sum.

The arithmetic of Bonawitz et al. (CCS 2017), simulated in one process per federation:

Ring. Uploads are summed in the integer ring Z / 2^62, held in int64 tensors and reduced
(`& (2^62 − 1)`) after every addition or subtraction. Two ring elements add to less than 2^63,
so no operation overflows int64 (signed overflow is not defined behaviour to rely on), and mask
cancellation is exact integer arithmetic. Float masks could not do this: a mask large enough to
hide a value swamps that value's low bits, and the cancellation is only approximate.

Encoding. A float upload x is sent as the integer round(x · 2^b) (b = `fixed_point_bits`),
negative values wrapping to the upper half of the ring; integer uploads (counts) are sent as
they are. The sum of K encoded uploads decodes exactly as long as |Σ| < 2^61, which each client
checks on its own share: |round(x · 2^b)| < 2^61 / K. The only error of the whole scheme is then
the rounding, at most 2^-(b+1) per number and client (1.2e-10 for b = 32).

Masks. Each pair of participants {i, j} shares a seed s_ij (in the protocol, from a
Diffie-Hellman key agreement; here derived from (federation seed, round, i, j)), which expands
into a stream PRG(s_ij) of uniform ring elements as long as the upload. Client i sends

    y_i = enc(x_i) + Σ_{j ∈ U, j > i} PRG(s_ij) − Σ_{j ∈ U, j < i} PRG(s_ij)   (mod 2^62),

U being the round's participants. Any single y_i is uniform on the ring whatever x_i is. Over
the survivors S ⊆ U, the masks of pairs inside S cancel exactly, and the server removes the masks
each survivor shares with a dropped client j ∈ U ∖ S using those pairs' seeds (in the protocol
the server reconstructs j's key from t-of-n Shamir shares held by the survivors):

    Σ_{i∈S} enc(x_i) = Σ_{i∈S} y_i − Σ_{i∈S, j∉S} sign(j − i) · PRG(s_ij).

Not simulated here: the key agreement, the secret sharing, the survivors' self-masks (which
stop a server from unmasking a client that was only late) and authentication. What is exact is
what a method sees: the sum of the survivors' uploads.

Cost: each client draws |U| − 1 mask streams as long as its upload; the server draws one per
(survivor, dropped) pair. Symmetric uploads are masked as their upper triangle.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

RING_BITS = 62
RING_MASK = (1 << RING_BITS) - 1
HALF_RING = 1 << (RING_BITS - 1)  # ring elements ≥ this decode as negative numbers


def ring_add(a: Tensor, b: Tensor) -> Tensor:
    """(a + b) mod 2^62 for ring elements (int64 in [0, 2^62))."""
    return (a + b) & RING_MASK


def ring_sub(a: Tensor, b: Tensor) -> Tensor:
    """(a − b) mod 2^62 for ring elements."""
    return (a - b) & RING_MASK


def ring_sum(elements: Iterable[Tensor]) -> Tensor:
    """Σ mod 2^62 of same-shaped ring tensors, reduced after each addition (never overflows)."""
    total = None
    for element in elements:
        total = element.clone() if total is None else ring_add(total, element)
    if total is None:
        raise ValueError("ring_sum needs at least one tensor")
    return total


def encode(values: Tensor, fractional_bits: int, num_summands: int) -> Tensor:
    """Fixed-point ring elements of `values`: round(x · 2^b) mod 2^62 (integers as they are), same shape.

    Raises when a value is so large that `num_summands` such values could wrap around the ring.
    """
    if values.is_floating_point():
        scaled = torch.round(values.double() * 2.0 ** fractional_bits)
    else:
        scaled, fractional_bits = values.double(), 0
    largest = float(scaled.abs().max()) if scaled.numel() else 0.0
    bound = HALF_RING / num_summands
    if not largest < bound:  # also catches inf and NaN
        magnitude = largest / 2.0 ** fractional_bits
        fits = int(np.floor(np.log2(bound / magnitude))) if 0 < magnitude < float("inf") else None
        hint = (f"lower federation.fixed_point_bits to at most {fits}" if fits is not None and fits >= 0
                else "the upload is not finite or too large for the ring; check the client's data")
        raise ValueError(
            f"a client's upload reaches |x| = {magnitude:.4g}: with {fractional_bits} fractional bits, the "
            f"sum over {num_summands} clients could wrap around the 2^{RING_BITS} ring; {hint}")
    return (values.long() if not values.is_floating_point() else scaled.long()) & RING_MASK


def decode(elements: Tensor, fractional_bits: int, dtype: torch.dtype) -> Tensor:
    """Ring elements -> numbers of `dtype`: the upper half of the ring is negative; floats divide by 2^b."""
    signed = torch.where(elements >= HALF_RING, elements - (1 << RING_BITS), elements)
    if dtype.is_floating_point:
        return (signed.double() / 2.0 ** fractional_bits).to(dtype)
    return signed.to(dtype)


def pair_mask(seed: int, round_index: int, first: int, second: int, length: int) -> Tensor:
    """PRG(s_ij): `length` uniform ring elements from the seed the pair {first, second} shares.

    The seed depends on the unordered pair, so both clients draw the same stream.
    """
    low, high = sorted((first, second))
    bits = np.random.SFC64(np.random.SeedSequence([seed, round_index, low, high])).random_raw(length)
    return torch.from_numpy((bits >> np.uint64(64 - RING_BITS)).astype(np.int64))


def client_mask(client: int, others: Iterable[int], seed: int, round_index: int, length: int) -> Tensor:
    """Σ_{j > i} PRG(s_ij) − Σ_{j < i} PRG(s_ij) over `others` (mod 2^62) for client i = `client`: (length,)."""
    mask = torch.zeros(length, dtype=torch.int64)
    for other in others:
        if other == client:
            continue
        stream = pair_mask(seed, round_index, client, other, length)
        mask = ring_add(mask, stream) if other > client else ring_sub(mask, stream)
    return mask


@dataclass(frozen=True)
class Field:
    """Where one named upload sits in the flat message: shape, dtype, packed or not."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    packed: bool  # a symmetric (..., d, d) tensor sent as its upper triangle
    length: int


class UploadLayout:
    """A dict of named tensors <-> one flat vector (symmetric ones as their upper triangles)."""

    def __init__(self, uploads: Mapping[str, Tensor], symmetric: Collection[str] = ()) -> None:
        self.fields = []
        for name, value in uploads.items():
            packed = name in symmetric
            length = (value[..., 0, 0].numel() * value.shape[-1] * (value.shape[-1] + 1) // 2 if packed
                      else value.numel())
            self.fields.append(Field(name, tuple(value.shape), value.dtype, packed, length))
        self.length = sum(f.length for f in self.fields)

    def flatten(self, uploads: Mapping[str, Tensor], fractional_bits: int, num_summands: int) -> Tensor:
        """Encoded ring elements of every field, concatenated: (length,) int64."""
        parts = []
        for field in self.fields:
            value = uploads[field.name].detach().cpu()
            if field.packed:
                rows, cols = torch.triu_indices(field.shape[-1], field.shape[-1])
                value = value[..., rows, cols]
            parts.append(encode(value.reshape(-1), fractional_bits, num_summands))
        return torch.cat(parts)

    def unflatten(self, elements: Tensor, fractional_bits: int) -> dict[str, Tensor]:
        """Decoded named tensors of their original shapes and dtypes (symmetric ones mirrored)."""
        uploads, start = {}, 0
        for field in self.fields:
            part = decode(elements[start:start + field.length], fractional_bits, field.dtype)
            start += field.length
            if field.packed:
                side = field.shape[-1]
                rows, cols = torch.triu_indices(side, side)
                full = part.new_zeros(field.shape)
                full[..., rows, cols] = part.view(*field.shape[:-2], -1)
                full[..., cols, rows] = part.view(*field.shape[:-2], -1)
                part = full
            uploads[field.name] = part.view(field.shape)
        return uploads


class SecureAggregator:
    """One round of masked summation over the participants U.

    A client calls `masked_upload` (encode, then mask with every other participant); the server
    adds what it receives with `receive` (ring sums only) and, once the round closes, `unmask`
    removes the masks shared with clients that never uploaded and decodes the exact sum. Several
    aggregators (one per process) may each receive part of the clients: their `total`s are
    summed with `ring_sum` before `unmask`.

    Args:
        participants: U, the client ids of the round (those selected before any dropout).
        seed, round_index: what the pair seeds are derived from.
        fixed_point_bits: b of the encoding round(x · 2^b).
        symmetric: upload names sent as their upper triangle.
    """

    def __init__(self, participants: Iterable[int], *, seed: int, round_index: int,
                 fixed_point_bits: int = 32, symmetric: Collection[str] = ()) -> None:
        self.participants = sorted({int(c) for c in participants})
        self.seed, self.round_index, self.fixed_point_bits = seed, round_index, fixed_point_bits
        self.symmetric = frozenset(symmetric)
        self.layout: UploadLayout | None = None
        self.total: Tensor | None = None  # ring sum of the masked uploads received here

    def set_layout(self, uploads: Mapping[str, Tensor]) -> UploadLayout:
        """Fix the message layout from one upload (its names, shapes and dtypes; values unused)."""
        if self.layout is None:
            self.layout = UploadLayout(uploads, self.symmetric)
            self.total = torch.zeros(self.layout.length, dtype=torch.int64)
        return self.layout

    @property
    def bytes_per_client(self) -> int:
        """Bytes of one masked message: 8 per ring element (int64)."""
        return 8 * self.layout.length if self.layout is not None else 0

    def masked_upload(self, client: int, upload: Mapping[str, Tensor]) -> Tensor:
        """Client `client`'s message y_i: its encoded upload plus its pair masks, (length,) int64."""
        if client not in self.participants:
            raise ValueError(f"client {client} is not a participant of this round")
        layout = self.set_layout(upload)
        encoded = layout.flatten(upload, self.fixed_point_bits, len(self.participants))
        return ring_add(encoded, client_mask(client, self.participants, self.seed, self.round_index,
                                             layout.length))

    def receive(self, masked: Tensor) -> None:
        """The server adds one masked message to its running ring sum."""
        self.total = ring_add(self.total, masked)

    def add(self, client: int, upload: Mapping[str, Tensor]) -> None:
        """A client masks its upload and the server receives it."""
        self.receive(self.masked_upload(client, upload))

    def unmask(self, total: Tensor, uploaded: Collection[int]) -> dict[str, Tensor]:
        """The exact sum of the uploads of `uploaded` (the survivors S), from the ring sum of their messages.

        Removes Σ_{i∈S, j∈U∖S} ±PRG(s_ij), the masks survivors share with dropped clients, then decodes.
        """
        survivors = sorted({int(c) for c in uploaded})
        dropped = sorted(set(self.participants) - set(survivors))
        length = self.layout.length
        for client in survivors:
            if dropped:
                total = ring_sub(total, client_mask(client, dropped, self.seed, self.round_index, length))
        return self.layout.unflatten(total, self.fixed_point_bits)
