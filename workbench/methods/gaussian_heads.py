"""Gaussian classifier heads from summed sufficient statistics (the math behind `GHOFL`).

From the per-class sums `A_c = Σ x`, counts `N_c`, and second moments (the global `B = Σ xxᵀ`,
per-class `S_c = Σ xxᵀ`, or only their diagonals `D_c = Σ x⊙x`):

    μ_c = A_c / N_c,   π_c = N_c / N,
    Σ_pool = (B − Σ_c N_c μ_cμ_cᵀ) / (N − C),    Σ_c = (S_c − N_c μ_cμ_cᵀ) / (N_c − 1),
    shrinkage   Σ̃ = (1 − a)Σ + a·tr(Σ)/d·I.

Heads (logits up to a constant shared by all classes):

    NB-diag  log π_c − ½ Σ_j log v_cj − ½ Σ_j (x_j − μ_cj)² / v_cj   (v_c: shrunk diag of Σ_c)
    LDA      xᵀW_c + b_c,   W_c = Σ̃_pool⁻¹ μ_c,   b_c = −½ μ_cᵀW_c + log π_c
    QDA      log π_c − Σ_j log L_c,jj − ½ ‖L_c⁻¹(x − μ_c)‖²,   L_c L_cᵀ = Σ̃_c
    FedCGS   LDA's formula with the covariance around the global mean m = Σ_c A_c / N:
             S = (B − N m mᵀ) / (N − 1)

Fisher subspace: the generalized eigenvectors of S_B v = λ Σ̃_W v, with Σ̃_W = Σ̃_pool and
S_B = Σ_c π_c (μ_c − m̄)(μ_c − m̄)ᵀ, m̄ = Σ_c π_c μ_c. With Σ̃_W = L Lᵀ they are the eigenvectors
U of L⁻¹ S_B L⁻ᵀ mapped back as V = L⁻ᵀ U, so that Vᵀ Σ̃_W V = I; the leading ones holding
`energy` of Σλ are kept. Synthetic samples in it: z ~ N(Vᵀμ_c, τ² Vᵀ Σ̃_c V). Two heads are
trained on them only: FisherMix (linear, cross-entropy) and Proto-Hyper (spherical Fisher-space
NB logits plus a low-rank residual V₂U₁z, distilled from the teacher 0.7·LDA_f + 0.3·NB_f).

Absent classes (N_c = 0) get zero means and log π_c = −∞, so every closed-form head gives them
logit −∞. A class with N_c = 1 has no sample covariance: it takes the pooled one.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.linalg import solve_spd


# ---- moments -> Gaussian parameters -----------------------------------------------------------
@dataclass
class GaussianMoments:
    """Class-conditional Gaussian parameters, float64.

    counts (C,); means (C, d), zero rows for absent classes; log_prior (C,), −∞ when absent;
    pooled_cov (d, d), class_cov (C, d, d), class_var (C, d): None when their statistics were not
    uploaded. Covariances are unbiased; a class with N_c ≤ 1 takes the pooled one.
    """

    counts: Tensor
    means: Tensor
    log_prior: Tensor
    pooled_cov: Tensor | None = None
    class_cov: Tensor | None = None
    class_var: Tensor | None = None

    @property
    def present(self) -> Tensor:
        return self.counts > 0

    @classmethod
    def from_sums(cls, sums: Tensor, counts: Tensor, second_moment: Tensor | None = None,
                  class_second_moments: Tensor | None = None,
                  class_square_sums: Tensor | None = None) -> GaussianMoments:
        """A (C, d), N (C,), and any of B (d, d), S (C, d, d), D (C, d) -> the parameters."""
        counts = counts.to(sums.dtype)
        total, num_present = counts.sum(), int((counts > 0).sum())
        if total - num_present < 1:
            raise ValueError("every class has at most one sample: no covariance can be estimated")
        means = sums / counts.clamp_min(1)[:, None]
        if class_second_moments is not None:  # B and the D_c are sums and diagonals of the S_c
            second_moment = class_second_moments.sum(0)
            class_square_sums = class_second_moments.diagonal(dim1=-2, dim2=-1)
        single = counts <= 1  # no sample covariance: take the pooled one
        moments = cls(counts, means, torch.log(counts / total))
        if second_moment is not None:
            between = means.T @ (counts[:, None] * means)  # Σ_c N_c μ_cμ_cᵀ
            moments.pooled_cov = (second_moment - between) / (total - num_present)
        if class_second_moments is not None:
            outer = means[:, :, None] * means[:, None, :]
            class_cov = ((class_second_moments - counts[:, None, None] * outer)
                         / (counts - 1).clamp_min(1)[:, None, None])
            assert moments.pooled_cov is not None  # (B formed from the S_c above)
            moments.class_cov = torch.where(single[:, None, None], moments.pooled_cov, class_cov)
        if class_square_sums is not None:
            scatter = class_square_sums - counts[:, None] * means ** 2
            class_var = scatter / (counts - 1).clamp_min(1)[:, None]
            pooled_var = scatter.sum(0) / (total - num_present)
            moments.class_var = torch.where(single[:, None], pooled_var, class_var)
        return moments


def shrink(cov: Tensor, amount: float) -> Tensor:
    """(1 − a)Σ + a·tr(Σ)/d·I for (..., d, d) covariances."""
    out = (1 - amount) * cov
    mean_variance = cov.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True)
    out.diagonal(dim1=-2, dim2=-1).add_(amount * mean_variance)
    return out


def shrink_diagonal(var: Tensor, amount: float) -> Tensor:
    """The same shrinkage for diagonal covariances given by their diagonals (..., d)."""
    return (1 - amount) * var + amount * var.mean(-1, keepdim=True)


def cholesky_or_explain(cov: Tensor, what: str) -> Tensor:
    """Lower Cholesky factors of (..., d, d) covariances, or one error naming the fix."""
    factor, info = torch.linalg.cholesky_ex(cov)
    if bool((info != 0).any()):
        raise ValueError(f"{what} is singular (fewer samples than dimensions, or constant "
                         "features): set a shrinkage > 0 (e.g. 0.05)")
    return factor


# ---- closed-form heads: parameters and logits -------------------------------------------------
def nb_diag_head(moments: GaussianMoments, shrinkage: float) -> dict[str, Tensor]:
    """-> nb_precision (C, d) = 1/v_c, nb_weight (C, d) = μ_c/v_c, nb_bias (C,)."""
    assert moments.class_var is not None  # (the D_c or S_c were uploaded)
    var = shrink_diagonal(moments.class_var, shrinkage)
    precision = 1 / var
    bias = moments.log_prior - 0.5 * (torch.log(var) + moments.means ** 2 * precision).sum(1)
    return {"nb_precision": precision, "nb_weight": moments.means * precision, "nb_bias": bias}


def nb_diag_logits(x: Tensor, nb_precision: Tensor, nb_weight: Tensor, nb_bias: Tensor) -> Tensor:
    """(n, d) -> (n, C), the square expanded so that no (n, C, d) tensor is built."""
    return x @ nb_weight.T - 0.5 * (x ** 2) @ nb_precision.T + nb_bias


def linear_gaussian_head(means: Tensor, log_prior: Tensor, cov: Tensor,
                         what: str) -> tuple[Tensor, Tensor]:
    """Shared covariance: W = Σ⁻¹μᵀ (d, C), b_c = −½ μ_cᵀW_c + log π_c (C,)."""
    weight = solve_spd(cov, means.T, what=what)
    return weight, log_prior - 0.5 * (means * weight.T).sum(1)


def lda_head(moments: GaussianMoments, shrinkage: float) -> dict[str, Tensor]:
    """-> lda_weight (d, C), lda_bias (C,)."""
    assert moments.pooled_cov is not None  # (B or the S_c were uploaded)
    cov = shrink(moments.pooled_cov, shrinkage)
    weight, bias = linear_gaussian_head(moments.means, moments.log_prior, cov, "LDA's covariance")
    return {"lda_weight": weight, "lda_bias": bias}


def qda_head(moments: GaussianMoments, shrinkage: float) -> dict[str, Tensor]:
    """-> qda_mean (C, d), qda_cholesky (C, d, d) lower, qda_bias (C,) = log π_c − log|L_c|."""
    assert moments.class_cov is not None  # (the S_c were uploaded)
    factor = cholesky_or_explain(shrink(moments.class_cov, shrinkage), "a class covariance of QDA")
    half_log_det = torch.log(factor.diagonal(dim1=-2, dim2=-1)).sum(-1)
    return {"qda_mean": moments.means, "qda_cholesky": factor,
            "qda_bias": moments.log_prior - half_log_det}


def qda_logits(x: Tensor, qda_mean: Tensor, qda_cholesky: Tensor, qda_bias: Tensor) -> Tensor:
    """(n, d) -> (n, C). One class at a time: a batched solve would hold a (C, d, n) tensor."""
    logits = x.new_empty(len(x), len(qda_mean))
    for c, (mean, factor) in enumerate(zip(qda_mean, qda_cholesky, strict=True)):
        white = torch.linalg.solve_triangular(factor, (x - mean).T, upper=False)
        logits[:, c] = qda_bias[c] - 0.5 * (white ** 2).sum(0)
    return logits


def fedcgs_head(sums: Tensor, second_moment: Tensor, moments: GaussianMoments,
                ridge: float) -> dict[str, Tensor]:
    """FedCGS: LDA's formula with S = (B − N m mᵀ)/(N − 1) + ridge·I -> weight (d, C), bias (C,)."""
    total = moments.counts.sum()
    global_mean = sums.sum(0) / total
    cov = (second_moment - total * torch.outer(global_mean, global_mean)) / (total - 1)
    cov.diagonal().add_(ridge)
    weight, bias = linear_gaussian_head(moments.means, moments.log_prior, cov,
                                        "FedCGS's covariance")
    return {"fedcgs_weight": weight, "fedcgs_bias": bias}


