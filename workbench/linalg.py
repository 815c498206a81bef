"""Linear-algebra helpers shared by the analytic methods."""
from __future__ import annotations

import warnings

import torch
from torch import Tensor


def identity_like(gram: Tensor) -> Tensor:
    """The identity matrix with the shape, dtype and device of a square `gram`."""
    return torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)


def class_sums(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """`Xᵀ Y` for one-hot `Y` without building `Y`: (n, d), (n,) -> (d, C).

    A segment sum over labels costs O(n·d) instead of the O(n·d·C) matmul with a one-hot matrix.
    """
    sums = features.new_zeros(num_classes, features.shape[1])
    return sums.index_add_(0, labels, features).T


def solve_spd(gram: Tensor, rhs: Tensor, *, what: str = "Gram matrix") -> Tensor:
    """Solve `gram · W = rhs` for a symmetric positive (semi-)definite `gram`: (d, d), (d, C) -> (d, C).

    Cholesky when `gram` is positive definite; otherwise a warning and the minimum-norm
    least-squares solution (the pseudo-inverse), which is what ridge with zero
    regularization means on rank-deficient data.
    """
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, factor)
    warnings.warn(
        f"{what} ({gram.shape[0]}×{gram.shape[0]}) is singular (Cholesky failed at pivot {int(info)}); "
        "falling back to the least-squares (pseudo-inverse) solution. Set a positive regularization "
        "(e.g. gamma_out > 0) for a unique, well-conditioned solution.",
        stacklevel=2,
    )
    # Pseudo-inverse through the eigendecomposition: `gram` is symmetric, so this is the SVD.
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    cutoff = eigenvalues.abs().max() * gram.shape[0] * torch.finfo(gram.dtype).eps
    inverse = torch.where(eigenvalues > cutoff, 1 / eigenvalues, torch.zeros_like(eigenvalues))
    return eigenvectors @ (inverse[:, None] * (eigenvectors.T @ rhs))


def packed_symmetric_numel(side: int) -> int:
    """Numbers needed to send a symmetric `side × side` matrix as its upper triangle."""
    return side * (side + 1) // 2
