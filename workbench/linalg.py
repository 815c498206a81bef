"""Linear-algebra helpers shared by the analytic methods, and the seeded draws of their random maps."""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor


def stream_generator(seed: int, *stream: int) -> torch.Generator:
    """The CPU generator of random stream `stream` of `seed` (numpy's SeedSequence of the numbers,
    e.g. (seed, round, stream)): the same numbers on every machine and process, and the streams of
    one seed independent of each other. A random map drawn from it is rebuilt from its seed alone
    (8 bytes on the wire, never the matrix)."""
    state = int(np.random.SeedSequence([seed, *stream]).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(state)


#: the dtypes the analytic methods' statistics and solves may take (Cholesky has no half-precision kernels)
STATISTICS_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def statistics_dtype(name: str) -> torch.dtype:
    """The torch dtype of a method's `dtype` setting; ValueError naming the choices otherwise."""
    if name not in STATISTICS_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(STATISTICS_DTYPES)} (the statistics and the solve), "
                         f"got {name!r}")
    return STATISTICS_DTYPES[name]


def identity_like(gram: Tensor) -> Tensor:
    """The identity matrix with the shape, dtype and device of a square `gram`."""
    return torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)


def class_sums(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """`Xᵀ Y` for one-hot `Y` without building `Y`: (n, d), (n,) -> (d, C).

    A segment sum over labels costs O(n·d) instead of the O(n·d·C) matmul with a one-hot matrix.
    """
    sums = features.new_zeros(num_classes, features.shape[1])
    return sums.index_add_(0, labels, features).T


def add_gram_(gram: Tensor, x: Tensor) -> Tensor:
    """`gram += xᵀx` for a symmetric `gram` (d, d) and x (n, d), in place: of its 2×2 blocks the
    upper three are multiplied and the lower one mirrored (3/4 of the products)."""
    k = x.shape[1] // 2
    if k < 128:  # small: one product is faster than three
        return gram.addmm_(x.T, x)
    left, right = x[:, :k], x[:, k:]
    gram[:k, :k].addmm_(left.T, left)
    gram[:k, k:].addmm_(left.T, right)
    gram[k:, k:].addmm_(right.T, right)
    gram[k:, :k] = gram[:k, k:].T
    return gram


def counts_of(index: Tensor, size: int, dtype: torch.dtype = torch.long) -> Tensor:
    """`torch.bincount(index, minlength=size)` for indices that lie in [0, size) (the callers' invariant;
    outside it CUDA stops with a device-side assert): a scatter, which never waits for the device
    (bincount sizes its output by the largest index, a read to the host)."""
    ones = torch.ones((), dtype=torch.long, device=index.device).expand(index.numel())
    counts = torch.zeros(size, dtype=torch.long, device=index.device).index_add_(0, index.flatten(), ones)
    return counts.to(dtype)  # counted exactly, rounded once


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


def multi_hot_gram(active: Tensor, size: int, *, dtype: torch.dtype = torch.float64,
                   chunk_elements: int = 1 << 21) -> Tensor:
    """`ΦᵀΦ` of multi-hot rows given by their active columns, never building Φ: (n, m) -> (size, size).

    Row i of Φ ∈ {0,1}^{n×size} holds ones at the m columns `active[i]` (a repeated column counts
    twice). `(ΦᵀΦ)_ab` counts the rows active at both a and b: the diagonal is the histogram of
    `active`, and each pair of slots j < l of a row adds one at `(active[i, j], active[i, l])` and
    at its mirror. That is O(n·m²) scatter-adds instead of the O(n·size²) dense one-hot matmul.
    Fastest when slot j keeps its columns in a narrow range (slot j in block j of the columns):
    the pairs of one slot then land in a few rows of the table, which stay in cache.
    """
    n, m = active.shape
    pair_counts = torch.zeros(size * size, dtype=dtype, device=active.device)
    one = torch.ones((), dtype=dtype, device=active.device)
    slots = active.T.contiguous()  # (m, n): the pairs of one slot are formed and counted together
    rows_per_chunk = max(1, chunk_elements // max(1, m - 1))
    keys = torch.empty(min(n, rows_per_chunk) * max(1, m - 1), dtype=torch.long, device=active.device)
    for lo in range(0, n, rows_per_chunk):
        chunk = slots[:, lo:lo + rows_per_chunk]
        for j in range(m - 1):  # one slot at a time keeps the scatter local (see above)
            pair_keys = keys[:(m - 1 - j) * chunk.shape[1]]
            torch.add(chunk[j + 1:], chunk[j] * size, out=pair_keys.view(m - 1 - j, chunk.shape[1]))
            pair_counts.index_add_(0, pair_keys, one.expand(pair_keys.numel()))
    gram = _add_own_transpose_(pair_counts.view(size, size))  # the mirror of every pair
    gram.diagonal().add_(counts_of(active, size, dtype))
    return gram


def _add_own_transpose_(matrix: Tensor, tile: int = 128) -> Tensor:
    """`matrix += matrixᵀ` in place for a square matrix, one pair of tiles at a time.

    A whole-matrix transposed read misses the cache on every element and a full-size temporary
    costs page faults; tiles of 128 × 128 stay in cache and need no large temporary.
    """
    side = matrix.shape[0]
    for i in range(0, side, tile):
        diagonal = matrix[i:i + tile, i:i + tile]
        diagonal.add_(diagonal.T.clone())
        for j in range(i + tile, side, tile):
            upper, lower = matrix[i:i + tile, j:j + tile], matrix[j:j + tile, i:i + tile]
            upper.add_(lower.T)
            lower.copy_(upper.T)
    return matrix


def multi_hot_cross(active: Tensor, values: Tensor, size: int) -> Tensor:
    """`Φᵀ M` for the multi-hot Φ of `multi_hot_gram`, never building Φ: (n, m), (n, p) -> (size, p).

    One index_add per slot: O(n·m·p) instead of the O(n·size·p) dense matmul.
    """
    product = values.new_zeros(size, values.shape[1])
    for slot in active.T:
        product.index_add_(0, slot, values)
    return product


def _padded_group_chunks(groups: Tensor, num_groups: int, group_bytes, max_chunk_bytes: int):
    """Chunks of the non-empty groups, smallest first, each zero-padded to its largest group.

    groups: (n,) int64 in [0, K). group_bytes(size) gives the bytes one group of `size` rows
    costs once padded to `size` (sizes as an int64 tensor). A chunk holds groups whose sizes are
    within a factor 2^(1/4) of each other (so padding adds under 19% of rows), as many as fit in
    `max_chunk_bytes` (at least one).
    Yields (chunk (m,) group ids, rows (m, s) positions into `groups`, valid (m, s) bool).
    """
    device = groups.device
    counts = counts_of(groups, num_groups)
    by_group = torch.argsort(groups, stable=True)  # row positions, grouped
    starts = torch.cumsum(counts, 0) - counts
    host_counts = counts.cpu()  # one read: the chunks are planned on the host
    by_size = torch.argsort(host_counts, stable=True)
    by_size = by_size[host_counts[by_size] > 0]
    sizes = host_counts[by_size]
    by_size_there = by_size.to(device)  # one copy; the chunks are slices of it
    size_class = torch.floor(4 * torch.log2(sizes.double())).long()  # nondecreasing
    chunk_cost = group_bytes(sizes)  # nondecreasing, as the sizes are
    first = 0
    while first < len(by_size):
        members = torch.arange(1, len(by_size) - first + 1)
        # (members) × (cost of the largest member) grows with the chunk: the fitting ones are a prefix
        fitting = (members * chunk_cost[first:] <= max_chunk_bytes) & (size_class[first:] == size_class[first])
        count = max(1, int(fitting.sum()))
        chunk = by_size_there[first:first + count]
        offsets = torch.arange(int(sizes[first + count - 1]), device=device)
        valid = offsets < counts[chunk, None]
        rows = by_group[torch.where(valid, starts[chunk, None] + offsets, 0)]
        yield chunk, rows, valid
        first += count


def grouped_ridge(features: Tensor, targets: Tensor, groups: Tensor, num_groups: int, regularization: float,
                  *, form: str = "auto", max_chunk_bytes: int = 2 ** 28) -> Tensor:
    """Ridge regression of every group on its own rows: (n, d), (n, C), (n,) -> (K, d, C).

        W_k = (X_kᵀX_k + βI)⁻¹ X_kᵀT_k              primal: a d × d solve
            = X_kᵀ(X_kX_kᵀ + βI)⁻¹ T_k              dual (push-through identity): an n_k × n_k solve

    Both are exact for β > 0; `form="auto"` takes the dual for groups with fewer rows than d.
    Groups are solved in chunks by batched Cholesky, each chunk zero-padded to its largest group
    (a zero row changes neither form) and bounded by `max_chunk_bytes`; a group without rows gets
    W_k = 0. Memory is what the solves need (n·d plus a chunk), never K·d² at once.
    """
    if not regularization > 0:
        raise ValueError(f"grouped_ridge needs a regularization > 0, got {regularization}")
    if form not in ("auto", "primal", "dual"):
        raise ValueError(f"form must be 'auto', 'primal' or 'dual', got {form!r}")
    dim, num_targets = features.shape[1], targets.shape[1]
    uses_dual = {"auto": lambda size: size < dim, "primal": lambda size: size < 0,  # size: int or tensor
                 "dual": lambda size: size >= 0}[form]

    def group_bytes(size: Tensor) -> Tensor:
        side = torch.where(uses_dual(size), size, dim)
        return (size * (dim + num_targets) + side * side + 2 * dim * num_targets) * features.element_size()

    weights = features.new_zeros(num_groups, dim, num_targets)
    failed = torch.zeros((), dtype=torch.bool, device=features.device)
    for chunk, rows, valid in _padded_group_chunks(groups, num_groups, group_bytes, max_chunk_bytes):
        x = features[rows] * valid[..., None]  # (m, s, d), zero past each group's end
        t = targets[rows] * valid[..., None]   # (m, s, C)
        if uses_dual(rows.shape[1]):
            kernel = x @ x.mT
            kernel.diagonal(dim1=-2, dim2=-1).add_(regularization)
            factor, info = torch.linalg.cholesky_ex(kernel)  # checked once, after every chunk
            dual = torch.cholesky_solve(t, factor)  # (m, s, C)
            weights[chunk] = (dual.mT @ x).mT  # Xᵀα, as (αᵀX)ᵀ: batched matmuls are slow on a transposed X
        else:
            gram = x.mT @ x
            gram.diagonal(dim1=-2, dim2=-1).add_(regularization)
            factor, info = torch.linalg.cholesky_ex(gram)
            weights[chunk] = torch.cholesky_solve((t.mT @ x).mT, factor)
        failed |= (info != 0).any()
    if bool(failed):
        raise ValueError(f"grouped_ridge: a group's regularized Gram matrix is not numerically positive definite "
                         f"(regularization {regularization}): raise the regularization, or check the features "
                         "for non-finite values")
    return weights


def grouped_matmul(features: Tensor, matrices: Tensor, groups: Tensor, *, max_chunk_bytes: int = 2 ** 28) -> Tensor:
    """Each row times its own group's matrix: (n, d), (K, d, C), (n,) -> (n, C), row i -> x_i W_{g_i}.

    Rows are gathered per group into padded chunks for batched matmuls (the padding rows' outputs
    are dropped): n·d·C work, with no per-row copy of a d × C matrix and no product with every
    group's matrix.
    """
    dim, num_outputs = matrices.shape[1:]
    out = features.new_empty(len(features) + 1, num_outputs)  # row n takes the padding's outputs

    def group_bytes(size: Tensor) -> Tensor:
        return (size * (dim + num_outputs) + dim * num_outputs) * features.element_size()

    for chunk, rows, valid in _padded_group_chunks(groups, len(matrices), group_bytes, max_chunk_bytes):
        out[torch.where(valid, rows, len(features))] = features[rows] @ matrices[chunk]
    return out[:-1]


class MultiHotDesign:
    """A multi-hot design Φ ∈ {0,1}^{n×size} (the ones at `active`'s columns, as in `multi_hot_gram`)
    that applies `ΦᵀΦ` without forming it: Φ and Φᵀ as sparse CSR matrices of n·m ones each.

    Memory is two copies of the n·m indices and ones (plus vectors), never size²: the operator
    behind `multi_hot_ridge` when the size × size Gram would not fit.
    """

    def __init__(self, active: Tensor, size: int, *, dtype: torch.dtype = torch.float64) -> None:
        n, m = active.shape
        index_dtype = torch.int32 if n * m < 2 ** 31 - 1 and max(n, size) < 2 ** 31 - 1 else torch.long
        columns = active.flatten()
        ones = torch.ones(n * m, dtype=dtype, device=active.device)
        row_starts = torch.arange(0, n * m + 1, m, dtype=index_dtype, device=active.device)
        with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used here are plain
            warnings.simplefilter("ignore", UserWarning)
            self.design = torch.sparse_csr_tensor(row_starts, columns.to(index_dtype), ones, (n, size),
                                                  check_invariants=False)
        # Φᵀ in CSR: the nonzeros ordered by column; building it by a sort avoids COO's n·m int64 pairs
        order = torch.argsort(columns, stable=True)
        counts = torch.bincount(columns, minlength=size)
        column_starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(index_dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.transposed = torch.sparse_csr_tensor(column_starts, (order // m).to(index_dtype), ones, (size, n),
                                                      check_invariants=False)
        self.diagonal = counts.to(dtype)  # diag(ΦᵀΦ): every row counts once at each of its columns
        self.size, self.dtype = size, dtype

    def gram_times(self, vectors: Tensor) -> Tensor:
        """`ΦᵀΦ V`: (size, k) -> (size, k), as Φᵀ(Φ V)."""
        return self.transposed @ (self.design @ vectors)


def multi_hot_ridge(design: MultiHotDesign, rhs: Tensor, shifts: Tensor, *, tolerance: float = 1e-10,
                    max_iterations: int | None = None, initial: Tensor | None = None) -> tuple[Tensor, int]:
    """Solve `(ΦᵀΦ + s_c I) w_c = b_c` for every column c by Jacobi-preconditioned conjugate gradients.

    rhs: (size, k); shifts: (k,) > 0, one ridge per column (several ridges share each product with
    ΦᵀΦ). Each column runs its own CG (its own step sizes), stopping once every column's residual
    is ≤ `tolerance` · |b_c|: the ridge solution to that tolerance, as the Cholesky solve of the
    dense Gram gives it. The preconditioner diag(ΦᵀΦ) + s is exact on the Gram's diagonal blocks
    when every slot of Φ keeps to its own block of columns (SAFLe: a table's rows are never
    active together). `initial` (size, k) starts the iterations (e.g. a nearby ridge's solution).
    Returns (W (size, k), iterations).
    """
    if not bool((shifts > 0).all()):
        raise ValueError(f"multi_hot_ridge needs every ridge > 0 (ΦᵀΦ is singular), got {shifts.tolist()}")
    shifts = shifts.to(rhs)
    preconditioner = 1 / (design.diagonal.to(rhs)[:, None] + shifts)  # (size, k)
    solution = torch.zeros_like(rhs) if initial is None else initial.to(rhs).clone()
    residual = rhs.clone() if initial is None else rhs - design.gram_times(solution) - shifts * solution
    target = tolerance * rhs.norm(dim=0)
    live = torch.nonzero(residual.norm(dim=0) > target).squeeze(1)  # the columns still iterating
    # only the live columns are carried and multiplied: a converged column costs nothing more
    residual, preconditioner, shifts, target = residual[:, live], preconditioner[:, live], shifts[live], target[live]
    x = solution[:, live]
    direction = preconditioner * residual
    rho = (residual * direction).sum(0)
    limit = max_iterations if max_iterations is not None else 2000
    for iteration in range(1, limit + 1):
        if len(live) == 0:
            return solution, iteration - 1
        product = design.gram_times(direction) + shifts * direction
        step = rho / (direction * product).sum(0)
        x += step * direction
        residual -= step * product
        done = residual.norm(dim=0) <= target
        if bool(done.any()):  # write the converged columns back and drop them
            solution[:, live[done]] = x[:, done]
            keep = ~done
            live, x, residual, direction = live[keep], x[:, keep], residual[:, keep], direction[:, keep]
            preconditioner, shifts, target, rho = preconditioner[:, keep], shifts[keep], target[keep], rho[keep]
        preconditioned = preconditioner * residual
        rho_next = (residual * preconditioned).sum(0)
        direction = preconditioned + (rho_next / rho) * direction
        rho = rho_next
    if len(live) == 0:
        return solution, limit
    raise RuntimeError(f"conjugate gradients did not reach a relative residual of {tolerance:g} in {limit} "
                       "iterations; raise the ridge or the tolerance")
