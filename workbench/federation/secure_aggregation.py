"""Secure aggregation: additive masks, so the server holds only masked uploads and their sum.

Two protocols share one ring and one encoding (`federation.secure_aggregation_graph`):

- `complete` (the default): all-pairs masks, the arithmetic of Bonawitz et al. (CCS 2017), with
  pair seeds derived from the federation seed; no secret sharing is simulated. Each client draws
  n − 1 mask streams, so a round costs O(n²) streams.
- `sparse`: SecAgg+ (Bell et al., CCS 2020): masks only along a seeded random k-regular graph
  with k = O(log n), self-masks, and dropout recovery from t-of-k Shamir shares
  (`workbench.federation.shamir`) that the server actually reconstructs. Each client draws
  k + 1 streams and deals 2k shares.

Ring. Uploads are summed in the integer ring Z / 2^62, held in int64 tensors and reduced
(`& (2^62 − 1)`) after every addition or subtraction. Two ring elements add to less than 2^63,
so no operation overflows int64 (signed overflow is not defined behaviour to rely on), and mask
cancellation is exact integer arithmetic. Float masks could not do this: a mask large enough to
hide a value swamps that value's low bits, and the cancellation is only approximate. Masks are
accumulated as uint64 (wrapping mod 2^64 is defined for unsigned numbers) and reduced once:
2^62 divides 2^64, so `& (2^62 − 1)` of a sum mod 2^64 is the sum mod 2^62.

Encoding. A float upload x is sent as the integer round(x · 2^b) (b = `fixed_point_bits`),
negative values wrapping to the upper half of the ring; integer uploads (counts) are sent as
they are. The sum of K encoded uploads decodes exactly as long as |Σ| < 2^61, which each client
checks on its own share: |round(x · 2^b)| < 2^61 / K. The only error of the whole scheme is then
the rounding, at most 2^-(b+1) per number and client (1.2e-10 for b = 32).

PRG. A seed s expands into a stream of uniform ring elements as long as the upload, counter-based:
word w of the stream is

    PRG(s)_w = u64_{w mod 2}(AES-128_K(⌊w/2⌋)) & (2^62 − 1),   K = BLAKE2b-128(s),

with the counter ⌊w/2⌋ a 16-byte big-endian block and u64_0, u64_1 the two little-endian halves of
the cipher block: AES-128-CTR's keystream from counter 0 under the key K (OpenSSL through
`cryptography`, AES-NI), the same on every machine and process. A round's masks are drawn together:
the streams of all the clients `add`ed in one pass (`MaskStreams.signed_sum`), the server's in one
more. AES-CTR is a cryptographic PRG; the key agreement below is not, and the `complete` seeds and
every client's secrets derive from the federation seed: the simulation is exact in what it
computes, not secure against someone who knows that seed.

All pairs (`complete`). Each pair {i, j} of the round's participants U shares a seed s_ij
(derived from (federation seed, round, i, j)). Client i sends

    y_i = enc(x_i) + Σ_{j ∈ U, j > i} PRG(s_ij) − Σ_{j ∈ U, j < i} PRG(s_ij)   (mod 2^62).

Any single y_i is uniform on the ring whatever x_i is. Over the survivors S ⊆ U the masks of pairs
inside S cancel, and the server removes the masks each survivor shares with a dropped client:

    Σ_{i∈S} enc(x_i) = Σ_{i∈S} y_i − Σ_{i∈S, j∉S} sign(j − i) · PRG(s_ij).

SecAgg+ (`sparse`), per round with the n participants:
1. Graph. A Harary graph H(k, n) over a random order of U seeded by (seed, round): each client is
   linked to the k/2 clients before and after it on that ring (k even; all others if k ≥ n − 1).
   N(i) are its k neighbours; a client's neighbour set is a uniform k-subset of the others.
2. Keys. Client i draws a key sk_i and a self-mask seed b_i in F_p (p = 2^127 − 1) from its own
   randomness and advertises pk_i; neighbours agree on s_ij = sk_i · pk_j = sk_j · pk_i. The key
   agreement has Diffie–Hellman's algebra in the additive group of F_p (pk = sk · 3): insecure by
   design, it stands in for elliptic-curve DH; what is exact is which secret unlocks which mask.
3. Shares. Client i deals t-of-k Shamir shares of sk_i and of b_i, one of each to every neighbour.
4. Upload. y_i = enc(x_i) + PRG(b_i) + Σ_{j∈N(i), j>i} PRG(s_ij) − Σ_{j∈N(i), j<i} PRG(s_ij).
5. Unmask. Each survivor v reveals, for each neighbour u, the share of b_u if u uploaded, else the
   share of sk_u (never both for one peer). From ≥ t shares the server reconstructs b_i for every
   survivor and sk_j for every dropped client with a surviving neighbour, recomputes
   s_ij = sk_j · pk_i for j's surviving neighbours i, and removes PRG(b_i) and ±PRG(s_ij):
       Σ_{i∈S} enc(x_i) = Σ_{i∈S} y_i − Σ_{i∈S} PRG(b_i) − Σ_{i∈S, j∈N(i)∖S} sign(j − i) · PRG(s_ij).
   Fewer than t shares of a secret the server needs is an error naming the fix.

Choosing k and t (`secagg_plus_parameters`, when `secagg_degree` / `secagg_threshold` are not set),
following the paper's conditions with statistical security σ = 40 bits and correctness η = 30
bits: each client is independently corrupt (colluding with the server) with probability γ
(`federation.secagg_corrupt_fraction`) and drops out with probability δ (`federation.dropout`);
with a union bound over the n clients, the smallest even k such that, with
t = max(⌊k/2⌋ + 1, the smallest t with n · P[Bin(k, γ) ≥ t] ≤ 2^-σ),
    - no client's secrets are reachable by its corrupt neighbours: as above, by the choice of t;
      the majority t also stops a server from collecting sk-shares from some neighbours and
      b-shares from others;
    - the honest survivors stay connected: a Harary ring falls apart only across runs of k/2
      consecutive corrupt or dropped clients (two of them); asking for none, n · (γ + δ)^{k/2} ≤ 2^-σ;
    - every secret the server needs has t surviving holders: n · P[Bin(k, δ) > k − t] ≤ 2^-η.
For γ = δ = 0.05 this gives (k, t) = (32, 18) at n = 100, (36, 19) at n = 1,000 (k ≈ 3.6 log₂ n),
(38, 21) at n = 10,000 and (40, 22) at n = 100,000. Where no k < n − 1 meets the bounds (small n)
every client neighbours all others (k = n − 1), with the security t above where it exists, else a
majority t = ⌊k/2⌋ + 1.

Cost per client and round: `complete`, n − 1 mask streams; `sparse`, k + 1 streams, 2k shares dealt
and k revealed (16 bytes each). The server draws one stream per (survivor, dropped neighbour) pair,
plus one per survivor under `sparse`. Symmetric uploads are masked as their upper triangle.
"""
from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from torch import Tensor

