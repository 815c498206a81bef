"""GH-OFL: Gaussian heads from one-shot sufficient statistics (ICLR 2026), and the FedCGS baseline.

In its single round, client k uploads per class c `A_c = Σ x`, `N_c` and what the selected heads
need of the second moments:

    upload                          sent when                                   numbers
    class_sums A (C, d)             always                                      C·d
    class_counts N (C,), int64      always                                      C
    class_second_moments S_c        qda, or synthesis.covariance = "class"      C·d(d+1)/2 packed
    second_moment B = Σ xxᵀ         lda, fishermix, proto_hyper or fedcgs,      d(d+1)/2 packed
                                    and no S_c
    class_square_sums D = Σ x⊙x     nb_diag, and no S_c                         C·d

(B = Σ_c S_c and D_c = diag S_c, so neither is sent beside the S_c.) With `sketch_dim = k`
each client first projects `z = xR` with the public R = randn(d, k)/√d drawn from `sketch_seed`;
by linearity the statistics become `A R`, `Rᵀ B R`, `Rᵀ S_c R`, and every head lives in k dims.

The server sums the uploads (sums are partition invariant) and builds the selected heads
(`workbench/methods/gaussian_heads.py` has the formulas): closed-form `nb_diag`, `lda`, `qda`,
`fedcgs`; and `fishermix`, `proto_hyper`, trained by a plain AdamW loop over seeded shuffled
minibatches (`train_on_synthetic`, no nested Trainer) on samples synthesized in the Fisher
subspace from the same statistics, inside the same fit. Every head
is scored at test time as `test/acc/<head>` (`head_logits`); `forward` gives `primary_head`'s
logits.

Messages: the round's broadcast is the sketch seed when there is a sketch (8 bytes; nothing
otherwise); after the round every client receives the primary head (`final_broadcast`). The
client half (`GHOFLClient`) rebuilds the sketch from its seed and keeps no state.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from workbench.linalg import class_sums, counts_of, statistics_dtype
from workbench.methods.base import GRAM, SUMMED, ClientHalf, Cohort, FederatedMethod, Metrics, Problem, Upload, Uploads
from workbench.methods.gaussian_heads import (
    FisherMixHead,
    GaussianMoments,
    ProtoHyperHead,
    ProtoHyperTraining,
    SyntheticHead,
    TrainingSchedule,
    fedcgs_head,
    fisher_subspace,
    lda_head,
    nb_diag_head,
    nb_diag_logits,
    qda_head,
    qda_logits,
    shrink,
    synthesize,
    train_on_synthetic,
)

HEADS = ("nb_diag", "lda", "qda", "fishermix", "proto_hyper", "fedcgs")
SYNTHETIC_HEADS = ("fishermix", "proto_hyper")
CLOSED_FORM = {"nb_diag": nb_diag_head, "lda": lda_head, "qda": qda_head}
HEAD_BUFFERS = {  # name -> shape, with C classes and d (sketched) dimensions
    "nb_diag": {"nb_precision": "Cd", "nb_weight": "Cd", "nb_bias": "C"},
    "lda": {"lda_weight": "dC", "lda_bias": "C"},
    "qda": {"qda_mean": "Cd", "qda_cholesky": "Cdd", "qda_bias": "C"},
    "fedcgs": {"fedcgs_weight": "dC", "fedcgs_bias": "C"},
}


@dataclass
class FisherSynthesis:
    """Fisher subspace and the synthetic samples drawn in it.

    energy: share of Σλ the kept generalized eigenvalues hold; dimension clipped to [2, max_dim].
    per_class: samples per class from N(μ_c^f, τ²·Vᵀ Σ̃_c V), Σ̃ shrunk by `shrinkage`.
    covariance: "class" uses (and uploads) the S_c, "pooled" never does, "auto" uses them when
        they are uploaded anyway (qda selected).
    """

    energy: float = 0.995
    max_dim: int = 256
    per_class: int = 4000
    tau: float = 0.9
    shrinkage: float = 0.05
    covariance: Literal["auto", "class", "pooled"] = "auto"


DEFAULT_SYNTHESIS = FisherSynthesis()
DEFAULT_FISHERMIX = TrainingSchedule()
DEFAULT_PROTO_HYPER = ProtoHyperTraining()


def _check_schedule(name: str, s: TrainingSchedule) -> None:
    if s.epochs < 1 or s.batch_size < 1 or not s.lr > 0 or s.weight_decay < 0:
        raise ValueError(f"{name} needs epochs ≥ 1, batch_size ≥ 1, lr > 0 and weight_decay ≥ 0, "
                         f"got {s}")


def sketch_matrix(seed: int, feature_dim: int, sketch_dim: int, dtype: torch.dtype) -> Tensor:
    """The public projection R = randn(d, k)/√d of `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(feature_dim, sketch_dim, generator=gen, dtype=dtype) / feature_dim ** 0.5


class GHOFLClient(ClientHalf):
    """The clients: the per-class sums and the second moments the selected heads need, of their
    (sketched) features. The sketch comes from its seed (the round's broadcast); no state."""

    sketch: Tensor  # (feature_dim, k), with sketch_dim (not saved)

    def __init__(self, problem: Problem, method: GHOFL) -> None:
        super().__init__(problem)
        self.stat_dtype, self.sketch_dim, self.sketch_seed = method.stat_dtype, method.sketch_dim, method.sketch_seed
        self.sends_class_second_moments = method.sends_class_second_moments
        self.sends_second_moment, self.sends_square_sums = method.sends_second_moment, method.sends_square_sums
        if self.sketch_dim is not None:  # public: regenerated from the seed, so not saved
            self.register_buffer("sketch", sketch_matrix(self.sketch_seed, problem.feature_dim, self.sketch_dim,
                                                         self.stat_dtype), persistent=False)

    def head_input(self, features: Tensor) -> Tensor:
        """(n, d) -> (n, d or k) in the statistics dtype, sketched when `sketch_dim` is set."""
        x = features.to(self.stat_dtype)
        return x @ self.sketch if self.sketch_dim is not None else x

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        if self.sketch_dim is not None and int(broadcast["sketch_seed"]) != self.sketch_seed:
            raise ValueError(f"the server's sketch_seed {int(broadcast['sketch_seed'])} differs from this "
                             f"client's {self.sketch_seed}: build the clients from the same GHOFL settings")
        num_classes = self.num_classes
        side = self.head_input(cohort.features[:0]).shape[1]
        zeros = torch.zeros(side, dtype=self.stat_dtype, device=cohort.features.device)
        uploads = {"class_sums": zeros.new_zeros(num_classes, side),
                   "class_counts": torch.zeros(num_classes, dtype=torch.long, device=zeros.device)}
        if self.sends_class_second_moments:
            uploads["class_second_moments"] = zeros.new_zeros(num_classes, side, side)
        if self.sends_second_moment:
            uploads["second_moment"] = zeros.new_zeros(side, side)
        if self.sends_square_sums:
            uploads["class_square_sums"] = zeros.new_zeros(num_classes, side)
        counts = torch.stack([counts_of(labels, num_classes)  # (chunks, C): the chunks of `batches()`
                              for labels in cohort.labels.split(cohort.batch_size)])
        uploads["class_counts"] += counts.sum(0)
        # the class sizes of every chunk, read once: splitting a chunk by class needs them on the host
        sizes = counts.tolist() if self.sends_class_second_moments else None
        for index, part in enumerate(cohort.batches()):
            x, labels = self.head_input(part.features), part.labels
            uploads["class_sums"] += class_sums(x, labels, num_classes).T
            if sizes is not None:  # the class second moments: a loop over classes, O(n·d²) in all
                by_class = x[torch.argsort(labels, stable=True)].split(sizes[index])
                for c, members in enumerate(by_class):
                    if len(members):
                        uploads["class_second_moments"][c] += members.T @ members
            if self.sends_second_moment:
                uploads["second_moment"] += x.T @ x
            if self.sends_square_sums:
                uploads["class_square_sums"] += class_sums(x ** 2, labels, num_classes).T
        return uploads, {}


class GHOFL(FederatedMethod):
    """Gaussian heads from one-shot sufficient statistics (and the FedCGS head), one round.

    Args:
        heads: any of "nb_diag", "lda", "qda", "fishermix", "proto_hyper", "fedcgs".
        primary_head: the head `forward` (and so `test/acc`) uses, and the one broadcast;
            default "lda", or the first selected head when lda is not selected.
        shrinkage: a in (1−a)Σ + a·tr(Σ)/d·I for NB-diag, LDA, QDA and the Fisher within-class
            covariance (0.05 as the official code). It keeps every solve finite when a class has
            fewer samples than dimensions; 0 gives the raw estimates.
        sketch_dim: k of the public random projection applied before the sums (None: no sketch).
        sketch_seed: the shared seed of that projection (counted as 8 bytes in the broadcast).
        synthesis: the Fisher subspace and synthetic samples of the gradient-trained heads.
        fishermix, proto_hyper: their training schedules (and Proto-Hyper's distillation).
        fedcgs_ridge: γ added to FedCGS's covariance (official default 0; a singular one falls
            back to the pseudo-inverse with a warning).
        seed: seed of the synthetic samples, the heads' initialization and their shuffling.
        dtype: dtype of the statistics, of what is sent and of the closed-form solves.

    Classes with no sample on any client are excluded with a warning: every head gives them
    logit −∞, so they are never predicted.
    """

    # buffers from `setup_problem`, d the (sketched) dimension: each selected closed-form head's (HEAD_BUFFERS)
    nb_precision: Tensor  # (C, d)
    nb_weight: Tensor  # (C, d)
    nb_bias: Tensor  # (C,)
    lda_weight: Tensor  # (d, C)
    lda_bias: Tensor  # (C,)
    qda_mean: Tensor  # (C, d)
    qda_cholesky: Tensor  # (C, d, d) lower
    qda_bias: Tensor  # (C,)
    fedcgs_weight: Tensor  # (d, C)
    fedcgs_bias: Tensor  # (C,)
    sketch: Tensor  # (feature_dim, k), with sketch_dim (not saved)
    class_present: Tensor  # (C,) bool
    fisher_basis: Tensor  # (d, f), f found by the fit

    server_settings = ("shrinkage", "fedcgs_ridge")  # the clients send the same sums whatever they are

    def __init__(self, heads: Sequence[str] = HEADS, primary_head: str | None = None,
                 shrinkage: float = 0.05, sketch_dim: int | None = None, sketch_seed: int = 0,
                 synthesis: FisherSynthesis = DEFAULT_SYNTHESIS,
                 fishermix: TrainingSchedule = DEFAULT_FISHERMIX,
                 proto_hyper: ProtoHyperTraining = DEFAULT_PROTO_HYPER,
                 fedcgs_ridge: float = 0.0, seed: int = 0, dtype: str = "float64") -> None:
        super().__init__()
        heads = tuple(heads)
        unknown = sorted(set(heads) - set(HEADS))
        if not heads or unknown or len(set(heads)) < len(heads):
            raise ValueError(f"heads must be distinct names among {list(HEADS)}, got {list(heads)}")
        if primary_head is None:
            primary_head = "lda" if "lda" in heads else heads[0]
        if primary_head not in heads:
            raise ValueError(f"primary_head {primary_head!r} must be one of the selected heads "
                             f"{list(heads)}")
        if not 0 <= shrinkage <= 1 or not 0 <= synthesis.shrinkage <= 1:
            raise ValueError(f"shrinkage values must be in [0, 1], got {shrinkage} and "
                             f"{synthesis.shrinkage}")
        if sketch_dim is not None and sketch_dim < 1:
            raise ValueError(f"sketch_dim must be ≥ 1 (or null for no sketch), got {sketch_dim}")
        s = synthesis
        if not (0 < s.energy <= 1 and s.max_dim >= 2 and s.per_class >= 1 and s.tau > 0
                and s.covariance in ("auto", "class", "pooled")):
            raise ValueError("synthesis needs 0 < energy ≤ 1, max_dim ≥ 2, per_class ≥ 1, tau > 0 "
                             f"and covariance in auto/class/pooled, got {s}")
        _check_schedule("fishermix", fishermix)
        _check_schedule("proto_hyper", proto_hyper)
        p = proto_hyper
        if not (p.rank >= 1 and p.temperature > 0 and 0 <= p.distill_weight <= 1
                and 0 <= p.teacher_lda_weight <= 1):
            raise ValueError("proto_hyper needs rank ≥ 1, temperature > 0, and distill_weight and "
                             f"teacher_lda_weight in [0, 1], got {p}")
        if fedcgs_ridge < 0:
            raise ValueError(f"fedcgs_ridge must be ≥ 0, got {fedcgs_ridge}")
        self.save_hyperparameters()
        self.heads, self.primary_head, self.shrinkage = heads, primary_head, shrinkage
        self._sums: Uploads | None = None  # the round's, to solve again (`resolve`)
        self.sketch_dim, self.sketch_seed, self.seed = sketch_dim, sketch_seed, seed
        self.synthesis = synthesis
        self.fishermix_schedule, self.proto_hyper_schedule = fishermix, proto_hyper
        self.fedcgs_ridge = fedcgs_ridge
        self.stat_dtype = statistics_dtype(dtype)
        self.fishermix: FisherMixHead | None = None
        self.proto_hyper: ProtoHyperHead | None = None
        self.head_metrics: dict[str, float] = {}  # the latest fit's server timings and final losses

        trained = any(h in heads for h in SYNTHETIC_HEADS)
        self.sends_class_second_moments = "qda" in heads or (trained and s.covariance == "class")
        self.sends_second_moment = not self.sends_class_second_moments and any(
            h in heads for h in ("lda", "fishermix", "proto_hyper", "fedcgs"))
        self.sends_square_sums = not self.sends_class_second_moments and "nb_diag" in heads
        self.synthesis_uses_class_cov = self.sends_class_second_moments and s.covariance != "pooled"

    @property  # read-only: it follows the selected heads
    def uploads(self) -> dict[str, Upload]:  # type: ignore[override]
        """The sums and counts, and the second moments the selected heads need."""
        spec = {"class_sums": SUMMED, "class_counts": SUMMED}
        if self.sends_class_second_moments:
            spec["class_second_moments"] = GRAM
        if self.sends_second_moment:
            spec["second_moment"] = GRAM
        if self.sends_square_sums:
            spec["class_square_sums"] = SUMMED
        return spec

    # ---- setup ----------------------------------------------------------------------------
    def setup_problem(self, problem: Problem) -> None:
        feature_dim, num_classes = problem.feature_dim, problem.num_classes
        if self.sketch_dim is not None and self.sketch_dim >= feature_dim:
            raise ValueError(f"sketch_dim ({self.sketch_dim}) must be below the feature dimension "
                             f"({feature_dim}); use null for no sketch")
        side = self.sketch_dim or feature_dim
        if self.sketch_dim is not None:  # public: regenerated from the seed, so not saved
            self.register_buffer("sketch", sketch_matrix(self.sketch_seed, feature_dim, side, self.stat_dtype),
                                 persistent=False)
        sizes = {"C": num_classes, "d": side}
        for head, buffers in HEAD_BUFFERS.items():
            if head in self.heads:
                for name, shape in buffers.items():
                    zeros = torch.zeros([sizes[s] for s in shape], dtype=self.stat_dtype)
                    self.register_buffer(name, zeros)
        self.register_buffer("class_present", torch.ones(num_classes, dtype=torch.bool))
        self.register_buffer("fisher_basis", torch.zeros(side, 0, dtype=self.stat_dtype))

    def client_half(self) -> GHOFLClient:
        if self.problem is None:
            raise RuntimeError("GHOFL builds its clients once set up for a problem (`setup`)")
        return GHOFLClient(self.problem, self)

    def before_restore(self, state) -> None:
        """The fit finds the Fisher dimension: rebuild the trained heads at the saved shapes."""
        self.fisher_basis = torch.empty_like(state["fisher_basis"], device=self.fisher_basis.device)
        self._new_trained_heads(self.fisher_basis.shape[1], int(state["class_present"].sum()))

    def _new_trained_heads(self, fisher_dim: int, num_present: int) -> None:
        """Seeded fresh FisherMix / Proto-Hyper heads for the selected ones."""
        for offset, (name, cls, schedule) in enumerate((
                ("fishermix", FisherMixHead, self.fishermix_schedule),
                ("proto_hyper", ProtoHyperHead, self.proto_hyper_schedule))):
            if name in self.heads:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed + offset)
                    # each head's class comes with its own schedule, a pairing mypy cannot follow
                    setattr(self, name, cls(fisher_dim, num_present, schedule))  # type: ignore[arg-type]

    # ---- server -----------------------------------------------------------------------------
    def head_input(self, features: Tensor) -> Tensor:
        """(n, d) -> (n, d or k) in the statistics dtype, sketched when `sketch_dim` is set."""
        x = features.to(self.stat_dtype)
        return x @ self.sketch if self.sketch_dim is not None else x

    def broadcast(self) -> dict[str, Tensor]:
        """The round's broadcast: the sketch seed (8 bytes) when the clients sketch, else nothing."""
        if self.sketch_dim is not None:
            return {"sketch_seed": torch.tensor(self.sketch_seed, dtype=torch.int64)}
        return {}

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        self._sums = uploads  # kept in memory (not saved) to solve again at another shrinkage or ridge
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        moments = GaussianMoments.from_sums(
            uploads["class_sums"], uploads["class_counts"], uploads.get("second_moment"),
            uploads.get("class_second_moments"), uploads.get("class_square_sums"))
        self.class_present = moments.present
        absent = (~moments.present).nonzero().squeeze(1).tolist()
        if absent:
            warnings.warn(f"classes {absent} have no sample on any client: they are excluded, "
                          "every head gives them logit -inf (never predicted)", stacklevel=2)
        seconds["moments"] = time.perf_counter() - start
        for head in self.heads:
            if head not in HEAD_BUFFERS:
                continue
            start = time.perf_counter()
            if head == "fedcgs":
                params = fedcgs_head(uploads["class_sums"], self._second_moment(uploads), moments,
                                     self.fedcgs_ridge)
            else:
                params = CLOSED_FORM[head](moments, self.shrinkage)
            for name, value in params.items():
                setattr(self, name, value)
            seconds[head] = time.perf_counter() - start
        if any(h in self.heads for h in SYNTHETIC_HEADS):
            seconds.update(self._fit_trained_heads(moments))
        self.head_metrics = {f"time/server_s/{part}": s for part, s in seconds.items()}
        for head in SYNTHETIC_HEADS:
            if head in self.heads:
                curve = getattr(self, head).loss_curve
                self.head_metrics[f"{head}/final_train_loss"] = curve[-1]  # the curve: `<head>.loss_curve`
        return dict(self.head_metrics)

    def solve_again(self, settings: Mapping[str, float]) -> None:
        """Every head at another shrinkage or FedCGS ridge from the round's sums (equals a fit at them)."""
        if self._sums is None:
            raise ValueError("GHOFL solves again from the round's sums, which a restored checkpoint does not hold: "
                             "fit it in this process first")
        shrinkage, ridge = float(settings.get("shrinkage", self.shrinkage)), float(
            settings.get("fedcgs_ridge", self.fedcgs_ridge))
        if not 0 <= shrinkage <= 1 or not ridge >= 0:
            raise ValueError(f"shrinkage must be in [0, 1] and fedcgs_ridge ≥ 0, got {shrinkage} and {ridge}")
        self.shrinkage, self.fedcgs_ridge = shrinkage, ridge
        self.server_update(self._sums, float("nan"))

    def step_metrics(self, test_features, test_labels, fit_metrics) -> list[tuple[int, dict[str, float]]]:
        """After the round: each trained head's training loss by epoch (step = epoch)."""
        curves = {head: getattr(self, head).loss_curve for head in SYNTHETIC_HEADS
                  if head in self.heads and getattr(self, head) is not None}
        epochs = max((len(curve) for curve in curves.values()), default=0)
        return [(epoch, {f"{head}/train_loss": curve[epoch] for head, curve in curves.items() if epoch < len(curve)})
                for epoch in range(epochs)]

    @staticmethod
    def _second_moment(uploads: dict[str, Tensor]) -> Tensor:
        if "second_moment" in uploads:
            return uploads["second_moment"]
        return uploads["class_second_moments"].sum(0)

    def _fit_trained_heads(self, moments: GaussianMoments) -> dict[str, float]:
        """Fisher subspace, synthetic samples, then FisherMix / Proto-Hyper on them. -> seconds."""
        start = time.perf_counter()
        present = moments.present
        if int(present.sum()) < 2:
            raise ValueError("the Fisher subspace needs at least two classes with samples")
        s = self.synthesis
        means, log_prior = moments.means[present], moments.log_prior[present]
        assert moments.pooled_cov is not None  # (the synthetic heads' uploads give B or the S_c)
        within = shrink(moments.pooled_cov, self.shrinkage)
        basis = fisher_subspace(means, log_prior.exp(), within, s.energy, s.max_dim)
        if self.synthesis_uses_class_cov:
            assert moments.class_cov is not None  # (the S_c were uploaded)
            cov = moments.class_cov[present]
        else:
            cov = moments.pooled_cov.expand(len(means), -1, -1)
        fisher_covs = s.tau ** 2 * (basis.T @ shrink(cov, s.shrinkage) @ basis)
        fisher_means = means @ basis
        z, labels = synthesize(fisher_means, fisher_covs, s.per_class,
                               torch.Generator().manual_seed(self.seed))
        device = self.class_present.device
        z, labels = z.to(device), labels.to(device)
        self.fisher_basis = basis
        self._new_trained_heads(basis.shape[1], len(means))
        if self.proto_hyper is not None:
            self.proto_hyper.set_gaussians(fisher_means, log_prior, basis.T @ within @ basis)
        seconds = {"fisher_synthesis": time.perf_counter() - start}
        for head in SYNTHETIC_HEADS:
            module: SyntheticHead | None = getattr(self, head)
            if module is not None:
                start = time.perf_counter()
                train_on_synthetic(module, z, labels, seed=self.seed, device=device)
                seconds[head] = time.perf_counter() - start
        return seconds

    def final_broadcast(self) -> dict[str, Tensor]:
        """What every client receives after the round: the primary head."""
        head = self.primary_head
        if head in HEAD_BUFFERS:
            message = {name: getattr(self, name) for name in HEAD_BUFFERS[head]}
        else:
            trained = {f"{head}.{k}": v for k, v in getattr(self, head).state_dict().items()}
            message = {"fisher_basis": self.fisher_basis, "class_present": self.class_present,
                       **trained}
        return message

    # ---- prediction ---------------------------------------------------------------------------
    def logits_of_head(self, head: str, features: Tensor) -> Tensor:
        """Logits of one head: (n, d) -> (n, C)."""
        x = self.head_input(features)
        if head == "nb_diag":
            return nb_diag_logits(x, self.nb_precision, self.nb_weight, self.nb_bias)
        if head in ("lda", "fedcgs"):
            return x @ getattr(self, f"{head}_weight") + getattr(self, f"{head}_bias")
        if head == "qda":
            return qda_logits(x, self.qda_mean, self.qda_cholesky, self.qda_bias)
        scores = getattr(self, head)((x @ self.fisher_basis).float())  # present classes only
        logits = scores.new_full((len(x), self.num_classes), float("-inf"))
        logits[:, self.class_present] = scores
        return logits

    def head_logits(self, features: Tensor) -> dict[str, Tensor]:
        """Logits of every selected head, scored as `test/acc/<head>`: (n, d) -> {head: (n, C)}."""
        return {head: self.logits_of_head(head, features) for head in self.heads}

    def forward(self, features: Tensor) -> Tensor:
        """Logits of `primary_head`: (n, d) -> (n, C)."""
        return self.logits_of_head(self.primary_head, features)