# ---- Fisher subspace and synthesis ----------------------------------------------------------
def fisher_subspace(means: Tensor, prior: Tensor, within_cov: Tensor, energy: float,
                    max_dim: int) -> Tensor:
    """Basis V (d, k) of the leading solutions of S_B v = λ Σ_W v, normalized to Vᵀ Σ_W V = I.

    means (C, d), prior (C,) of the present classes; within_cov (d, d) positive definite.
    S_B = GGᵀ with G = (√π_c (μ_c − m̄))ᵀ (d, C), so the eigenvectors of L⁻¹S_B L⁻ᵀ are the left
    singular vectors of L⁻¹G: an SVD of a (d, C) matrix instead of an eigh of a (d, d) one.
    """
    spread = (prior.sqrt()[:, None] * (means - prior @ means)).T
    factor = cholesky_or_explain(within_cov, "the within-class covariance of the Fisher subspace")
    whitened = torch.linalg.solve_triangular(factor, spread, upper=False)
    vectors, singular, _ = torch.linalg.svd(whitened, full_matrices=False)
    eigenvalues = singular ** 2
    kept = int((torch.cumsum(eigenvalues, 0) < energy * eigenvalues.sum()).sum()) + 1
    kept = min(max(kept, 2), max_dim, vectors.shape[1])
    vectors = vectors[:, :kept]
    # One sign per vector (its largest entry positive), so that equal statistics give one basis.
    peak = vectors.gather(0, vectors.abs().argmax(0, keepdim=True))
    return torch.linalg.solve_triangular(factor.T, vectors * peak.sign(), upper=True)


