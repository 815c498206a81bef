"""The screen: each client's statistics checked before they are summed (a defence for the
analytic methods).

An analytic method sums every client's Gram and cross-covariance, so one poisoned upload moves
its solution (docs/robustness.md). With `federation.aggregation: screen` each client's statistics
reach the server as its own row (stacked instead of summed: the same bytes, plus its count of
rows n, 8 bytes: `ROWS`), and the server checks every upload that is a Gram of the client's
training rows (`codec.Upload(gram=True)`: XᵀX, FᵀF, a second moment, one block per class):

- **valid**: an honest Gram S is positive semidefinite, so S + (|tr S| / 10d)·I has a Cholesky
  factor (the shift covers rounding). A Gram scaled by s < 0 has no such factor: its most negative
  eigenvalue s·λ_max, with λ_max ≥ tr S / d, outweighs the shift |s|·tr S / 10d;
- **in scale**: its trace per training row, tr S / n (the rows' mean squared norm, plus what a
  method adds per client, e.g. AFL's γ·d / n), is within a factor τ (`aggregation_threshold`) of
  the round's median over the valid clients not rejected before: a client scaling its statistics
  by s ≥ τ fails.

A client failing either is rejected: its uploads stay out of the sum and it counts as dropped
from the round, so an analytic method's round is exactly the centralized solution on the clients
kept (as under dropout); and it stays rejected for the rest of the fit (`barred`), also in rounds
that send no Gram to check (AFL's γ scoring round, AnaPFL's λ round). With no client rejected the result is the
plain sum of every client's statistics (summed here instead of on the way: equal up to the order
of additions).

What it cannot see: label-dependent statistics (a cross-covariance, class sums) differ
legitimately between non-IID clients, so a client that flips its labels, or lies only there and
keeps its Gram honest, passes; so does one that claims a false n with statistics scaled to match
(n is taken on trust). The scale check needs most of a round's clients honest (its reference is
their median). The server holds every client's statistics until the round's decision: the
round's clients × one client's upload in memory.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from workbench.federation import codec

#: the protocol's upload under the screen: each client's count of rows (those it holds out included)
ROWS = "training_rows"


def valid_gram(gram: Tensor) -> bool:
    """Whether one client's Gram (..., d, d) — each block — is positive semidefinite up to rounding
    (an all-zero block, e.g. a class the client lacks, is)."""
    gram = gram.double()
    side = gram.shape[-1]
    magnitude = gram.diagonal(dim1=-2, dim2=-1).sum(-1).abs()
    shifted = gram + (magnitude / (10 * side))[..., None, None] * torch.eye(side, dtype=gram.dtype, device=gram.device)
    factored = torch.linalg.cholesky_ex(shifted).info == 0
    return bool((factored | (gram == 0).flatten(-2).all(-1)).all())


@dataclass(frozen=True)
class Decision:
    """The screen's decision on a round's m clients, (m,) bool each: `kept`, and why the others
    were not: an `invalid` Gram, one `out_of_scale`, or `barred` (rejected in an earlier round)."""

    kept: Tensor
    invalid: Tensor
    out_of_scale: Tensor
    barred: Tensor


def decide(uploads: Mapping[str, Tensor], spec: codec.Spec, threshold: float, barred: Tensor) -> Decision:
    """The screen's decision on the round's clients, from their stacked uploads (one row each, in
    client order, `ROWS` among them), the method's upload `spec` and who is `barred` ((m,) bool)."""
    rows, barred = uploads[ROWS].reshape(-1).double(), barred.cpu()
    valid = torch.ones(len(rows), dtype=torch.bool)
    energies = []
    for name in codec.gram_names(spec):
        if name not in uploads:  # (a round may send some of its method's uploads)
            continue
        grams = uploads[name]  # (a barred client's is not factored: it stays out whatever it sends)
        valid &= torch.tensor([bool(out) or valid_gram(gram) for gram, out in zip(grams, barred, strict=True)])
        energies.append(grams.diagonal(dim1=-2, dim2=-1).reshape(len(rows), -1).double().sum(1).cpu() / rows)
    reference, in_scale = valid & ~barred, torch.ones_like(valid)
    for energy in energies:
        if reference.any():  # the median of the others' (of two middle values, their mean)
            ratio = energy / energy[reference].quantile(0.5)
            in_scale &= (ratio <= threshold) & (ratio >= 1 / threshold)
    return Decision(valid & in_scale & ~barred, ~valid & ~barred, valid & ~in_scale & ~barred, barred)


def screen(uploads: Mapping[str, Tensor], spec: codec.Spec, threshold: float,
           barred: Tensor) -> tuple[dict[str, Tensor], Decision]:
    """The round's uploads as the method expects them — summed over the clients kept (or their
    rows, for an upload the method stacks) — and the decision (`decide`)."""
    decision = decide(uploads, spec, threshold, barred)
    kept = decision.kept
    combined = {}
    for name, value in uploads.items():
        if name != ROWS:
            rows = value if kept.all() else value[kept.to(value.device)]  # (no copy when all pass)
            combined[name] = rows if spec[name].stacked else rows.sum(0)
    return combined, decision