from workbench.federation import shamir

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


def check_in_ring(magnitude: float, fractional_bits: int, num_summands: int) -> None:
    """Raise, naming the fix, when `num_summands` uploads of |x| = `magnitude` could wrap around
    the ring at `fractional_bits` (NaN and inf never fit): asked by `encode` of every upload, and by a
    method's `check_data` before the fit of what it knows it will send (the γI every AFL client adds)."""
    if magnitude * 2.0 ** fractional_bits < HALF_RING / num_summands:  # False for NaN
        return
    fits = int(np.floor(np.log2(HALF_RING / num_summands / magnitude))) if 0 < magnitude < float("inf") else None
    hint = (f"lower federation.fixed_point_bits to at most {fits}" if fits is not None and fits >= 0
            else "the upload is not finite or too large for the ring; check the client's data")
    raise ValueError(
        f"a client's upload reaches |x| = {magnitude:.4g}: with {fractional_bits} fractional bits, the "
        f"sum over {num_summands} clients could wrap around the 2^{RING_BITS} ring; {hint}")


def encode(values: Tensor, fractional_bits: int, num_summands: int, out: Tensor | None = None) -> Tensor:
    """Fixed-point ring elements of `values`: round(x · 2^b) mod 2^62 (integers as they are), same
    shape (written into `out` when given: int64, as many elements).

    Raises when a value is so large that `num_summands` such values could wrap around the ring.
    """
    if values.is_floating_point():
        scaled = values.double() * 2.0 ** fractional_bits  # a new tensor: rounded in place
        scaled.round_()
    else:
        scaled, fractional_bits = values.double(), 0
    low, high = torch.aminmax(scaled) if scaled.numel() else (scaled.new_zeros(()), scaled.new_zeros(()))
    if not max(-float(low), float(high)) < HALF_RING / num_summands:  # also catches inf and NaN
        check_in_ring(float(scaled.abs().max()) / 2.0 ** fractional_bits, fractional_bits, num_summands)
    integers = scaled.long() if values.is_floating_point() else values.long()
    return torch.bitwise_and(integers, RING_MASK, out=out)


