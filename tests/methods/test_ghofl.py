"""GH-OFL and FedCGS: summed statistics, partition invariance, Gaussian heads, bytes, the CLI."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import scipy.linalg
import torch
import yaml

from tests.conftest import quiet_trainer, relative_error
from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.methods import GHOFL
from workbench.methods.gaussian_heads import shrink
from workbench.methods.ghofl import HEADS, FisherSynthesis, ProtoHyperTraining, TrainingSchedule

# Overlapping blobs, so that the heads differ and the trained heads have something to learn
BLOBS = SyntheticBlobs(num_classes=4, dim=6, train_size=800, test_size=400, separation=3.0,
                       seed=2)
# Small and fast settings for the trained heads
QUICK = {"synthesis": FisherSynthesis(per_class=100),
         "fishermix": TrainingSchedule(epochs=4, lr=0.2, batch_size=200),
         "proto_hyper": ProtoHyperTraining(epochs=4, lr=0.05, batch_size=200)}
CLOSED_FORM_BUFFERS = ["nb_precision", "nb_weight", "nb_bias", "lda_weight", "lda_bias",
                       "qda_mean", "qda_cholesky", "qda_bias", "fedcgs_weight", "fedcgs_bias"]


class Drawn(SyntheticBlobs):
    """A synthetic dataset drawn by `draw()` -> (x_train, y_train, x_test, y_test)."""

    def __init__(self, draw, num_classes: int, dim: int) -> None:
        super().__init__(num_classes=num_classes, dim=dim)
        self.draw = draw

    def generate(self):
        return self.draw()


def data(synthetic=BLOBS, **partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=synthetic, batch_size=256,
                             min_partition_size=1, **partition)
    dm.setup()
    return dm


class Recording(GHOFL):
    """GH-OFL that keeps the summed uploads the server received."""

    def server_update(self, uploads, num_clients):
        self.received = {name: value.clone() for name, value in uploads.items()}
        return super().server_update(uploads, num_clients)


def pooled_statistics(x: torch.Tensor, y: torch.Tensor,
                      num_classes: int) -> dict[str, torch.Tensor]:
    """The statistics of the pooled data, one class at a time."""
    x = x.double()
    members = [x[y == c] for c in range(num_classes)]
    return {"class_sums": torch.stack([m.sum(0) for m in members]),
            "class_counts": torch.tensor([len(m) for m in members]),
            "class_square_sums": torch.stack([(m ** 2).sum(0) for m in members]),
            "second_moment": x.T @ x,
            "class_second_moments": torch.stack([m.T @ m for m in members])}


def logits_of(method: GHOFL, head: str, dm: FederatedDataModule) -> torch.Tensor:
    with torch.no_grad():
        return method.logits_of_head(head, dm.test_features)


def accuracy(method: GHOFL, head: str, dm: FederatedDataModule) -> float:
    return float((logits_of(method, head, dm).argmax(1) == dm.test_labels).double().mean())


PARTITIONS = [{"partition": "iid", "num_clients": 1},
              {"partition": "dirichlet", "alpha": 0.2, "num_clients": 20},
              {"partition": "shard", "num_shards_per_partition": 2, "num_clients": 8}]


# ---- statistics -------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [("nb_diag", "lda"), ("qda",)], ids=["B-and-D", "S_c"])
@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: p["partition"])
def test_summed_uploads_are_the_pooled_statistics(fit_method, heads, partition):
    dm = data(**partition)
    method = Recording(heads=heads, primary_head=heads[0])
    fit_method(method, dm)
    pooled = pooled_statistics(dm.train_features, dm.train_labels, BLOBS.num_classes)
    by_class = heads == ("qda",)
    second = {"class_second_moments"} if by_class else {"class_square_sums", "second_moment"}
    assert set(method.received) == {"class_sums", "class_counts", *second}
    assert method.received["class_counts"].dtype == torch.int64
    for name, value in method.received.items():
        assert relative_error(value.double(), pooled[name].double()) <= 1e-12, name


@pytest.mark.parametrize("settings", [{"heads": ("nb_diag", "lda")}, {"heads": ("qda",), "sketch_dim": 4}],
                         ids=["B-and-D", "S_c-sketched"])
def test_one_cohort_call_is_the_sum_of_each_clients_own_call(settings):
    """The client half vectorized over all clients equals the clients computing alone, each on a
    client half of its own built from the settings only (as on a Flower node)."""
    from workbench.engines.local import LocalClients
    from workbench.methods import Problem

    dm = data(partition="dirichlet", alpha=0.3, num_clients=7)
    problem = Problem((dm.feature_dim,), dm.num_classes, dm.num_clients)

    def built() -> GHOFL:
        method = GHOFL(primary_head=settings["heads"][0], **settings)
        method.setup(problem)
        return method

    method = built()
    together = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                            torch.unique(dm.train_client_ids), batch_size=100)
    broadcast = method.broadcast()
    assert set(broadcast) == ({"sketch_seed"} if "sketch_dim" in settings else set())
    uploads, _ = together.half.client_update(0, broadcast, together.data)
    assert set(uploads) == set(method.uploads)
    summed = {}
    for k in together.served.tolist():
        mine = dm.train_client_ids == k
        alone = LocalClients(built(), dm.train_features[mine], dm.train_labels[mine], dm.train_client_ids[mine],
                             torch.tensor([k]), batch_size=9)
        upload, _ = alone.half.client_update(0, broadcast, alone.data)
        summed = {name: summed.get(name, 0) + value for name, value in upload.items()}
    assert summed["class_counts"].dtype == torch.int64
    for name in uploads:
        assert relative_error(summed[name].double(), uploads[name].double()) <= 1e-12, name


def test_closed_form_heads_are_identical_across_partitions(fit_method):
    fitted = []
    for partition in PARTITIONS:
        method = GHOFL(heads=["nb_diag", "lda", "qda", "fedcgs"])
        fit_method(method, data(**partition))
        fitted.append(method)
    for other in fitted[1:]:
        for name in CLOSED_FORM_BUFFERS:
            assert relative_error(getattr(other, name), getattr(fitted[0], name)) <= 1e-8, name


def test_heads_are_the_gaussian_formulas_on_the_pooled_data(fit_method):
    """Each head against a direct computation: torch.distributions, torch.cov, a dense solve."""
    dm, a = data(partition="dirichlet", alpha=0.3, num_clients=10), 0.1
    method = GHOFL(heads=["nb_diag", "lda", "qda", "fedcgs"], shrinkage=a)
    fit_method(method, dm)
    x, y, test = dm.train_features.double(), dm.train_labels, dm.test_features.double()
    classes = range(BLOBS.num_classes)
    log_prior = torch.log(torch.bincount(y) / len(y))
    means = torch.stack([x[y == c].mean(0) for c in classes])
    covs = torch.stack([torch.cov(x[y == c].T) for c in classes])
    scatter = sum((x[y == c] - means[c]).T @ (x[y == c] - means[c]) for c in classes)
    pooled = scatter / (len(x) - len(classes))
    normal = torch.distributions
    # NB-diag and QDA are the class log-densities plus log-priors, less d/2·log 2π
    constant = 0.5 * BLOBS.dim * math.log(2 * math.pi)
    deviations = [shrink(torch.diag_embed(cov.diagonal()), a).diagonal().sqrt() for cov in covs]
    nb = torch.stack([normal.Normal(means[c], deviations[c]).log_prob(test).sum(1)
                      for c in classes], 1) + log_prior
    assert relative_error(logits_of(method, "nb_diag", dm) - constant, nb) <= 1e-8
    qda = torch.stack([normal.MultivariateNormal(means[c], shrink(covs[c], a)).log_prob(test)
                       for c in classes], 1) + log_prior
    assert relative_error(logits_of(method, "qda", dm) - constant, qda) <= 1e-8
    # LDA and FedCGS are linear: Σ⁻¹μ_c and −½μ_cᵀΣ⁻¹μ_c + log π_c
    for head, cov in (("lda", shrink(pooled, a)), ("fedcgs", torch.cov(x.T))):
        weight = torch.linalg.solve(cov, means.T)
        assert relative_error(getattr(method, f"{head}_weight"), weight) <= 1e-8
        bias = -0.5 * (means * weight.T).sum(1) + log_prior
        assert relative_error(getattr(method, f"{head}_bias"), bias) <= 1e-8


def test_fisher_basis_solves_the_generalized_eigenproblem(fit_method):
    dm = data(partition="iid", num_clients=5)
    method = GHOFL(heads=["lda", "fishermix"], **QUICK)
    fit_method(method, dm)
    x, y, a = dm.train_features.double(), dm.train_labels, method.shrinkage
    prior = torch.bincount(y).double() / len(y)
    means = torch.stack([x[y == c].mean(0) for c in range(BLOBS.num_classes)])
    centered = means - prior @ means
    between = centered.T @ (prior[:, None] * centered)
    scatter = sum((x[y == c] - means[c]).T @ (x[y == c] - means[c]) for c in range(len(means)))
    within = shrink(scatter / (len(x) - len(means)), a)
    basis = method.fisher_basis
    # C − 1 = 3 nonzero eigenvalues, all needed for 99.5% of the energy
    assert basis.shape == (BLOBS.dim, BLOBS.num_classes - 1)
    identity = torch.eye(basis.shape[1], dtype=basis.dtype)
    assert torch.allclose(basis.T @ within @ basis, identity, atol=1e-10)
    eigenvalues = scipy.linalg.eigh(between.numpy(), within.numpy(), eigvals_only=True)
    eigenvalues = torch.from_numpy(eigenvalues)
    top = eigenvalues.flip(0)[:basis.shape[1]]
    assert torch.allclose(between @ basis, within @ basis * top, atol=1e-10)


def test_trained_heads_depend_on_the_seed_not_on_the_partition(fit_method):
    def trained(seed, **partition):
        method = GHOFL(heads=["lda", "fishermix", "proto_hyper"], seed=seed, **QUICK)
        fit_method(method, data(**partition))
        return method

    first = trained(0, partition="iid", num_clients=3)
    second = trained(0, partition="dirichlet", alpha=0.2, num_clients=20)
    other_seed = trained(1, partition="iid", num_clients=3)
    assert relative_error(second.fisher_basis, first.fisher_basis) <= 1e-8
    for head in ("fishermix", "proto_hyper"):
        state, same, other = (getattr(m, head).state_dict() for m in (first, second, other_seed))
        for name in state:
            assert torch.allclose(same[name], state[name], rtol=1e-5, atol=1e-6), (head, name)
        weight = "linear.weight" if head == "fishermix" else "up.weight"
        assert relative_error(other[weight], state[weight]) > 1e-2
        assert len(getattr(first, head).loss_curve) == 4
        test = data(partition="iid", num_clients=1)
        # LDA is near the Bayes rate on these blobs
        assert accuracy(first, head, test) > accuracy(first, "lda", test) - 0.05


def test_a_trained_head_needs_no_nested_trainer_and_is_deterministic_for_a_seed(fit_method, monkeypatch):
    """The heads train in a plain loop: the fit builds one Trainer (the outer one), and a head
    trained alone builds none; the same seed gives bit-identical weights and loss curves."""
    from lightning import LightningModule, Trainer

    from workbench.methods.gaussian_heads import FisherMixHead, ProtoHyperHead, train_on_synthetic

    built = []
    original = Trainer.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", counted)

    def fitted(seed: int) -> GHOFL:
        method = GHOFL(heads=["lda", "fishermix", "proto_hyper"], seed=seed, **QUICK)
        fit_method(method, data(partition="iid", num_clients=3))
        return method

    first, again = fitted(0), fitted(0)
    assert len(built) == 2  # one outer Trainer per fit, none nested
    for head in ("fishermix", "proto_hyper"):
        module = getattr(first, head)
        assert not isinstance(module, LightningModule) and not module.training
        assert len(module.loss_curve) == 4 and module.loss_curve == getattr(again, head).loss_curve
        state = getattr(again, head).state_dict()
        for name, value in module.state_dict().items():
            assert torch.equal(value, state[name]), (head, name)

    # Alone: the shuffling seed alone decides the result, and still no Trainer is built.
    monkeypatch.setattr(Trainer, "__init__", lambda *args, **kwargs: pytest.fail("a Trainer was built"))
    gen = torch.Generator().manual_seed(3)
    z, labels = torch.randn(300, 3, generator=gen), torch.arange(3).repeat(100)
    for cls, schedule in ((FisherMixHead, TrainingSchedule(epochs=3, lr=0.1, batch_size=64)),
                          (ProtoHyperHead, ProtoHyperTraining(epochs=3, lr=0.1, batch_size=64))):
        heads = {}
        for name, seed in (("first", 5), ("again", 5), ("other", 6)):
            torch.manual_seed(0)  # the same initialization
            heads[name] = cls(3, 3, schedule)
            train_on_synthetic(heads[name], z, labels, seed=seed, device=torch.device("cpu"))
        first, again, other = (heads[n].state_dict() for n in ("first", "again", "other"))
        assert all(torch.equal(first[name], again[name]) for name in first), cls.__name__
        assert heads["first"].loss_curve == heads["again"].loss_curve
        assert len(heads["first"].loss_curve) == 3
        assert any(not torch.equal(first[name], other[name]) for name in first), cls.__name__


# ---- accuracy of the Gaussian heads ---------------------------------------------------------
def gaussian_classes(means: torch.Tensor, factors: torch.Tensor, train: int, test: int,
                     seed: int = 0) -> Drawn:
    """Classes N(means[c], factors[c] factors[c]ᵀ), balanced."""
    def draw():
        gen = torch.Generator().manual_seed(seed)
        def sample(n):
            labels = torch.arange(n) % len(means)
            noise = torch.randn(n, means.shape[1], generator=gen)
            return means[labels] + torch.einsum("nij,nj->ni", factors[labels], noise), labels
        return (*sample(train), *sample(test))
    return Drawn(draw, num_classes=len(means), dim=means.shape[1])


def test_lda_reaches_the_bayes_error_of_two_gaussians_with_one_covariance(fit_method):
    """Equal priors, one Σ: the Bayes error is Φ(−Δ/2), Δ the Mahalanobis distance of the means."""
    gen = torch.Generator().manual_seed(1)
    factor = torch.randn(4, 4, generator=gen) + 2 * torch.eye(4)
    delta = 2.0
    direction = torch.randn(4, generator=gen)
    means = torch.stack([torch.zeros(4), factor @ (delta * direction / direction.norm())])
    dm = data(gaussian_classes(means, factor.expand(2, 4, 4), train=20000, test=40000),
              partition="dirichlet", alpha=0.3, num_clients=10)
    method = GHOFL(heads=["lda"], shrinkage=0.0)
    fit_method(method, dm)
    bayes = 0.5 * math.erfc(delta / 2 / math.sqrt(2))  # Φ(−Δ/2)
    assert abs((1 - accuracy(method, "lda", dm)) - bayes) < 0.01


def test_qda_beats_lda_when_the_class_covariances_differ(fit_method):
    means = torch.tensor([[0.0, 0, 0, 0], [0.5, 0, 0, 0]])
    factors = torch.stack([torch.eye(4), 3 * torch.eye(4)])  # covariances I and 9I
    dm = data(gaussian_classes(means, factors, train=4000, test=4000), partition="iid",
              num_clients=4)
    method = GHOFL(heads=["lda", "qda"])
    fit_method(method, dm)
    assert accuracy(method, "qda", dm) > 0.85
    assert accuracy(method, "qda", dm) > accuracy(method, "lda", dm) + 0.2


def test_shrinkage_keeps_every_head_finite_with_fewer_samples_than_dimensions(fit_method):
    # 10 samples per class in 30 dimensions
    few = SyntheticBlobs(num_classes=4, dim=30, train_size=40, test_size=200, seed=4)
    dm = data(few, partition="iid", num_clients=4)
    method = GHOFL(**QUICK)
    fit_method(method, dm)
    for head in HEADS:
        assert torch.isfinite(logits_of(method, head, dm)).all(), head
    with pytest.raises(ValueError, match="shrinkage"):
        fit_method(GHOFL(heads=["qda"], shrinkage=0.0), dm)


# ---- sketch and bytes ------------------------------------------------------------------------
def test_sketched_statistics_are_the_projected_statistics_and_cost_k_dimensions(fit_method):
    dm, k = data(partition="dirichlet", alpha=0.5, num_clients=6), 4
    method = Recording(heads=["nb_diag", "qda"], primary_head="qda", sketch_dim=k, sketch_seed=7)
    engine = fit_method(method, dm)
    gen = torch.Generator().manual_seed(7)
    sketch = torch.randn(BLOBS.dim, k, generator=gen, dtype=torch.float64) / math.sqrt(BLOBS.dim)
    pooled = pooled_statistics(dm.train_features, dm.train_labels, BLOBS.num_classes)
    assert relative_error(method.received["class_sums"], pooled["class_sums"] @ sketch) <= 1e-12
    projected = sketch.T @ pooled["class_second_moments"] @ sketch  # Rᵀ S_c R
    assert relative_error(method.received["class_second_moments"], projected) <= 1e-12
    # the heads are those of the projected features xR
    def projected():
        x, y, x_test, y_test = BLOBS.generate()
        return x.double() @ sketch, y, x_test.double() @ sketch, y_test
    plain = GHOFL(heads=["nb_diag", "qda"], primary_head="qda")
    fit_method(plain, data(Drawn(projected, BLOBS.num_classes, k), partition="iid",
                           num_clients=2))
    for name in ("nb_weight", "nb_bias", "qda_cholesky", "qda_bias"):
        assert relative_error(getattr(method, name), getattr(plain, name)) <= 1e-8, name
    c = BLOBS.num_classes
    assert engine.fit_metrics["comm/bytes_up_per_client"] == (c * k + c + c * k * (k + 1) // 2) * 8


@pytest.mark.parametrize("heads, sent", [
    (["lda"], "A N B"), (["nb_diag"], "A N D"), (["nb_diag", "fedcgs"], "A N B D"),
    (["qda"], "A N S"), (list(HEADS), "A N S"), (["fishermix"], "A N B")])
def test_bytes_per_client_are_the_analytic_count(fit_method, heads, sent):
    dm = data(partition="iid", num_clients=5)
    method = GHOFL(heads=heads, primary_head=heads[0], **QUICK)
    engine = fit_method(method, dm)
    c, d = BLOBS.num_classes, BLOBS.dim
    numbers = {"A": c * d, "N": c, "B": d * (d + 1) // 2, "D": c * d,
               "S": c * d * (d + 1) // 2}
    per_client = 8 * sum(numbers[s] for s in sent.split())  # float64 statistics, int64 counts
    assert engine.fit_metrics["comm/bytes_up_per_client"] == per_client
    assert engine.fit_metrics["comm/bytes_up"] == per_client * 5
    assert engine.fit_metrics["comm/rounds"] == 1


def test_the_broadcast_is_the_primary_head_and_the_sketch_seed(fit_method):
    dm = data(partition="iid", num_clients=5)
    method = GHOFL(heads=["lda", "qda"], sketch_dim=3)
    engine = fit_method(method, dm)
    c, k = BLOBS.num_classes, 3
    assert engine.fit_metrics["comm/bytes_down"] == 5 * ((k * c + c) * 8 + 8)


# ---- absent classes, errors, the command line ------------------------------------------------
def test_a_class_absent_from_every_client_is_excluded_with_a_warning(fit_method):
    def draw():
        x, y, x_test, y_test = BLOBS.generate()
        return x[y != 2], y[y != 2], x_test, y_test
    dm = data(Drawn(draw, BLOBS.num_classes, BLOBS.dim), partition="dirichlet", alpha=0.5,
              num_clients=6)
    method = GHOFL(**QUICK)
    with pytest.warns(UserWarning, match=r"classes \[2\] have no sample"):
        fit_method(method, dm)
    present = dm.test_labels != 2
    for head in HEADS:
        logits = logits_of(method, head, dm)
        assert torch.isneginf(logits[:, 2]).all(), head
        assert torch.isfinite(logits[:, [0, 1, 3]]).all(), head
        assert accuracy_on(logits[present], dm.test_labels[present]) > 0.7, head
    # the pooled covariance divides by N − (classes present)
    x, y = dm.train_features.double(), dm.train_labels
    means = {c: x[y == c].mean(0) for c in (0, 1, 3)}
    pooled = sum((x[y == c] - m).T @ (x[y == c] - m) for c, m in means.items()) / (len(x) - 3)
    expected = torch.linalg.solve(shrink(pooled, method.shrinkage), means[1])
    assert relative_error(method.lda_weight[:, 1], expected) <= 1e-10


def accuracy_on(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(1) == labels).double().mean())


@pytest.mark.parametrize("bad, match", [
    ({"heads": ["lda", "svm"]}, "heads"), ({"heads": []}, "heads"),
    ({"heads": ["lda"], "primary_head": "qda"}, "primary_head"),
    ({"shrinkage": 1.5}, "shrinkage"), ({"sketch_dim": 0}, "sketch_dim"),
    ({"synthesis": FisherSynthesis(energy=0.0)}, "energy"),
    ({"fishermix": TrainingSchedule(lr=0.0)}, "fishermix"),
    ({"proto_hyper": ProtoHyperTraining(distill_weight=2.0)}, "proto_hyper"),
    ({"fedcgs_ridge": -1.0}, "fedcgs")])
def test_bad_hyperparameters_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        GHOFL(**bad)


def test_cli_logs_every_heads_accuracy_and_reloads_the_trained_heads(tmp_path):
    schedule = {"epochs": 3, "lr": 0.1, "batch_size": 200}
    config = {
        "model": {"class_path": "GHOFL", "init_args": {
            "synthesis": {"per_class": 100}, "fishermix": schedule, "proto_hyper": schedule}},
        "data": {"class_path": "FederatedDataModule", "init_args": {
            "dataset": "synthetic", "num_clients": 5, "partition": "dirichlet", "alpha": 0.5,
            "synthetic": {"num_classes": 4, "dim": 8, "train_size": 400, "test_size": 200}}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["--config", str(path), "--trainer.enable_progress_bar=false"]
    main(["fit", *args, f"--run_dir={tmp_path / 'runs'}"])
    run = next((tmp_path / "runs").glob("*/version_0"))
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    logged = {k: float(v) for row in rows for k, v in row.items() if v}
    for head in HEADS:
        assert 0.5 < logged[f"test/acc/{head}"] <= 1, head
        assert f"time/server_s/{head}" in logged
    assert logged["test/acc"] == logged["test/acc/lda"]
    assert "fishermix/final_train_loss" in logged and "proto_hyper/final_train_loss" in logged
    cli = main(["test", *args, f"--run_dir={tmp_path / 'eval'}",
                f"--ckpt_path={run / 'model.ckpt'}"])
    for head in HEADS:
        reloaded = float(cli.trainer.callback_metrics[f"test/acc/{head}"])
        assert reloaded == pytest.approx(logged[f"test/acc/{head}"]), head


def test_the_trained_heads_loss_curves_are_logged_one_step_per_nested_epoch(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from workbench.engines import LightningEngine

    method = GHOFL(heads=["lda", "fishermix"], **QUICK)
    engine = LightningEngine(method)
    logger = CSVLogger(tmp_path, name="curve")
    quiet_trainer(logger=logger).fit(engine, datamodule=data(partition="iid", num_clients=2))
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").open()))
    assert sum(bool(row.get("fishermix/train_loss")) for row in rows) == len(method.fishermix.loss_curve) == 4
