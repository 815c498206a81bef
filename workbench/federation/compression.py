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
  lo and step as float32 (8 bytes per tensor). `symmetric=True`: levels k · step for
  k ∈ {−L, …, L}, L = 2^(b−1) − 1, step = max|x| / L (a level at 0; b ≥ 2), one float32 scale.

- `ScaledSign`: 1 bit per entry, the sign, times the tensor's mean magnitude ‖x‖₁ / n (the
  scaled sign of error-feedback signSGD, Karimireddy et al., ICML 2019): ceil(numel/8) bytes
  plus one float32 scale per tensor.

Error feedback (`Residuals`, set by `ErrorFeedback`) keeps, per client, what compression lost and adds it to
the next round's update: target = update + e, e ← target − reconstruction. It stays bounded
when the compressor is contractive, ‖C(x) − x‖² ≤ (1 − δ) ‖x‖² with δ > 0 (then
‖e‖ ≤ √(1−δ) / (1 − √(1−δ)) · max ‖update‖). Top-k (δ ≥ k/P) and the scaled sign (δ ≥ 1/n per
tensor) are, for every x, and so is symmetric quantization (0 is a level, so no entry moves by
more than its size, and the largest is exact: δ ≥ 1/n). Min-max b-bit quantization has no level
at 0: entries at 0 of a tensor whose extremes are ±a move by up to a / (2^b − 1). At 4 and 8 bits
it contracts Gaussian, heavy-tailed and sparse draws (tested) but not every x; at 2–3 bits it
expands sparse and heavy-tailed ones (up to 7× ‖x‖² at 2 bits), and at 1 bit it sends every
entry as lo or hi. So FedAvg refuses min-max quantization below 4 bits with error feedback (use
`quantize_symmetric`, or `sign` for 1 bit). For compressors that are not (OS-FED's snapshots), `ErrorFeedback`
offers two guards beside the plain form: a bound ‖e_k‖ ≤ c · ‖update_k‖ (the residual is
rescaled onto it) and a decay e ← γ · e.

The settings are two frozen dataclasses, read by the command line as nested keys:
`compression` (`Compression`: kind, topk_fraction, quantize_bits, quantize_symmetric) and
`error_feedback` (`ErrorFeedback`: enabled, bound, decay).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from workbench.federation.client_state import ClientTable

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

    def wire_bytes(self, value: Tensor) -> int:
        """One client's message (a `codec.Encoding`: the compressed update's bytes, whatever `value`)."""
        return self.bytes_per_client()


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
    """Uniform `bits`-bit quantization per parameter tensor, round to nearest: min-max, or
    symmetric about 0 (`symmetric`, contractive)."""

    def __init__(self, sizes: Sequence[int], bits: int, symmetric: bool = False) -> None:
        super().__init__(sizes)
        if not 1 + symmetric <= bits <= 16:
            raise ValueError(f"quantization bits must be in {1 + symmetric}..16"
                             f"{' (symmetric levels need 2 bits)' if symmetric else ''}, got {bits}")
        self.bits, self.symmetric = bits, symmetric

    def __call__(self, updates: Tensor) -> Tensor:
        if self.symmetric:
            return self.symmetric_levels(updates)
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

    def symmetric_levels(self, updates: Tensor) -> Tensor:
        levels = 2 ** (self.bits - 1) - 1
        pieces = []
        for block in updates.split(self.sizes, dim=1):
            step = as_sent(block.abs().max(1, keepdim=True).values / levels)
            codes = torch.round(block / step.clamp_min(torch.finfo(block.dtype).tiny)).clamp(-levels, levels)
            pieces.append(step * codes)
        return torch.cat(pieces, 1)

    def bytes_per_client(self) -> int:
        scales = 1 if self.symmetric else 2
        return sum(math.ceil(size * self.bits / 8) + scales * FLOAT_BYTES for size in self.sizes)


class ScaledSign(Compressor):
    """sign(x) · ‖x‖₁ / n per parameter tensor (1 bit per entry and one float32 scale)."""

    def __call__(self, updates: Tensor) -> Tensor:
        pieces = []
        for block in updates.split(self.sizes, dim=1):
            scale = as_sent(block.abs().mean(1, keepdim=True))
            pieces.append(torch.where(block >= 0, scale, -scale))  # sign(0) sent as +
        return torch.cat(pieces, 1)

    def bytes_per_client(self) -> int:
        return sum(math.ceil(size / 8) + FLOAT_BYTES for size in self.sizes)


COMPRESSIONS = ("none", "topk", "quantize", "sign")


@dataclass(frozen=True)
class Compression:
    """How a client's update is compressed for the wire.

    kind: `none` (dense float32), `topk`, `quantize` or `sign` (scaled sign, 1 bit per entry).
    topk_fraction: share of the P entries `topk` keeps; quantize_bits: bits per entry of
        `quantize`; quantize_symmetric: levels symmetric about 0 (contractive) instead of min-max.
    """

    kind: Literal["none", "topk", "quantize", "sign"] = "none"
    topk_fraction: float = 0.01
    quantize_bits: int = 8
    quantize_symmetric: bool = False

    def __post_init__(self) -> None:
        if self.kind not in COMPRESSIONS:
            raise ValueError(f"unknown compression.kind {self.kind!r}; choose one of {', '.join(COMPRESSIONS)}")
        if not 0 < self.topk_fraction <= 1 or not 1 <= self.quantize_bits <= 16:
            raise ValueError(f"compression.topk_fraction must be in (0, 1] and compression.quantize_bits in 1..16, "
                             f"got {self.topk_fraction} and {self.quantize_bits}")
        if self.kind == "quantize" and self.quantize_symmetric and self.quantize_bits < 2:
            raise ValueError("symmetric quantization needs compression.quantize_bits ≥ 2; for 1 bit use "
                             "compression.kind=sign")

    @property
    def lossy(self) -> bool:
        return self.kind != "none"

    def build(self, sizes: Sequence[int]) -> Compressor:
        """The compressor of a model whose parameter tensors have `sizes` entries."""
        if self.kind == "topk":
            return TopK(sizes, self.topk_fraction)
        if self.kind == "quantize":
            return Quantize(sizes, self.quantize_bits, self.quantize_symmetric)
        if self.kind == "sign":
            return ScaledSign(sizes)
        return Dense(sizes)


@dataclass(frozen=True)
class ErrorFeedback:
    """Each client's carry of what its lossy upload lost into its next upload.

    enabled: carry it (e_k ← target − sent; target = update + e_k).
    bound: c, keep ‖e_k‖ ≤ c · ‖update_k‖ (None: the plain, unbounded form).
    decay: γ ∈ [0, 1], e ← γ e (1: the plain form).
    """

    enabled: bool = True
    bound: float | None = None
    decay: float = 1.0

    def __post_init__(self) -> None:
        if (self.bound is not None and not self.bound >= 0) or not 0 <= self.decay <= 1:
            raise ValueError(f"error_feedback.bound must be None or ≥ 0 and error_feedback.decay in [0, 1], "
                             f"got {self.bound} and {self.decay}")

    def residuals(self, numel: int) -> Residuals:
        """The clients' residuals of an upload of `numel` entries, with this guard."""
        return Residuals(numel, bound=self.bound, decay=self.decay)


def guarded_residual(residual: Tensor, updates: Tensor, *, bound: float | None, decay: float) -> Tensor:
    """γ · e, then rescaled row by row onto ‖e_k‖ ≤ c · ‖update_k‖ (c = bound; None: no bound)."""
    if decay != 1:
        residual = decay * residual
    if bound is not None:
        limit = bound * updates.norm(dim=1, keepdim=True)
        norm = residual.norm(dim=1, keepdim=True)
        residual = residual * torch.where(norm > limit, limit / norm.clamp_min(torch.finfo(norm.dtype).tiny), 1)
    return residual


class Residuals(nn.Module):
    """Error feedback's per-client residuals e (P,) of a lossy upload, kept across rounds
    (checkpointed) for the clients that have uploaded (`residuals`, a `ClientTable`: a client never
    sampled has e = 0 and holds no row).

    bound: c, keep ‖e_k‖ ≤ c · ‖update_k‖ (None: the plain form); decay: γ, e ← γ · e.
    """

    def __init__(self, numel: int, *, bound: float | None = None, decay: float = 1.0) -> None:
        super().__init__()
        ErrorFeedback(bound=bound, decay=decay)  # the same checks
        self.bound, self.decay = bound, decay
        self.residuals = ClientTable(torch.zeros(numel))

    def residual(self, clients: Tensor) -> Tensor:
        """e of the m clients: (m,) -> (m, P)."""
        return self.residuals.read(clients)

    def target(self, clients: Tensor, updates: Tensor) -> Tensor:
        """update + e for the m clients: (m,), (m, P) -> (m, P)."""
        return updates + self.residual(clients).to(updates)

    def keep(self, clients: Tensor, target: Tensor, sent: Tensor, updates: Tensor | None = None) -> Tensor:
        """e ← target − what the server will reconstruct, guarded (`updates`: the fresh (m, P),
        needed by the bound); returns the m new residuals."""
        residual = target - sent
        if self.bound is not None or self.decay != 1:
            if updates is None and self.bound is not None:
                raise ValueError("Residuals.keep needs the fresh updates to apply the error feedback's bound")
            residual = guarded_residual(residual, updates if updates is not None else residual, bound=self.bound,
                                        decay=self.decay)
        self.residuals.write(clients, residual)
        return residual