def decode(elements: Tensor, fractional_bits: int, dtype: torch.dtype) -> Tensor:
    """Ring elements -> numbers of `dtype`: the upper half of the ring is negative; floats divide by 2^b."""
    signed = torch.where(elements >= HALF_RING, elements - (1 << RING_BITS), elements)
    if dtype.is_floating_point:
        return (signed.double() / 2.0 ** fractional_bits).to(dtype)
    return signed.to(dtype)


# Domain tags of the PRG's seeds: one seed never expands into two masks of different roles.
PAIR_TAG, SPARSE_PAIR_TAG, SELF_TAG = 0, 1, 2
# Streams of the simulation's own randomness per round: the graph's order, each client's secrets.
GRAPH_STREAM, SECRETS_STREAM = 10, 11
GENERATOR = 3  # the key agreement's pk = sk · GENERATOR (mod p)
COUNTER_ZERO = modes.CTR(bytes(16))  # every stream starts at counter block 0 (its key differs)


class MaskStreams:
    """Expands seeds into AES-128-CTR mask streams (this module's PRG) and counts them (`drawn`).

    A seed is a tuple of integers in [0, 2^128); BLAKE2b-128 of their 16-byte encodings is the
    stream's AES key. One OpenSSL call per stream writes its keystream into a reused buffer at about
    1 ns per word, a few µs per stream to set up: a counter-based generator vectorized over
    (streams × counters) in numpy (Philox4x32-10) costs over 100 ns per word.
    """

    def __init__(self) -> None:
        self.drawn = 0

    @staticmethod
    def key(seed: tuple[int, ...]) -> bytes:
        """K = BLAKE2b-128 of the seed's integers, 16 little-endian bytes each."""
        return hashlib.blake2b(b"".join([part.to_bytes(16, "little") for part in seed]), digest_size=16).digest()

    def draw(self, seed: tuple[int, ...], length: int) -> np.ndarray:
        """`length` uint64 words of the stream of `seed`; their low 62 bits are ring elements."""
        stream = np.empty(length, dtype=np.uint64)
        encryptor = Cipher(algorithms.AES(self.key(seed)), COUNTER_ZERO).encryptor()
        encryptor.update_into(bytes(8 * length), stream.data.cast("B"))  # AES-CTR of zeros: the keystream
        self.drawn += 1
        return stream

    def signed_sum(self, seeds: Iterable[tuple[tuple[int, ...], int]], length: int) -> Tensor:
        """Σ sign · PRG(seed) over (seed, sign ±1) pairs, as ring elements: (length,) int64."""
        total = np.zeros(length, dtype=np.uint64)
        stream = np.empty(length, dtype=np.uint64)
        zeros, out = bytes(8 * length), stream.data.cast("B")
        for seed, sign in seeds:
            Cipher(algorithms.AES(self.key(seed)), COUNTER_ZERO).encryptor().update_into(zeros, out)
            (np.add if sign > 0 else np.subtract)(total, stream, out=total)  # mod 2^64
            self.drawn += 1
        total &= np.uint64(RING_MASK)
        return torch.from_numpy(total.view(np.int64))


def harary_neighbours(participants: list[int], degree: int, seed: int, round_index: int) -> dict[int, list[int]]:
    """The round's graph: each client's sorted neighbours in the Harary graph H(degree, n) over a
    random order of `participants` seeded by (seed, round); every other client if degree ≥ n − 1.

    `degree` is even: on the random ring each client links to the degree/2 clients on each side.
    """
    n = len(participants)
    if degree >= n - 1:
        return {u: [v for v in participants if v != u] for u in participants}
    order = np.random.default_rng([seed, round_index, GRAPH_STREAM]).permutation(np.asarray(participants))
    half = degree // 2
    offsets = np.concatenate([np.arange(1, half + 1), -np.arange(1, half + 1)])
    linked = np.sort(order[(np.arange(n)[:, None] + offsets) % n], axis=1)  # (n, degree)
    return {int(u): row.tolist() for u, row in zip(order, linked, strict=True)}


