"""The analytic start: a gradient method's last layer is the closed-form head of the activations
it reads (the methods' own fits on them, 1e-8 in float64), scaled by the temperature the clients'
hold-outs choose; with lr 0 it stays so; then the method's own rounds draw what a run without the
start draws."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tests.methods.conftest import data, fit64
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.local_training import LocalTraining
from workbench.methods import AFL, GHOFL, SCAFFOLD, Ditto, Fed3R, FedAvg, FedNCM, FedProx
from workbench.methods.analytic_start import ABSENT_LOGIT, AnalyticStart, activations
from workbench.methods.ridge_selection import client_holdout

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = {"AFL": {"gamma_out": 0.5, "bias": True}, "Fed3R": {"ridge": 0.1}, "FedNCM": {}, "LDA": {"shrinkage": 0.1}}
REFERENCE = {"AFL": lambda: AFL(gamma_out=0.5, bias=True), "Fed3R": lambda: Fed3R(ridge=0.1),
             "FedNCM": lambda: FedNCM(), "LDA": lambda: GHOFL(heads=("lda",), shrinkage=0.1)}


def start(method: str, **options) -> AnalyticStart:
    return AnalyticStart(method=method, settings=SETTINGS[method], **options)


def head(model: FedAvg) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer as (W (d_h, C), b (C,))."""
    last = model.net[-1]
    return last.weight.detach().T, last.bias.detach()


def reference_logits(name: str, dm, model) -> torch.Tensor:
    """The analytic method fitted in process on the activations h of the training rows (one
    client): its logits of h."""
    reference = REFERENCE[name]()
    h = activations(model.net, dm.train_features.double(), 1 << 14)
    labels = dm.train_labels

    holder = FederatedDataModule(dataset="synthetic", synthetic=SyntheticBlobs(num_classes=4, dim=h.shape[1],
                                 train_size=len(h), test_size=4), num_clients=1, min_partition_size=1)
    holder.setup()
    holder.train_features, holder.train_labels = h, labels
    holder.train_client_ids = torch.zeros_like(labels)
    fit64(reference, holder)
    return reference.to(torch.float64)(h)


@pytest.mark.parametrize("name", ["AFL", "Fed3R", "FedNCM", "LDA"])
@pytest.mark.parametrize("architecture", ["linear", "mlp"])
def test_lr_zero_keeps_the_analytic_head(name, architecture):
    """With lr 0 the model is the analytic head of h = body(x; w₀) over τ: its logits are the
    method's own (fitted centrally on h) over τ; FedNCM's are ‖h‖ times its cosine ones."""
    dm = data(num_clients=5, partition="dirichlet", alpha=0.5)
    model = FedAvg(num_rounds=2, architecture=architecture, hidden_dim=8, init_from=start(name, temperatures=(0.5,)),
                   local=LocalTraining(lr=0.0, batch_size=32))
    fit64(model, dm)
    assert int(model.rounds_done) == 3  # the start's round, then two of FedAvg's
    h = activations(model.net, dm.train_features.double(), 1 << 14)
    expected = reference_logits(name, dm, model)
    if name == "FedNCM":
        expected = expected * h.norm(dim=1, keepdim=True)
    got = model.to(torch.float64)(dm.train_features.double()) * 0.5
    assert relative_error(got, expected) < 1e-8


@pytest.mark.parametrize("name", ["AFL", "FedNCM", "LDA"])
def test_the_start_is_partition_invariant(name):
    """The head is a function of the pooled rows: any partition, the same W and b to 1e-8."""
    heads = []
    for partition in ({"partition": "iid"}, {"partition": "dirichlet", "alpha": 0.1},
                      {"partition": "shard", "num_shards_per_partition": 2}):
        model = FedAvg(num_rounds=1, architecture="linear", init_from=start(name, temperatures=(1.0,)),
                       local=LocalTraining(lr=0.0))
        fit64(model, data(num_clients=6, **partition))
        heads.append(head(model))
    for weight, bias in heads[1:]:
        assert relative_error(weight, heads[0][0]) < 1e-8 and relative_error(bias, heads[0][1]) < 1e-8


def test_the_temperature_is_chosen_on_the_holdouts():
    """Round 1 scores the candidate fitted without the hold-out rows; τ minimizes their pooled
    cross-entropy over the grid, and the kept head is the all-rows head / τ."""
    dm = data(num_clients=5, partition="dirichlet", alpha=0.5)
    grid = (0.05, 0.1, 0.2, 0.5, 1.0)
    model = FedAvg(num_rounds=1, architecture="linear", init_from=start("AFL", temperatures=grid),
                   local=LocalTraining(lr=0.0))
    fit64(model, dm)
    assert int(model.rounds_done) == 3
    held = client_holdout(dm.train_labels, dm.train_client_ids, torch.arange(5), 0.1, model.seed)
    # the candidate, ridge on the kept rows' [x, 1], scores the held rows
    x = dm.train_features.double()
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    y = F.one_hot(dm.train_labels, 4).double()
    kept = design[~held]
    w = torch.linalg.solve(kept.T @ kept + 0.5 * torch.eye(kept.shape[1], dtype=x.dtype), kept.T @ y[~held])
    z = design[held] @ w
    losses = [float(F.cross_entropy(z / t, dm.train_labels[held])) for t in grid]
    chosen = grid[min(range(len(grid)), key=lambda i: (losses[i], i))]
    assert float(model.start_temperature) == chosen
    full = torch.linalg.solve(design.T @ design + 0.5 * torch.eye(design.shape[1], dtype=x.dtype), design.T @ y)
    weight, bias = head(model)
    assert relative_error(weight.double() * chosen, full[:-1]) < 1e-6  # float32 model
    assert relative_error(bias.double() * chosen, full[-1]) < 1e-6