def synthesize(means: Tensor, covs: Tensor, per_class: int,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Samples of every class: means (C, k), covs (C, k, k) -> z (C·n, k) float32, labels (C·n,)."""
    factor = cholesky_or_explain(covs, "a Fisher-space synthesis covariance")
    noise = torch.randn(len(means), per_class, means.shape[1], generator=generator,
                        dtype=means.dtype)
    samples = means[:, None, :] + noise @ factor.transpose(-1, -2)
    labels = torch.arange(len(means)).repeat_interleave(per_class)
    return samples.reshape(-1, means.shape[1]).float(), labels


# ---- gradient-trained heads on synthetic Fisher-space samples ---------------------------------
@dataclass
class TrainingSchedule:
    """AdamW on the synthetic samples: epochs, learning rate, weight decay, batch size."""

    epochs: int = 60
    lr: float = 8e-4
    weight_decay: float = 3e-4
    batch_size: int = 2048


@dataclass
class ProtoHyperTraining(TrainingSchedule):
    """Proto-Hyper's schedule, residual rank (capped at the Fisher dimension) and distillation:

    loss = w·T²·KL(teacher ‖ student) + (1 − w)·CE,   teacher = β·LDA_f + (1 − β)·NB_f
    (w = distill_weight, T = temperature, β = teacher_lda_weight).
    """

    epochs: int = 20
    lr: float = 1e-3
    weight_decay: float = 5e-4
    batch_size: int = 1024
    rank: int = 128
    temperature: float = 4.0
    distill_weight: float = 0.4
    teacher_lda_weight: float = 0.7


class SyntheticHead(nn.Module):
    """A head trained on synthetic samples by `train_on_synthetic`; keeps its mean loss per epoch."""

    def __init__(self, schedule: TrainingSchedule) -> None:
        super().__init__()
        self.schedule = schedule
        self.loss_curve: list[float] = []

    def loss(self, z: Tensor, labels: Tensor) -> Tensor:
        raise NotImplementedError


class FisherMixHead(SyntheticHead):
    """FisherMix: a linear head on Fisher-space features, cross-entropy. (n, k) -> (n, C)."""

    def __init__(self, fisher_dim: int, num_classes: int, schedule: TrainingSchedule) -> None:
        super().__init__(schedule)
        self.linear = nn.Linear(fisher_dim, num_classes)

    def forward(self, z: Tensor) -> Tensor:
        return self.linear(z)

    def loss(self, z: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self(z), labels)


class ProtoHyperHead(SyntheticHead):
    """Proto-Hyper: NB_f(z) + V₂U₁z, the base a spherical Gaussian head in the Fisher space.

    NB_f(z)_c = log π_c − ½‖z − μ_c‖²/σ² − (k/2) log σ² with σ² = tr(Σ_f)/k;
    LDA_f(z)_c = zᵀΣ_f⁻¹μ_c − ½μ_cᵀΣ_f⁻¹μ_c + log π_c. (n, k) -> (n, C).
    """

    schedule: ProtoHyperTraining  # with its rank and distillation
    means: Tensor  # (C, k)
    log_prior: Tensor  # (C,)
    variance: Tensor  # () σ²
    lda_weight: Tensor  # (k, C)
    lda_bias: Tensor  # (C,)

    def __init__(self, fisher_dim: int, num_classes: int, schedule: ProtoHyperTraining) -> None:
        super().__init__(schedule)
        rank = min(schedule.rank, fisher_dim)
        self.down = nn.Linear(fisher_dim, rank, bias=False)  # U₁
        self.up = nn.Linear(rank, num_classes)  # V₂
        self.register_buffer("means", torch.zeros(num_classes, fisher_dim))
        self.register_buffer("log_prior", torch.zeros(num_classes))
        self.register_buffer("variance", torch.ones(()))
        self.register_buffer("lda_weight", torch.zeros(fisher_dim, num_classes))
        self.register_buffer("lda_bias", torch.zeros(num_classes))

    @torch.no_grad()
    def set_gaussians(self, means: Tensor, log_prior: Tensor, cov: Tensor) -> None:
        """Fisher-space means (C, k), log priors (C,) and pooled covariance (k, k)."""
        weight, bias = linear_gaussian_head(means, log_prior, cov, "the Fisher-space covariance")
        values = {"means": means, "log_prior": log_prior, "variance": cov.trace() / len(cov),
                  "lda_weight": weight, "lda_bias": bias}
        for name, value in values.items():
            getattr(self, name).copy_(value)

    def nb_logits(self, z: Tensor) -> Tensor:
        distance = (z ** 2).sum(1, keepdim=True) - 2 * z @ self.means.T + (self.means ** 2).sum(1)
        return (self.log_prior - 0.5 * distance / self.variance
                - 0.5 * z.shape[1] * self.variance.log())

    def lda_logits(self, z: Tensor) -> Tensor:
        return z @ self.lda_weight + self.lda_bias

    def forward(self, z: Tensor) -> Tensor:
        return self.nb_logits(z) + self.up(self.down(z))

    def loss(self, z: Tensor, labels: Tensor) -> Tensor:
        s = self.schedule
        with torch.no_grad():
            teacher = (s.teacher_lda_weight * self.lda_logits(z)
                       + (1 - s.teacher_lda_weight) * self.nb_logits(z))
        student = self(z)
        distill = F.kl_div(F.log_softmax(student / s.temperature, 1),
                           F.log_softmax(teacher / s.temperature, 1),
                           reduction="batchmean", log_target=True)  # KL(teacher ‖ student)
        return (s.distill_weight * s.temperature ** 2 * distill
                + (1 - s.distill_weight) * F.cross_entropy(student, labels))


# Multiply-adds of one step's forward (batch × parameters) per CPU thread: below it the problem is
# too small to split. Tiny ops on several threads pay a synchronization per op that costs far more
# than their arithmetic, ~10× more when the cores are busy with other work.
WORK_PER_THREAD = 1 << 22


@contextmanager
def cpu_threads(count: int) -> Iterator[None]:
    """Run with at most `count` intra-op CPU threads; restore the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(count, before)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_on_synthetic(head: SyntheticHead, z: Tensor, labels: Tensor, *, seed: int,
                       device: torch.device) -> None:
    """Fit `head` on (z, labels): AdamW (the schedule's lr and weight decay) over `epochs` passes
    of seeded shuffled minibatches of `batch_size`, the mean loss of each batch; a plain loop.

    The shuffling comes from `seed` (one permutation per epoch, the last batch the remainder);
    each epoch's samples are gathered once in that order and cut into views. `head.loss_curve`
    gets the mean loss of each epoch (one device sync at the end). On the CPU it runs on one
    thread per `WORK_PER_THREAD` multiply-adds of a step (one for the usual Fisher dimensions).
    The head ends on `device`, in eval mode. Grad mode is switched on here, so the caller may hold
    no_grad or inference mode.
    """
    s = head.schedule
    head.to(device).train()
    z, labels = z.to(device), labels.to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    generator = torch.Generator().manual_seed(seed)
    work = min(s.batch_size, len(z)) * sum(p.numel() for p in head.parameters())
    threads = work // WORK_PER_THREAD if device.type == "cpu" else torch.get_num_threads()
    epoch_sums = []
    with torch.inference_mode(False), torch.enable_grad(), cpu_threads(threads):
        for _ in range(s.epochs):
            order = torch.randperm(len(z), generator=generator).to(device)
            batches = zip(z[order].split(s.batch_size), labels[order].split(s.batch_size),
                          strict=True)
            total = torch.zeros((), device=device)
            for z_batch, label_batch in batches:
                loss = head.loss(z_batch, label_batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.detach() * len(label_batch)  # summed on the device: no sync per step
            epoch_sums.append(total)
    head.loss_curve = [float(total) / len(z) for total in torch.stack(epoch_sums).cpu()]
    head.eval()