def binomial_tail(trials: int, probability: float, at_least: int) -> float:
    """P[Bin(trials, probability) ≥ at_least], summed exactly term by term."""
    if at_least <= 0:
        return 1.0
    return sum(math.comb(trials, m) * probability ** m * (1 - probability) ** (trials - m)
               for m in range(at_least, trials + 1))


def security_threshold(degree: int, num_participants: int, corrupt_fraction: float,
                       security_bits: int = 40) -> int:
    """SecAgg+'s t for k = `degree`: the smallest majority (> k/2) that a client's corrupt neighbours
    reach with probability ≤ 2^-σ / n; a bare majority ⌊k/2⌋ + 1 where no t ≤ k does (k = 0: 0)."""
    if degree == 0:
        return 0
    for t in range(degree // 2 + 1, degree + 1):
        if num_participants * binomial_tail(degree, corrupt_fraction, t) <= 2.0 ** -security_bits:
            return t
    return degree // 2 + 1


def secagg_plus_parameters(num_participants: int, dropout: float, corrupt_fraction: float,
                           security_bits: int = 40, correctness_bits: int = 30) -> tuple[int, int]:
    """(k, t) for SecAgg+ among n participants: the rule of this module's docstring.

    The smallest even k < n − 1 whose t meets the security bounds (2^-σ) and the correctness
    bound (2^-η) under independent corruption (γ) and dropout (δ); else k = n − 1.
    """
    n = num_participants
    security, correctness = 2.0 ** -security_bits, 2.0 ** -correctness_bits
    for k in range(2, n - 1, 2):
        t = security_threshold(k, n, corrupt_fraction, security_bits)
        if (n * binomial_tail(k, corrupt_fraction, t) <= security
                and n * (corrupt_fraction + dropout) ** (k // 2) <= security
                and n * binomial_tail(k, dropout, k - t + 1) <= correctness):
            return k, t
    k = max(n - 1, 0)  # every client neighbours all others
    return k, security_threshold(k, n, corrupt_fraction, security_bits)


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
        self._upper: dict[int, Tensor] = {}

    def upper(self, side: int) -> Tensor:
        """Flat positions i·d + j (i ≤ j) of a d × d matrix's upper triangle, row by row: one
        index_select per client instead of a 2-D gather (10× slower) and a fresh triu_indices."""
        if side not in self._upper:
            rows, cols = torch.triu_indices(side, side)
            self._upper[side] = rows * side + cols
        return self._upper[side]

    def flatten(self, uploads: Mapping[str, Tensor], fractional_bits: int, num_summands: int) -> Tensor:
        """Encoded ring elements of every field, concatenated: (length,) int64."""
        message, start = torch.empty(self.length, dtype=torch.int64), 0
        for field in self.fields:
            value = uploads[field.name].detach().cpu()
            if field.packed:
                side = field.shape[-1]
                value = value.reshape(*field.shape[:-2], side * side).index_select(-1, self.upper(side))
            encode(value.reshape(-1), fractional_bits, num_summands, out=message[start:start + field.length])
            start += field.length
        return message

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

    A client calls `masked_upload` (encode, then mask); the server adds what it receives with
    `receive` (ring sums only) and, once the round closes, `unmask` removes the masks that did not
    cancel and decodes the exact sum of the survivors' uploads. In one process, `add` does both
    sides for one client and defers its masks, so that `total` draws those of all the clients at
    once. Several aggregators (one per process, or one per ClientApp) built with the same arguments
    agree on every seed, graph and share; their `total`s are summed with `ring_sum` before `unmask`.

    Args:
        participants: U, the client ids of the round (those selected before any dropout).
        seed, round_index: what the pair seeds, the graph and the clients' secrets derive from.
        fixed_point_bits: b of the encoding round(x · 2^b).
        symmetric: upload names sent as their upper triangle.
        graph: "complete" (all-pairs masks) or "sparse" (SecAgg+).
        degree, threshold: SecAgg+'s k and t (`sparse` only); k ≥ n − 1 links every pair.
    """

    def __init__(self, participants: Iterable[int], *, seed: int, round_index: int,
                 fixed_point_bits: int = 32, symmetric: Collection[str] = (), graph: str = "complete",
                 degree: int | None = None, threshold: int | None = None) -> None:
        self.participants = sorted({int(c) for c in participants})
        self._members = frozenset(self.participants)
        self.seed, self.round_index, self.fixed_point_bits = seed, round_index, fixed_point_bits
        self.symmetric = frozenset(symmetric)
        self.graph = graph
        self.layout: UploadLayout | None = None
        self._received: Tensor | None = None  # ring sum of what reached this server, less `_pending`'s masks
        self._pending: list[int] = []  # clients `add`ed whose masks are not drawn yet
        self.streams = MaskStreams()
        n = len(self.participants)
        if graph == "complete":
            self.degree, self.threshold = n - 1, 0
            self.neighbours = None
        elif graph == "sparse":
            if degree is None or threshold is None:
                raise ValueError("a sparse (SecAgg+) round needs its degree and threshold "
                                 "(secure_aggregator() chooses them from the Federation)")
            if n < 2:
                raise ValueError(f"round {round_index}: SecAgg+ needs at least 2 clients in a round, got {n}: "
                                 "use federation.secure_aggregation_graph=complete")
            self.degree = min(degree, n - 1)  # n − 1: every client neighbours all others
            if self.degree < n - 1 and self.degree % 2:
                raise ValueError(f"SecAgg+'s degree must be even (k/2 neighbours on each side), got {degree}")
            if not 1 <= threshold <= self.degree:
                raise ValueError(
                    f"round {round_index}: a threshold of {threshold} shares cannot be met with {self.degree} "
                    f"neighbours among {n} clients: set federation.secagg_threshold to at most {self.degree} "
                    "(or raise federation.secagg_degree)")
            self.threshold = threshold
            self.neighbours = harary_neighbours(self.participants, self.degree, seed, round_index)
            self._secrets: dict[int, tuple[int, int, list[int], list[int]]] = {}
            self._public_keys: dict[int, int] = {}
        else:
            raise ValueError(f"secure aggregation graph {graph!r}: use 'complete' or 'sparse'")

    def settings(self) -> dict:
        """What a remote client needs to build the same aggregator (plain JSON values)."""
        return {"participants": self.participants, "seed": self.seed, "bits": self.fixed_point_bits,
                "symmetric": sorted(self.symmetric), "graph": self.graph,
                "degree": self.degree, "threshold": self.threshold}

    @classmethod
    def from_settings(cls, settings: Mapping, round_index: int) -> SecureAggregator:
        """The aggregator `settings()` describes (settings without a graph: the all-pairs scheme)."""
        graph = settings.get("graph", "complete")
        return cls(settings["participants"], seed=settings["seed"], round_index=round_index,
                   fixed_point_bits=settings["bits"], symmetric=settings["symmetric"], graph=graph,
                   degree=settings.get("degree") if graph == "sparse" else None,
                   threshold=settings.get("threshold") if graph == "sparse" else None)

    def set_layout(self, uploads: Mapping[str, Tensor]) -> UploadLayout:
        """Fix the message layout from one upload (its names, shapes and dtypes; values unused)."""
        if self.layout is None:
            self.layout = UploadLayout(uploads, self.symmetric)
            self._received = torch.zeros(self.layout.length, dtype=torch.int64)
        return self.layout

    @property
    def total(self) -> Tensor | None:
        """Σ y_i mod 2^62 over the messages received here (None before any). The masks of the
        clients `add`ed since the last read are drawn now, all of them in one pass."""
        if self._pending and self.layout is not None and self._received is not None:
            seeds = [seed for client in self._pending for seed in self._mask_seeds(client)]
            self._received = ring_add(self._received, self.streams.signed_sum(seeds, self.layout.length))
            self._pending = []
        return self._received

    @property
    def bytes_per_client(self) -> int:
        """Bytes of one masked message: 8 per ring element (int64)."""
        return 8 * self.layout.length if self.layout is not None else 0

    # ---- a client's side ----------------------------------------------------------------------
    def _client_secrets(self, client: int) -> tuple[int, int, list[int], list[int]]:
        """Client `client`'s own randomness for the round: (sk, b, the coefficients of its sk and
        b sharing polynomials), elements of F_p. Derived from (seed, round, client) so that every
        process draws the same; only the client itself (and its dealing of shares) reads them.
        SHAKE-128 of those numbers, 16 bytes per element (a tenth of numpy's SeedSequence)."""
        if client not in self._secrets:
            count = 2 * self.threshold  # sk, b and 2 (t − 1) coefficients
            origin = b"".join(part.to_bytes(16, "little")
                              for part in (SECRETS_STREAM, self.seed, self.round_index, client))
            data = hashlib.shake_128(origin).digest(16 * count)
            values = [int.from_bytes(data[16 * i:16 * i + 16], "little") % shamir.PRIME for i in range(count)]
            t = self.threshold
            self._secrets[client] = (values[0], values[1], values[2:t + 1], values[t + 1:])
        return self._secrets[client]

    def public_key(self, client: int) -> int:
        """pk = sk · 3 (mod p), which the client advertises to the round (kept: everyone reads it)."""
        if client not in self._public_keys:
            self._public_keys[client] = self._client_secrets(client)[0] * GENERATOR % shamir.PRIME
        return self._public_keys[client]

    def _mask_seeds(self, client: int) -> list[tuple[tuple[int, ...], int]]:
        """(seed, sign) of every stream client i adds to its upload: +PRG(s_ij) for j > i, −PRG(s_ij)
        for j < i over its neighbours (all others for `complete`), and +PRG(b_i) under SecAgg+."""
        if self.neighbours is None:
            return [((PAIR_TAG, self.seed, self.round_index, min(client, other), max(client, other)),
                     1 if other > client else -1) for other in self.participants if other != client]
        key, self_seed, _, _ = self._client_secrets(client)
        seeds = [((SPARSE_PAIR_TAG, key * self.public_key(other) % shamir.PRIME), 1 if other > client else -1)
                 for other in self.neighbours[client]]
        return [*seeds, ((SELF_TAG, self_seed), 1)]

    def masked_upload(self, client: int, upload: Mapping[str, Tensor]) -> Tensor:
        """Client `client`'s message y_i: its encoded upload plus its masks, (length,) int64."""
        if client not in self._members:
            raise ValueError(f"client {client} is not a participant of this round")
        layout = self.set_layout(upload)
        encoded = layout.flatten(upload, self.fixed_point_bits, len(self.participants))
        return ring_add(encoded, self.mask(client))

    def mask(self, client: int) -> Tensor:
        """Client i's masks Σ ±PRG(s_ij) (+ PRG(b_i) under SecAgg+), as ring elements of the layout's
        length: what `masked_upload` adds to the encoding."""
        if self.layout is None:
            raise RuntimeError("a mask needs the uploads' layout: set it from one client's upload (set_layout)")
        return self.streams.signed_sum(self._mask_seeds(client), self.layout.length)

    @property
    def sparse_neighbours(self) -> dict[int, list[int]]:
        """SecAgg+'s neighbours N(i) of every participant (a `sparse` round's)."""
        if self.neighbours is None:
            raise ValueError("an all-pairs (complete) round has no graph of neighbours and no shares")
        return self.neighbours

    def shares_held(self, holder: int) -> dict[int, tuple[int, int]]:
        """What client `holder` received in step 3: {dealer: (share of sk, share of b)} from each neighbour."""
        held = {}
        for dealer in self.sparse_neighbours[holder]:
            key, self_seed, key_coefficients, self_coefficients = self._client_secrets(dealer)
            held[dealer] = (shamir.share(key, key_coefficients, holder),
                            shamir.share(self_seed, self_coefficients, holder))
        return held

    def reveal(self, survivors: Collection[int]) -> dict[tuple[str, int], dict[int, int]]:
        """Step 5, the survivors' answers: {("self", u) or ("key", u): {holder: share}}. A survivor
        gives, for each neighbour u, the share of b_u if u uploaded, else the share of sk_u."""
        uploaded = set(survivors)
        revealed: dict[tuple[str, int], dict[int, int]] = {}
        for dealer in self.participants:  # N is symmetric: u's surviving neighbours hold u's shares
            holders = [holder for holder in self.sparse_neighbours[dealer] if holder in uploaded]
            if holders:
                key, self_seed, key_coefficients, self_coefficients = self._client_secrets(dealer)
                kind, secret, coefficients = (("self", self_seed, self_coefficients) if dealer in uploaded
                                              else ("key", key, key_coefficients))
                # the shares `dealer` dealt them in step 3 (evaluated here, when they are sent on)
                revealed[(kind, dealer)] = shamir.split(secret, coefficients, holders)
        return revealed

    # ---- the server's side --------------------------------------------------------------------
    def receive(self, masked: Tensor) -> None:
        """The server adds one masked message to its running ring sum."""
        self._received = masked.clone() if self._received is None else ring_add(self._received, masked)

    def add(self, client: int, upload: Mapping[str, Tensor]) -> None:
        """A client masks its upload and the server receives it, as `receive(masked_upload(...))`.

        Σ_i y_i = Σ_i enc(x_i) + Σ_i masks_i: the encoding (and its ring-bound check) is added now,
        the client's k + 1 streams (n − 1 for `complete`) with every other added client's when
        `total` is read.
        """
        if client not in self._members:
            raise ValueError(f"client {client} is not a participant of this round")
        layout = self.set_layout(upload)
        self.receive(layout.flatten(upload, self.fixed_point_bits, len(self.participants)))
        self._pending.append(client)

    def unmask(self, total: Tensor, uploaded: Collection[int],
               revealed: Mapping[tuple[str, int], Mapping[int, int]] | None = None) -> dict[str, Tensor]:
        """The exact sum of the uploads of `uploaded` (the survivors S), from the ring sum of their messages.

        `complete`: removes Σ_{i∈S, j∈U∖S} ±PRG(s_ij). `sparse`: reconstructs the secrets from the
        survivors' shares (`revealed`, default `reveal(uploaded)`) and removes the self-masks and
        the masks shared with dropped neighbours. Raises RuntimeError when a secret the server
        needs has fewer than t shares.
        """
        if self.layout is None:
            raise RuntimeError("unmask needs the uploads' layout: set it from one client's upload (set_layout)")
        survivors = sorted({int(c) for c in uploaded})
        masks = self.streams.signed_sum(self._leftover_seeds(survivors, revealed), self.layout.length)
        return self.layout.unflatten(ring_sub(total, masks), self.fixed_point_bits)

    def _leftover_seeds(self, survivors: list[int], revealed) -> list[tuple[tuple[int, ...], int]]:
        """(seed, sign) of the masks in Σ_{i∈S} y_i that did not cancel."""
        uploaded = set(survivors)
        dropped = [c for c in self.participants if c not in uploaded]
        if self.neighbours is None:
            return [((PAIR_TAG, self.seed, self.round_index, min(i, j), max(i, j)), 1 if j > i else -1)
                    for i in survivors for j in dropped]
        revealed = self.reveal(survivors) if revealed is None else revealed
        seeds: list[tuple[tuple[int, ...], int]] = [
            ((SELF_TAG, self._reconstruct(revealed, "self", i, "self-mask seed b")), 1) for i in survivors]
        for j in dropped:
            linked = [i for i in self.sparse_neighbours[j] if i in uploaded]
            if linked:  # j's masks sit only in its surviving neighbours' uploads
                key = self._reconstruct(revealed, "key", j, "key sk")
                seeds += [((SPARSE_PAIR_TAG, key * self.public_key(i) % shamir.PRIME), 1 if j > i else -1)
                          for i in linked]
        return seeds

    def _reconstruct(self, revealed, kind: str, client: int, what: str) -> int:
        try:
            return shamir.reconstruct(revealed.get((kind, client), {}), self.threshold,
                                      what=f"client {client}'s {what}")
        except ValueError as error:
            every_other = self.degree >= len(self.participants) - 1  # a larger degree adds no holder
            raise RuntimeError(
                f"round {self.round_index}: {error} (of its {len(self.sparse_neighbours[client])} neighbours): "
                + ("set federation.secure_aggregation_graph=complete or lower federation.dropout" if every_other else
                   "lower federation.secagg_threshold, raise federation.secagg_degree, or lower federation.dropout")
            ) from None

    def costs(self, uploaded: Collection[int]) -> dict[str, int]:
        """What the round costs, from the protocol's structure (the same on every process):
        mask streams the survivors drew, share bytes dealt by all participants and revealed by the
        survivors, and the mask streams the server draws to unmask."""
        survivors = {int(c) for c in uploaded}
        dropped = [c for c in self.participants if c not in survivors]
        if self.neighbours is None:
            n = len(self.participants)
            return {"mask_streams": len(survivors) * (n - 1), "share_bytes": 0,
                    "server_mask_streams": len(survivors) * len(dropped)}
        degree = {c: len(self.neighbours[c]) for c in self.participants}
        dealt = sum(2 * degree[c] for c in self.participants)
        revealed = sum(degree[c] for c in survivors)
        return {"mask_streams": sum(degree[c] + 1 for c in survivors),
                "share_bytes": shamir.SHARE_BYTES * (dealt + revealed),
                "server_mask_streams": len(survivors) + sum(
                    1 for j in dropped for i in self.neighbours[j] if i in survivors)}


def secagg_plus_settings(federation, num_participants: int) -> tuple[int, int]:
    """SecAgg+'s (k, t) for a round of `num_participants` under `federation`: the configured ones,
    or those `secagg_plus_parameters` chooses for n (a configured k alone gets its security t)."""
    n = num_participants
    rule_degree, rule_threshold = secagg_plus_parameters(n, federation.dropout, federation.secagg_corrupt_fraction)
    degree = federation.secagg_degree or rule_degree
    threshold = federation.secagg_threshold or (
        rule_threshold if degree == rule_degree else
        security_threshold(min(degree, n - 1), n, federation.secagg_corrupt_fraction))
    return degree, threshold


def check_secure_aggregation(federation, num_clients: int, population: int) -> None:
    """Before any round of a fit over `num_clients` (K) clients, `population` of them with data:
    SecAgg+ settings that no round can unmask are refused (ValueError naming a fix that works),
    and a threshold of one share is warned about.

    Where every client neighbours all the others (k ≥ n − 1, as at small n), each survivor's
    self-mask seed has the n − 1 − m other survivors as its only holders, m = round(dropout · K)
    the clients that drop out of every round (the cohort being every client with data): fewer than
    t and round 0 fails after its work. A larger k cannot help there; all-pairs masks recover any
    dropout, and fewer dropouts leave enough holders. (With k < n − 1 whether a round's dropouts
    hit t of one client's k neighbours is chance, which the rule's k and t bound.)"""
    if not (federation.secure_aggregation and federation.secure_aggregation_graph == "sparse") or population < 2:
        return
    n = population
    degree, threshold = secagg_plus_settings(federation, n)
    if threshold == 1:
        chosen = federation.secagg_threshold is not None
        why = "federation.secagg_threshold=1" if chosen else f"{n} clients"
        fix = ("leave federation.secagg_threshold unset (a majority of the neighbours, chosen for the corrupt "
               "fraction) or " if chosen else "")
        warnings.warn(f"SecAgg+ with a threshold of one share ({why}): any one neighbour's share reveals a client's "
                      "secrets, so a single corrupt neighbour and the server unmask its upload; "
                      f"{fix}use federation.secure_aggregation_graph=complete", UserWarning, stacklevel=1)
    dropped = round(federation.dropout * num_clients)
    if federation.sample_rate < 1 or n != num_clients or dropped == 0 or min(degree, n - 1) < n - 1:
        return  # cohorts, or clients without data: how many of a round's clients drop out varies
    holders, most = n - 1 - dropped, n - 1 - threshold  # survivors holding a seed; the most dropouts that leave t
    if holders < threshold:
        below = (most + 0.5) / num_clients  # round(dropout · K) ≤ most
        lower = f"federation.dropout below {below:.3g} (at most {most} of {num_clients} dropping out)"
        raise ValueError(
            f"SecAgg+ cannot unmask a round here: among {n} clients each one neighbours all {n - 1} others, "
            f"{dropped} drop out of every round (federation.dropout={federation.dropout:g}), and each survivor's "
            f"self-mask seed then has {holders} surviving holder{'s' if holders != 1 else ''} of the {threshold} "
            f"shares it needs: set federation.secure_aggregation_graph=complete (all-pairs masks recover any "
            f"dropout) or {lower}")


def secure_aggregator(federation, participants: Iterable[int], round_index: int,
                      symmetric: Collection[str] = ()) -> SecureAggregator:
    """The round's aggregator under `federation` (a `Federation`): its graph, and for SecAgg+ the
    configured k and t or those `secagg_plus_parameters` chooses for the round's n."""
    participants = sorted({int(c) for c in participants})
    degree = threshold = None
    if federation.secure_aggregation_graph == "sparse":
        degree, threshold = secagg_plus_settings(federation, len(participants))
    return SecureAggregator(participants, seed=federation.seed, round_index=round_index,
                            fixed_point_bits=federation.fixed_point_bits, symmetric=symmetric,
                            graph=federation.secure_aggregation_graph, degree=degree, threshold=threshold)