def test_the_gradient_rounds_draw_what_a_run_without_the_start_draws():
    """Round r of the method after the start takes round r's cohort, minibatches and learning
    rate: with the start's head loaded into a run without the start, both end equal (to the
    float32 rounding of the copied head)."""
    dm = data(num_clients=6, partition="dirichlet", alpha=0.5)
    local = LocalTraining(lr=0.1, batch_size=32, lr_schedule="cosine")
    started = FedAvg(num_rounds=3, architecture="mlp", hidden_dim=8, sample_fraction=0.5, local=local,
                     init_from=start("Fed3R", temperatures=(0.25,)))
    fit64(started, dm)
    plain = FedAvg(num_rounds=3, architecture="mlp", hidden_dim=8, sample_fraction=0.5, local=local)
    check = FedAvg(num_rounds=1, architecture="mlp", hidden_dim=8, init_from=start("Fed3R", temperatures=(0.25,)),
                   local=LocalTraining(lr=0.0))
    fit64(check, dm)
    plain.build_net = _loaded(plain.build_net, check.net)  # w₀ with the start's head, on the server and the clients
    fit64(plain, dm)
    for a, b in zip(started.net.parameters(), plain.net.parameters(), strict=True):
        assert relative_error(a, b) < 1e-6  # w₀ is built in float32: the copied head is rounded to it


def _loaded(build_net, source):
    def build(problem):
        net = build_net(problem)
        with torch.no_grad():
            for mine, theirs in zip(net.parameters(), source.parameters(), strict=True):
                mine.copy_(theirs)
        return net
    return build


@pytest.mark.parametrize("cls", [FedAvg, FedProx, SCAFFOLD])
def test_a_fixed_head_stays(cls):
    """`fixed_head`: the last layer is the start's after every round; the layers below train."""
    dm = data(num_clients=4)
    model = cls(num_rounds=2, architecture="mlp", hidden_dim=8, local=LocalTraining(lr=0.1, batch_size=32),
                init_from=start("FedNCM", temperatures=(0.5,), fixed_head=True))
    fit64(model, dm)
    check = FedAvg(num_rounds=1, architecture="mlp", hidden_dim=8, local=LocalTraining(lr=0.0),
                   init_from=start("FedNCM", temperatures=(0.5,)))  # the start alone
    fit64(check, dm)
    assert torch.equal(model.net[-1].weight, check.net[-1].weight)
    assert torch.equal(model.net[-1].bias, check.net[-1].bias)
    assert not torch.equal(model.net[1].weight, check.net[1].weight)


def test_an_absent_class_gets_a_finite_low_logit():
    """A class no client holds: weight 0, bias ABSENT_LOGIT (finite), never predicted."""
    dm = data(num_clients=3)
    keep = dm.train_labels != 3
    dm.train_features, dm.train_labels, dm.train_client_ids = (dm.train_features[keep], dm.train_labels[keep],
                                                              dm.train_client_ids[keep])
    model = FedAvg(num_rounds=1, architecture="linear", init_from=start("AFL", temperatures=(1.0,)),
                   local=LocalTraining(lr=0.1))
    fit64(model, dm)
    weight, bias = head(model)
    assert torch.isfinite(weight).all() and torch.isfinite(bias).all()
    assert (model(dm.test_features.double()).argmax(1) != 3).all()
    assert float(bias[3]) < ABSENT_LOGIT / 2


def test_bad_settings_are_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown init_from\.method"):
        AnalyticStart(method="PCA")
    with pytest.raises(ValueError, match="not AFL's settings"):
        AnalyticStart(method="AFL", settings={"ridge": 1.0})
    with pytest.raises(ValueError, match="random features"):
        AnalyticStart(method="Fed3R", settings={"random_features": 16})
    with pytest.raises(ValueError, match="temperatures"):
        AnalyticStart(method="AFL", temperatures=())
    with pytest.raises(ValueError, match="linear model has no other"):
        FedAvg(architecture="linear", init_from=AnalyticStart(method="AFL", fixed_head=True))
    with pytest.raises(ValueError, match="Ditto's personal models"):
        Ditto(init_from=AnalyticStart(method="AFL"))


@pytest.mark.parametrize("protocol", [Federation(dp_sigma=1e-3), Federation(dp_clip=0.1, dp_noise_multiplier=0.5)],
                         ids=["dp_sigma", "client_dp"])
def test_differential_privacy_is_refused_before_the_fit(protocol):
    from workbench.engines import LightningEngine

    engine = LightningEngine(FedAvg(architecture="linear", init_from=start("AFL")), protocol)
    with pytest.raises(ValueError, match="no differential-privacy accounting"):
        engine.check_data(data(num_clients=3), fitting=True)
